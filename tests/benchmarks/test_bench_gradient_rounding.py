"""benchmarks/gradient_rounding.py runs at toy sizes (``--small``) on any device, and its rows
show what the performance notes take from them: the logits' gradient rounded to bf16 sets the
fast mode's error, the logits' own rounding barely moves it, and a scaled float16 gradient
brings it to the floor that rounding the result to bf16 leaves."""

import json

from tests.support.bench_run import run_benchmark


def test_gradient_rounding_small(tmp_path):
    run_benchmark("benchmarks.gradient_rounding", "--small", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "gradient_rounding.json").read_text())["rows"]
    err = {
        (r["z_dtype"], r["dz_dtype"], r["result"]): (r["err_d_hidden"], r["err_d_weight"])
        for r in rows
    }
    assert len(err) == 8
    for k in (0, 1):
        assert err[("float32", "float32", "float32")][k] < 1e-5
        floor = err[("float32", "float32", "bfloat16")][k]
        assert 1e-3 < floor < 3e-3  # bf16's half unit in the last place, 2**-9, times ~0.6
        fast = err[("bfloat16", "bfloat16", "bfloat16")][k]
        assert fast > 1.25 * floor
        assert abs(err[("float32", "bfloat16", "bfloat16")][k] - fast) < 0.1 * fast
        assert abs(err[("float16", "float16", "bfloat16")][k] - floor) < 0.1 * floor
