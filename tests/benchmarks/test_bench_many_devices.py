"""benchmarks/bench_many_devices.py at toy sizes on four host devices: every layout it offers
runs for the plain code, lean and fast, and no weight or logits cross devices, but for the
head of the ``fsdp`` layout: gathered whole, its gradient reduce-scattered."""

import json
import re

import pytest

from tests.support.bench_run import run_benchmark

V, D = 1024, 64  # benchmarks.bench_many_devices.SIZES["smoke"]


@pytest.mark.parametrize("axes", [pytest.param("auto", marks=pytest.mark.slow), "explicit"])
def test_bench_many_devices_smoke(tmp_path, axes):
    run_benchmark(
        "benchmarks.bench_many_devices",
        "--smoke",
        "--layouts",
        "rows,vocab,both,fsdp",
        "--backends",
        "jnp_bf16,auto,fast",
        "--out",
        str(tmp_path),
        *(["--explicit"] if axes == "explicit" else []),
        xla_flags="--xla_force_host_platform_device_count=4",
    )
    [result] = tmp_path.glob("bench_many_devices_smoke*.json")
    rows = json.loads(result.read_text())["rows"]
    assert len(rows) == 2 * 3 * 4  # ops × impls × layouts
    for row in rows:
        assert "error" not in row and row["ms"] > 0 and row["devices"] == 4, row
        split = {"vocab": 4, "both": 2, "fsdp": 4}.get(row["layout"], 1)
        assert row["weight_mib_per_dev"] == V * D * 2 / 2**20 / split, row
        if row["layout"] == "fsdp" and row["backend"] != "jnp_bf16":
            assert re.search(rf"all-gather \w+\[{V},{D}\]", row["collectives"]), row
            assert re.search(rf"reduce-scatter \w+\[{V},{D // 4}\]", row["collectives"]), row
        elif row["backend"] != "jnp_bf16":  # ours never gathers the head or [N, V] logits
            for shape in re.findall(r"all-gather \w+\[([\d,]*)\]", row["collectives"]):
                dims = [int(x) for x in shape.split(",") if x]
                assert V not in dims and V // 2 not in dims, row


def test_time_split_of_a_two_gpu_trace(monkeypatch):
    """``--profile``'s summary of a synthetic trace: the first GPU's span, compute, GEMM and
    NCCL time with the part no compute overlaps, and each GPU's window in the host call
    (the second GPU starting late shows there); the first call's kernels are not counted."""
    from benchmarks import bench_many_devices, common

    def kernel(pid, start, dur, name):
        return dict(pid=pid, ts=start, dur=dur, name=name)

    kernels = [
        kernel(1, 10, 50, "nvjet_gemm"),  # call0's, left out
        kernel(1, 1100, 3000, "nvjet_sm90_gemm"),
        kernel(1, 4100, 300, "loop_fusion"),
        kernel(1, 3900, 800, "ncclDevKernel_AllReduce"),
        kernel(2, 1600, 3000, "nvjet_sm90_gemm"),
        kernel(2, 4700, 500, "ncclDevKernel"),
    ]
    host = [dict(name="call0", ts=0, dur=900), dict(name="call1", ts=1000, dur=5000)]
    meta = [
        dict(name="process_name", pid=p, args=dict(name=f"/device:GPU:{p - 1}")) for p in (2, 1)
    ]
    monkeypatch.setattr(common, "traced", lambda fn, args, calls: (kernels, host, meta))
    assert bench_many_devices.time_split(None, None) == (
        "span 3.60 ms: compute 3.30 (GEMMs 3.00), nccl 0.80 (0.30 not overlapped); "
        "call 5.00 ms, devices 0.10–3.70, 0.60–4.20"
    )
