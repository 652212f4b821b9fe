"""benchmarks/bench_head_gemms.py runs end to end at a toy size (``--small``) on any device, and
attributes a GPU trace's kernels to the head's GEMMs: the library's SM90 kernels by name, XLA's
by the output shape of the HLO instruction the trace names, else by the name the GEMM had
alone; anything else is ``other``."""

import json

import pytest

from tests.support.bench_run import run_benchmark


def test_bench_head_gemms_small(tmp_path):
    run_benchmark("benchmarks.bench_head_gemms", "--small", "--runs", "2", "--out", str(tmp_path))
    data = json.loads((tmp_path / "bench_head_gemms.json").read_text())
    assert {"device", "date", "jax", "commit"} <= set(data["meta"])
    rows = data["rows"]
    from benchmarks import bench_head_gemms as hg

    xla = {r["gemm"]: r for r in rows if r["pipeline"] == "XLA alone"}
    assert set(xla) == {*hg.GEMMS, "total"}
    for gemm in hg.GEMMS:
        r = xla[gemm]
        assert (r["N"], r["D"], r["V"]) == hg.SIZES["small"][0]
        assert r["ms"] > 0 and r["tflops"] == pytest.approx(2 * 128 * 96 * 1000 / r["ms"] / 1e9)
    assert sum(xla[g]["frac"] for g in hg.GEMMS) == pytest.approx(1.0)
    assert xla["total"]["ms"] == pytest.approx(sum(xla[g]["ms"] for g in hg.GEMMS))
    for pipeline in hg.PIPELINES:
        mine = [r for r in rows if r["pipeline"] == pipeline]
        assert mine and all("error" not in r and r["ms"] > 0 for r in mine), mine
        if mine[0]["timer"] == "wall":  # no GPU: no device kernels, one row that says so
            assert len(mine) == 1 and "no device kernels" in mine[0]["gemm"]
    md = (tmp_path / "bench_head_gemms.md").read_text()
    assert md.startswith("bench_head_gemms: ") and "| XLA alone | d_weight Gᵀ·h |" in md


def kernel(name, ts, dur, op=None):
    return {"name": name, "ts": ts, "dur": dur, "args": {"hlo_op": op} if op else {}}


HLO = """
ENTRY %main (p0: bf16[2,64,96], p1: bf16[1000,96]) -> bf16[1000,96] {
  %custom-call.1 = (bf16[128,1000]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm"
  %custom-call.2 = (bf16[2,64,96]{2,1,0}, s8[4194304]{0}) custom-call(%x, %p1)
  ROOT %gemm_fusion_dot.3 = bf16[1000,96]{1,0} fusion(%x, %p0), kind=kCustom
  %loop_convert_fusion = f32[128,1000]{1,0} fusion(%x), kind=kLoop
}
"""


def test_attribution_of_a_trace():
    from benchmarks import bench_head_gemms as hg

    size = (128, 96, 1000)
    shapes = hg.hlo_shapes(HLO)
    assert shapes["custom-call.1"] == (128, 1000) and shapes["custom-call.2"] == (2, 64, 96)
    assert shapes["gemm_fusion_dot.3"] == (1000, 96)
    known = {"nvjet_sm90_tst_NNT": {hg.GEMMS[1]}, "nvjet_sm90_tst_TNN": {hg.GEMMS[1], hg.GEMMS[2]}}
    lean = [
        kernel(
            "void jaxrl_sm90::linear_lse_kernel<jaxrl_sm90::Config<cutlass::bfloat16_t>>", 0, 30
        ),
        kernel(
            "void jaxrl_sm90::linear_grad_kernel<jaxrl_sm90::Config<cutlass::bfloat16_t>>", 30, 40
        ),
        kernel("cutlass::GemmUniversal<float, cutlass::half_t>", 70, 25),
        kernel("cutlass::GemmUniversal<cutlass::bfloat16_t>", 95, 25),
        kernel("jaxrl_sm90::combine_kernel(float const*)", 120, 2),
        kernel("loop_convert_fusion", 122, 3),
    ]
    fast = [
        kernel("void jaxrl_sm90::linear_lse_kernel<x>", 0, 30),
        kernel("nvjet_sm90_tst_256x128_NTT", 30, 20, op="custom-call.2"),  # by its shape
        kernel("gemm_fusion_dot_3", 50, 21, op="gemm_fusion_dot.3"),
        kernel("nvjet_sm90_tst_NNT", 71, 5),  # by its name alone (one GEMM ran it alone)
        kernel("nvjet_sm90_tst_TNN", 76, 4),  # two GEMMs ran it alone: unmatched
        kernel("input_reduce_fusion", 80, 10),
    ]
    got = [hg.attribute(k, shapes, known, size) for k in lean + fast]
    assert got == [
        hg.GEMMS[0],
        hg.AGAIN,
        hg.GEMMS[1],
        hg.GEMMS[2],
        hg.OTHER,
        hg.OTHER,
        hg.GEMMS[0],
        hg.GEMMS[1],
        hg.GEMMS[2],
        hg.GEMMS[1],
        hg.UNMATCHED,
        hg.OTHER,
    ]
    base = {"N": 128, "D": 96, "V": 1000}
    groups, busy, span = hg.summarise([fast, fast], shapes, known, size)
    assert busy == 90 and span == 90
    rows = {r["gemm"]: r for r in hg.pipeline_rows(base, "fast", groups, busy, span, 2, 0.5)}
    assert list(rows) == [hg.GEMMS[0], hg.GEMMS[1], hg.GEMMS[2], hg.UNMATCHED, hg.OTHER, "total"]
    assert rows[hg.GEMMS[1]]["ms"] == pytest.approx(0.025) and rows[hg.GEMMS[1]]["launches"] == 2
    assert rows[hg.GEMMS[0]]["tflops"] == pytest.approx(2 * 128 * 96 * 1000 / 30e-6 / 1e12)
    assert "tflops" not in rows[hg.UNMATCHED] and "tflops" not in rows[hg.OTHER]
    assert rows[hg.UNMATCHED]["kernels"].startswith("nvjet_sm90_tst_TNN ×1 0.004")
    assert sum(r["frac"] for g, r in rows.items() if g != "total") == pytest.approx(1.0)
    assert rows["total"]["ms"] == pytest.approx(0.09) and rows["total"]["wall_ms"] == 0.5


def test_rows_from_a_device_trace(tmp_path, monkeypatch):
    """With device kernels in the traces (a GPU's, faked here), the ``XLA alone`` rows take
    the kernels' time and teach the pipelines their names; each pipeline's rows add up."""
    import itertools

    from benchmarks import bench_head_gemms as hg
    from benchmarks import common

    traces = itertools.count()
    alone = ["nvjet_sm90_A", "nvjet_sm90_B", "nvjet_sm90_C"]

    def traced(fn, args, calls=1):
        t = next(traces)
        names = [alone[t]] if t < 3 else ["void jaxrl_sm90::linear_lse_kernel<x>", alone[1]]
        names += ["input_reduce_fusion"]
        host, kernels = [], []
        for i in range(calls):
            host.append({"name": f"call{i}", "ts": 1000.0 * i, "dur": 900.0})
            kernels += [
                {"name": name, "ts": 1000.0 * i + 10 + 100 * j, "dur": 50.0 * (j + 1)}
                for j, name in enumerate(names)
            ]
        return kernels, host, []

    monkeypatch.setattr(common, "traced", traced)
    rows = hg.main(["--small", "--runs", "1", "--pipelines", "fast", "--out", str(tmp_path)])
    by = {(r["pipeline"], r["gemm"]): r for r in rows}
    d_hidden = by[("XLA alone", hg.GEMMS[1])]
    assert d_hidden["timer"] == "device" and d_hidden["ms"] == pytest.approx(0.15)
    assert d_hidden["kernels"] == "input_reduce_fusion ×1 0.100; nvjet_sm90_B ×1 0.050"
    assert by[("fast", hg.GEMMS[0])]["ms"] == pytest.approx(0.05)
    assert by[("fast", hg.GEMMS[1])]["ms"] == pytest.approx(0.1)
    assert by[("fast", hg.OTHER)]["ms"] == pytest.approx(0.15)
    total = by[("fast", "total")]
    assert total["ms"] == pytest.approx(0.3) and total["span_ms"] == pytest.approx(0.35)
    assert sorted(r["gemm"] for r in rows if r["pipeline"] == "fast") == sorted(
        [hg.GEMMS[0], hg.GEMMS[1], hg.OTHER, "total"]
    )
