"""benchmarks/bench_sampler_logprobs.py (and its study, benchmarks/studies/
bench_sampler_forward.py) runs end to end at toy sizes (``--small``) on the CPU, in this
process, and its rows say what its docstring promises."""

import json
import math

import pytest

from benchmarks import bench_sampler_logprobs as bench


@pytest.mark.slow  # ~25 s of CPU; test_bench_sampler_forward_small runs in CI
def test_bench_sampler_logprobs_small(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    rows = bench.main(["--small", "--runs", "2", "--rounds", "1"])
    data = json.loads((tmp_path / "bench_sampler_logprobs.json").read_text())
    assert data["rows"] == rows and {"device", "date", "jax", "commit"} <= set(data["meta"])
    [(n, d, v)] = bench.SIZES["small"]
    assert len(rows) == 3 * len(bench.TRUNCATIONS)
    base = next(r for r in rows if r["impl"] == "lean" and r["truncation"] == "none")
    assert base["x_plain"] == 1.0
    for row in rows:
        assert not row.get("error"), row
        assert (row["N"], row["D"], row["V"]) == (n, d, v), row
        assert math.isfinite(row["fwdbwd_ms"]) and row["fwdbwd_ms"] > 0, row
        assert math.isclose(row["x_plain"], row["fwdbwd_ms"] / base["fwdbwd_ms"], rel_tol=1e-12), (
            row
        )
        assert row["no_nv_buffer"] == (row["temp_mib"] < row["nv_mib"]), row
        # bf16 inputs: the gradients are rounded to bf16 (relative step 2⁻⁸)
        assert 0 < row["err_dh"] < 2e-2 and 0 < row["err_dW"] < 2e-2, row
        if row["impl"] == "lean":
            assert row["err_logp"] < 1e-4, row
        if row["truncation"] != "none":
            assert 1 <= row["kept"] < v, row
    table = (tmp_path / "bench_sampler_logprobs.md").read_text()
    assert "| " + " | ".join(bench.COLUMNS) + " |" in table


def test_bench_sampler_forward_small(tmp_path, monkeypatch):
    from benchmarks.studies import bench_sampler_forward as forward
    from jaxrl_kernels.backends.ffi import kept_set as ffi_kept_set
    from jaxrl_kernels.engine import logprob_core

    skip, block = logprob_core.stats_from_kept_set, ffi_kept_set.ROW_BLOCK_BYTES
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    rows = forward.main(["--small", "--runs", "2", "--rounds", "1"])
    assert (logprob_core.stats_from_kept_set, ffi_kept_set.ROW_BLOCK_BYTES) == (skip, block)
    assert len(rows) == 1 + (len(forward.TRUNCATIONS) - 1) * len(forward.VARIANTS)
    assert rows[0]["variant"] == "none" and rows[0]["x_plain"] == 1.0
    for name in forward.TRUNCATIONS:
        losses = {row["loss"] for row in rows if row["truncation"] == name}
        assert len(losses) == 1 and all(math.isfinite(x) for x in losses), name
    assert all(math.isfinite(row["fwdbwd_ms"]) and row["fwdbwd_ms"] > 0 for row in rows)
    data = json.loads((tmp_path / "bench_sampler_forward.json").read_text())
    assert data["rows"] == rows
