"""benchmarks/bench_many_devices.py at toy sizes on four host devices: every layout it offers
runs for the plain code, lean and fast, and no weight or logits cross devices."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
V, D = 1024, 64  # benchmarks.bench_many_devices.SIZES["smoke"]


@pytest.mark.parametrize("axes", [pytest.param("auto", marks=pytest.mark.slow), "explicit"])
def test_bench_many_devices_smoke(tmp_path, axes):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_many_devices", "--smoke",
         "--layouts", "rows,vocab,both", "--backends", "jnp_bf16,auto,fast", "--out", str(tmp_path)]
        + (["--explicit"] if axes == "explicit" else []),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [result] = tmp_path.glob("bench_many_devices_smoke*.json")
    rows = json.loads(result.read_text())["rows"]
    assert len(rows) == 2 * 3 * 3  # ops × impls × layouts
    for row in rows:
        assert "error" not in row and row["ms"] > 0 and row["devices"] == 4, row
        split = {"vocab": 4, "both": 2}.get(row["layout"], 1)
        assert row["weight_mib_per_dev"] == V * D * 2 / 2**20 / split, row
        if row["backend"] != "jnp_bf16":  # ours never gathers the head or [N, V] logits
            for shape in re.findall(r"all-gather \w+\[([\d,]*)\]", row["collectives"]):
                dims = [int(x) for x in shape.split(",") if x]
                assert V not in dims and V // 2 not in dims, row
