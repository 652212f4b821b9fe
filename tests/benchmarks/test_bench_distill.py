"""benchmarks/bench_distill.py runs end to end at toy sizes (``--small``) on any device."""

import json

import pytest

from tests.support.bench_run import run_benchmark


@pytest.mark.slow  # ~50 s of CPU
def test_bench_distill_small(tmp_path):
    run_benchmark(
        "benchmarks.bench_distill",
        "--small",
        "--rounds",
        "1",
        "--runs",
        "1",
        "--divergences",
        "reverse_kl,jsd",
        "--out",
        str(tmp_path),
    )
    rows = json.loads((tmp_path / "bench_distill.json").read_text())["rows"]
    by = {(r["variant"], r["divergence"]): r for r in rows}
    for d in ("reverse_kl", "jsd"):
        for variant in ("ours (chunked)", "jnp materialised", "GEMMs alone, chunked"):
            row = by[(variant, d)]
            assert not row.get("error") and row["fwdbwd_ms"] > 0 and row["temp_mib"] >= 0, row
        lean, fast = (by[(f"GEMMs each alone, {s}", d)] for s in ("lean schedule", "3 S + T"))
        assert lean["fwdbwd_ms"] > fast["fwdbwd_ms"] > fast["fwd_ms"] > 0, (lean, fast)
        ours, plain = by[("ours (chunked)", d)]["loss"], by[("jnp materialised", d)]["loss"]
        assert abs(ours - plain) <= 1e-2 * max(abs(plain), 1.0), (d, ours, plain)
    liger = by[("liger fused_linear_jsd", "jsd")]
    assert (
        liger.get("fwdbwd_ms") or liger.get("note", "").startswith("skipped") or liger.get("error")
    ), liger
    assert (tmp_path / "bench_distill.md").exists()
