"""linear_logprobs: pallas vs chunked vs reference (materialised logits), beside one GEMM.

For each size (bf16, ``weight_layout="vd"``): the median time of the forward (logp only,
and pallas with entropy) and of forward + backward (gradient to hidden and weight of
Σ g·logp), XLA's temp buffer size of each compiled function, and the time of the single
[N, D] x [D, V] product (XLA, bf16 out) measured in the same process. One command line for
every linear-head benchmark; the device-time and kernel ones live in
``bench_linear_device.py`` and ``bench_linear_kernels.py``, what they share in
``linear_harness.py``, measurement-only kernel variants in ``variants/``.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear                # the table
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --sweep        # pallas tile configs
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --backward     # backward variants, auto
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --sizes tiny   # smoke test (any device)
    PYTHONPATH=$PWD ncu --clock-control none -k regex:'stats|gemm|nvjet' \
        --section SpeedOfLight --section WarpStateStats \
        python3 -m benchmarks.bench_linear --profile                   # what limits the forward
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --profile-backward vd,dv  # per kernel
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --kernels      # SM90 kernels vs one GEMM
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --fused        # one-call ffi backward A/B
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --timeline     # wall clock vs device time
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --device-times # GEMM/fwd/fwd+bwd, device
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --clocks ops   # SM clock, power, back to back

Results: ``bench_linear.{json,md}`` / ``bench_linear_sweep.{json,md}`` in out/bench (``--out``,
``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import functools
import os

import jax

from benchmarks import bench_linear_device as device
from benchmarks import bench_linear_kernels as kernels
from benchmarks import common, output
from benchmarks.linear_harness import (ROUNDS, against_gemm, ffi_chunks, ffi_variant,
                                       gemm_call, gemm_row, inputs, make_config,
                                       measure_variants, op_fns, primitive, public, sized, timed)
from jaxrl_kernels.backends.pallas import linear as pallas_linear

SIZES = {
    "tiny": [(64, 96, 1000)],
    "all": [(4096, 2048, 32768), (4096, 2048, 50257), (4096, 2048, 131072),
            (8192, 4096, 151936)],
    "sweep": [(4096, 2048, 131072)],
    "backward": [(4096, 2048, 131072), (8192, 4096, 131072)],
    "backward_base": [(4096, 2048, 131072)],
    "backward_large": [(8192, 4096, 131072)],
}

COLUMNS = ["N", "D", "V", "impl", "fwd_ms", "fwd_x_gemm", "fwdbwd_ms", "fwdbwd_x_gemm",
           "fwd_temp_mib", "fwdbwd_temp_mib", "gemm_ms"]


def table(sizes, backends):
    rows = []
    for n, d, v in sizes:
        (h, w, t, g), gemm, base = sized(n, d, v)
        rows.append(gemm_row(base))
        variants = [(name, public(name)) for name in backends]
        if "pallas" in backends:
            variants.insert(1, ("pallas+entropy", public("pallas", return_entropy=True)))
        rows += measure_variants(variants, base, h, w, t, g, gemm)
        del h, w
    return rows


FWD_VARIANTS = {
    "128x256x64 w8 s4 tps4": dict(forward=(128, 256, 64, 8, 4), tiles_per_split=4),
    "128x256x64 w8 s4 tps2": dict(forward=(128, 256, 64, 8, 4), tiles_per_split=2),
    "128x256x64 w8 s4 tps8": dict(forward=(128, 256, 64, 8, 4), tiles_per_split=8),
    "128x256x64 w8 s4 tps16": dict(forward=(128, 256, 64, 8, 4), tiles_per_split=16),
    "128x256x64 w8 s5 tps4": dict(forward=(128, 256, 64, 8, 5), tiles_per_split=4),
    "128x256x32 w8 s6 tps4": dict(forward=(128, 256, 32, 8, 6), tiles_per_split=4),
    "256x128x64 w8 s4 tps8": dict(forward=(256, 128, 64, 8, 4), tiles_per_split=8),
    "128x128x64 w8 s4 tps8": dict(forward=(128, 128, 64, 8, 4), tiles_per_split=8),
}
GEMM_ONLY = ("128x256x64 w8 s4 tps4",)  # also its statistics kernel alone, with and without softmax

BWD_VARIANTS = {
    "pallas fwd+bwd, f16 G (Triton recompute), 32 MiB": dict(),
}


def backward_table(sizes):
    """The automatic choice, the ffi backward at two more chunk sizes and as a loop of XLA
    GEMMs, the ffi forward with the Triton-recompute backward, pallas variants and XLA's
    materialised path, both weight layouts, per size."""
    from benchmarks.variants import ffi_xla_gemms
    from jaxrl_kernels.backends import ffi

    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            (h, w, t, g), gemm, base = sized(n, d, v, layout)
            variants = [(f"auto, {layout}", public(None, weight_layout=layout))]
            if ffi.unavailable_reason() is None:
                for mib in (32, 128):
                    variants.append((f"ffi fwd + ffi bwd {mib} MiB chunks, {layout}",
                                     ffi_variant(layout, ffi_chunks(mib))))
                variants.append((f"ffi fwd + ffi bwd as a loop of XLA GEMMs, {layout}",
                                 ffi_variant(layout, ffi_xla_gemms.linear_backward)))
                variants.append((f"ffi fwd + pallas (Triton) bwd, {layout}", ffi_variant(
                    layout, pallas_linear.linear_backward)))
            if layout == "vd":
                variants += [(name, primitive(make_config(**kw)))
                             for name, kw in BWD_VARIANTS.items()]
            variants.append((f"reference (XLA materialised), {layout}",
                             public("reference", weight_layout=layout)))
            rows += measure_variants(variants, base, h, w, t, g, gemm)
            del h, w
    return rows


def epilogue_rows(name, config, h, w, base, gemm):
    """The statistics kernel alone under ``config``, and the same kernel with its softmax cut
    to a running max (``variants/pallas_max_epilogue.py``): what the epilogue costs."""
    from benchmarks.variants import pallas_max_epilogue

    rows = []
    for label, fn in ((" stats kernel alone", pallas_max_epilogue.stats_call),
                      (" stats kernel alone, GEMM+max only", pallas_max_epilogue.max_call)):
        call = jax.jit(functools.partial(fn, layout="vd", config=config))
        ms = timed(call, h, w)
        rows.append({**base, "impl": name + label, "fwd_ms": ms, "fwd_x_gemm": ms / gemm,
                     "fwd_temp_mib": common.temp_mib(call, h, w)})
        print(rows[-1], flush=True)
    return rows


def sweep(sizes):
    rows = []
    for n, d, v in sizes:
        (h, w, t, g), gemm, base = sized(n, d, v)
        rows.append(gemm_row(base))
        for name, kw in FWD_VARIANTS.items():
            rows += measure_variants([(name, primitive(make_config(**kw)))], base, h, w, t, g,
                                     gemm, want_bwd=False)
            if name in GEMM_ONLY:
                rows += epilogue_rows(name, make_config(**kw), h, w, base, gemm)
        rows += measure_variants([(name, primitive(make_config(**kw)))
                                  for name, kw in BWD_VARIANTS.items()], base, h, w, t, g, gemm)
        for layout in ("dv",):
            args, gemm_dv, _ = sized(n, d, v, layout)
            rows += measure_variants(
                [(f"default, weight_layout={layout}",
                  primitive(pallas_linear.DEFAULT_CONFIG, layout=layout))],
                base, *args, gemm_dv)
    return rows


def profile_targets():
    """One call each of the pallas forward, its statistics kernel with the epilogue cut to a
    running max, XLA's GEMM and the pallas forward+backward at N=4096, D=2048, V=131072 (for
    ``ncu -k regex:'stats|gemm|nvjet'``)."""
    from benchmarks.variants import pallas_max_epilogue

    h, w, t, _ = inputs(4096, 2048, 131072)
    config = pallas_linear.DEFAULT_CONFIG
    jax.block_until_ready(jax.jit(primitive(config))(h, w, t))
    jax.block_until_ready(jax.jit(functools.partial(
        pallas_max_epilogue.max_call, layout="vd", config=config))(h, w))
    jax.block_until_ready(gemm_call("vd")(h, w))
    g = jax.numpy.ones(t.shape, jax.numpy.float32)
    _, fwdbwd = op_fns(primitive(config))
    jax.block_until_ready(fwdbwd(h, w, t, g))


FUSED_CHUNKS_MIB = (32, 64, 128)


def fused_table(sizes):
    """Forward+backward with the ffi backward as one custom call (CUTLASS GEMMs) at several
    chunk sizes, against the same chunks as a loop of the grad call and XLA's GEMMs
    (``variants/ffi_xla_gemms.py``), both layouts, timed in rotated rounds after a second of
    GEMMs; each row with XLA's temp size."""
    from benchmarks.variants import ffi_xla_gemms

    def variants(h, w, t, g, layout):
        out = {}
        for mib in FUSED_CHUNKS_MIB:
            fwdbwd = op_fns(ffi_variant(layout, ffi_chunks(mib)))[1]
            out[f"one call, CUTLASS GEMMs, {mib} MiB chunks"] = (fwdbwd, (h, w, t, g))
        fwdbwd = op_fns(ffi_variant(layout, ffi_xla_gemms.linear_backward))[1]
        out["grad call in a loop of XLA GEMMs, 64 MiB chunks"] = (fwdbwd, (h, w, t, g))
        return out

    rows = []
    for base, name, ms, gemm, (fn, args) in against_gemm(sizes, variants):
        rows.append({**base, "impl": name, "fwdbwd_ms": ms, "fwdbwd_x_gemm": ms / gemm,
                     "fwdbwd_temp_mib": common.temp_mib(fn, *args), "gemm_ms": gemm,
                     "rounds": ROUNDS})
        print(rows[-1], flush=True)
    return rows


def _sizes(args, default):
    return default if args.sizes == "all" else SIZES[args.sizes]


def _clock_rows(kind, n=4096, d=2048):
    return [{"N": n, "D": d, **row}
            for row in kernels.steady_state(kernels.clock_variants(kind, n, d))]


def _tables(args):
    """The mode the flags ask for, as (results name, rows thunk, columns), or None."""
    if args.fused:
        return ("bench_fused_backward", lambda: fused_table(_sizes(args, SIZES["backward"])),
                ["N", "D", "V", "layout", "impl", "fwdbwd_ms", "fwdbwd_x_gemm",
                 "fwdbwd_temp_mib", "gemm_ms", "rounds"])
    if args.timeline:
        tag = "_nocmdbuf" if "enable_command_buffer=" in os.environ.get("XLA_FLAGS", "") else ""
        return ("bench_timeline" + tag, device.timeline,
                ["N", "D", "V", "impl", "blocking_ms", "pipelined_ms", "reps", "trace_lead_ms",
                 "trace_span_ms", "trace_busy_ms", "trace_tail_ms", "traced_calls", "xla_flags"])
    if args.clocks:
        return (f"bench_clocks_{args.clocks}", lambda: _clock_rows(args.clocks),
                ["N", "D", "V", "layout", "impl", "per_call_ms", "energy_j", "sm_clock_mhz",
                 "power_w", "power_limit_w", "temperature_c", "clock_reasons", "calls",
                 "rounds"])
    if args.device_times:
        return ("bench_device_times", lambda: device.device_table(
                    _sizes(args, device.DEVICE_SIZES)),
                ["N", "D", "V", "layout", "impl", "device_ms", "x_gemm", "busy_ms",
                 "blocking_ms", "pipelined_ms", "calls"])
    if args.kernels:
        return ("bench_sm90_kernels", kernels.kernel_table,
                ["N", "D", "V", "layout", "kernel", "ms", "x_gemm", "gemm_ms", "rounds"])
    if args.backward:
        return ("bench_linear_backward", lambda: backward_table(_sizes(args, SIZES["backward"])),
                COLUMNS + ["error"])
    if args.sweep:
        return ("bench_linear_sweep", lambda: sweep(_sizes(args, SIZES["sweep"])),
                COLUMNS + ["error"])
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--sizes", default="all", choices=sorted(SIZES))
    parser.add_argument("--backends", default="pallas,chunked,reference")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--backward", action="store_true",
                        help="backward variants and the automatic choice, both layouts")
    parser.add_argument("--profile", action="store_true", help="one call of each, for ncu")
    parser.add_argument("--profile-backward", metavar="LAYOUTS",
                        help="per-kernel device time of one automatic fwd+bwd per layout "
                             "(e.g. vd,dv), from a jax profiler trace")
    parser.add_argument("--profile-fused-loss", metavar="LAYOUTS",
                        help="the same for linear_grpo_loss(memory='fast'), whose gradient is "
                             "taken in the forward")
    parser.add_argument("--fused", action="store_true",
                        help="fwd+bwd: the one-call ffi backward at several chunk sizes against "
                             "the loop of XLA GEMMs")
    parser.add_argument("--kernels", action="store_true",
                        help="the SM90 forward and logit-gradient kernels alone, beside one GEMM")
    parser.add_argument("--timeline", action="store_true",
                        help="fwd+bwd: synchronised wall clock against back-to-back calls and "
                             "the device span of a profiler trace")
    parser.add_argument("--clocks", choices=("ops", "forward", "kernels", "chunks"),
                        help="SM clock, power and time per call of variants run back to back "
                             "(see bench_linear_kernels.clock_variants)")
    parser.add_argument("--device-times", action="store_true",
                        help="device time (profiler trace) of GEMM, forward and fwd+bwd, both "
                             "layouts, at V = 32768, 131072, 151936")
    parser.add_argument("--ncu-summary", help="summarize an ncu --csv duration log")
    args = parser.parse_args()
    if args.ncu_summary:
        device.ncu_summary(args.ncu_summary)
    elif args.profile:
        profile_targets()
    elif args.profile_backward:
        device.profile_backward(args.profile_backward.split(","))
    elif args.profile_fused_loss:
        device.profile_backward(args.profile_fused_loss.split(","), fused_loss=True)
    else:
        print(common.metadata(), flush=True)
        name, rows, columns = _tables(args) or (
            "bench_linear", lambda: table(SIZES[args.sizes], args.backends.split(",")),
            COLUMNS + ["error"])
        print(common.write_results(name, rows(), columns))


if __name__ == "__main__":
    main()
