"""benchmarks/bench_topk_distill.py runs end to end at toy sizes (``--small``) on the CPU, in
this process, and its rows say what its docstring promises."""

import json
import math

import numpy as np

from benchmarks import bench_topk_distill as bench

IMPLS = (
    "logprobs 1 id",
    "logprobs K ids",
    "topk lean",
    "topk lean bucket",
    "topk fast",
    "jnp bf16",
)


def test_teacher_ids_are_distinct_and_hold_part_of_the_mass():
    ids, logp = bench.teacher(np.random.default_rng(1), 256, 40, 8)
    assert ids.shape == logp.shape == (256, 8) and ids.min() >= 0 and ids.max() < 40
    assert all(len(set(row)) == 8 for row in ids.tolist())
    mass = np.exp(logp).sum(axis=1)
    assert np.all(mass < 0.99) and np.all(mass >= 0.5 - 1e-6)
    assert np.all(np.diff(logp, axis=1) <= 0)  # in the teacher's order


def test_bench_topk_distill_small(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    rows = bench.main(["--small", "--runs", "2", "--rounds", "1"])
    data = json.loads((tmp_path / "bench_topk_distill.json").read_text())
    assert data["rows"] == rows and {"device", "date", "jax", "commit"} <= set(data["meta"])
    [(n, d, v, k)] = bench.SIZES["small"]
    by = {r["impl"]: r for r in rows}
    assert sorted(by) == sorted(IMPLS) and len(rows) == len(IMPLS)
    base = by["logprobs 1 id"]["fwdbwd_ms"]
    for impl, row in by.items():
        assert not row.get("error"), row
        assert (row["N"], row["D"], row["V"], row["K"]) == (n, d, v, k), row
        assert math.isfinite(row["fwdbwd_ms"]) and row["fwdbwd_ms"] > 0, row
        assert math.isclose(row["x_1id"], row["fwdbwd_ms"] / base, rel_tol=1e-12), row
        assert row["temp_mib"] >= 0 and row["no_nv_buffer"] == (row["temp_mib"] < row["nv_mib"])
        # bf16 inputs against a float64 reference on the same inputs: the loss is float32
        # arithmetic (the fast mode's from float16 logits), the gradients are rounded to bf16
        # (relative step 2⁻⁸)
        assert row["err_loss"] < (1e-3 if impl == "topk fast" else 1e-5), row
        assert 0 < row["err_dh"] < 2e-2 and 0 < row["err_dW"] < 2e-2, row
        assert 0.5 <= row["teacher_mass"] < 0.99, row
    assert by["logprobs 1 id"]["x_1id"] == 1.0
    drop = by["jnp bf16"]["loss"]
    assert drop > 0
    for impl in ("topk lean", "topk fast"):
        assert abs(by[impl]["loss"] - drop) <= 1e-3 * drop, (impl, by[impl]["loss"], drop)
    assert by["topk lean bucket"]["loss"] != by["topk lean"]["loss"]
    assert by["logprobs K ids"]["loss"] < 0 and by["logprobs 1 id"]["loss"] < 0
    table = (tmp_path / "bench_topk_distill.md").read_text()
    assert "| " + " | ".join(bench.COLUMNS) + " |" in table
    assert all(f"| {impl} |" in table for impl in IMPLS)
