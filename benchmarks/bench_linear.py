"""linear_logprobs: pallas vs chunked vs reference (materialised logits), beside one GEMM.

For each size (bf16, ``weight_layout="vd"``): the median time of the forward (logp only,
and pallas with entropy) and of forward + backward (gradient to hidden and weight of
Σ g·logp), XLA's temp buffer size of each compiled function, and the time of the single
[N, D] x [D, V] product (XLA, bf16 out) measured in the same process. The command line of
the maintained linear-head measurements; the device-time ones live in
``bench_linear_device.py``, what they share in ``linear_harness.py``. The kernel-level
studies (the SM90 kernels alone, the one-call backward against a loop of XLA GEMMs, backward
variants, Pallas launch plans, clocks at the power limit) are
``python -m benchmarks.studies.linear_kernels``.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear                # the table
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --sizes tiny   # smoke test (any device)
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --sizes fast --backends fast,fast-logits-kept
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --profile-backward vd,dv  # per kernel
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --timeline     # wall clock vs device time
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --device-times # GEMM/fwd/fwd+bwd, device

Results: ``bench_linear.{json,md}`` in out/bench (``--out``, ``--update-results``:
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os

from benchmarks import bench_linear_device as device
from benchmarks import common, output
from benchmarks.linear_harness import gemm_row, measure_variants, public, sized

SIZES = {
    "tiny": [(64, 96, 1000)],
    "all": [(4096, 2048, 32768), (4096, 2048, 50257), (4096, 2048, 131072), (8192, 4096, 151936)],
    "fast": [(4096, 2048, 131072), (16384, 4096, 131072)],
}

FAST_VARIANTS = ("fast", "fast-logits-kept")
"""``--backends`` names beside the backends': ``memory="fast"`` (automatic backend), and the
same with its relative form withheld (``bench_tokens.logits_kept``: the logits kept, the
gradient formed over them in the backward)."""


def variant(name):
    """The call that ``--backends``' ``name`` measures."""
    if name == "fast":
        return public(None, memory="fast")
    if name == "fast-logits-kept":
        from benchmarks.bench_tokens import logits_kept

        return logits_kept(public(None, memory="fast"))
    return public(name)


COLUMNS = [
    "N",
    "D",
    "V",
    "impl",
    "fwd_ms",
    "fwd_x_gemm",
    "fwdbwd_ms",
    "fwdbwd_x_gemm",
    "fwd_temp_mib",
    "fwdbwd_temp_mib",
    "gemm_ms",
]


def table(sizes, backends):
    rows = []
    for n, d, v in sizes:
        (h, w, t, g), gemm, base = sized(n, d, v)
        rows.append(gemm_row(base))
        variants = [(name, variant(name)) for name in backends]
        if "pallas" in backends:
            variants.insert(1, ("pallas+entropy", public("pallas", return_entropy=True)))
        rows += measure_variants(variants, base, h, w, t, g, gemm)
        del h, w
    return rows


def _sizes(args, default):
    return default if args.sizes == "all" else SIZES[args.sizes]


def _tables(args):
    """The mode the flags ask for, as (results name, rows thunk, columns), or None."""
    if args.timeline:
        tag = "_nocmdbuf" if "enable_command_buffer=" in os.environ.get("XLA_FLAGS", "") else ""
        return (
            "bench_timeline" + tag,
            device.timeline,
            [
                "N",
                "D",
                "V",
                "impl",
                "blocking_ms",
                "pipelined_ms",
                "reps",
                "trace_lead_ms",
                "trace_span_ms",
                "trace_busy_ms",
                "trace_tail_ms",
                "traced_calls",
                "xla_flags",
            ],
        )
    if args.device_times:
        return (
            "bench_device_times",
            lambda: device.device_table(_sizes(args, device.DEVICE_SIZES)),
            [
                "N",
                "D",
                "V",
                "layout",
                "impl",
                "device_ms",
                "x_gemm",
                "busy_ms",
                "blocking_ms",
                "pipelined_ms",
                "calls",
            ],
        )
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--sizes", default="all", choices=sorted(SIZES))
    parser.add_argument(
        "--backends",
        default="pallas,chunked,reference",
        help=f"backend names, or {', '.join(FAST_VARIANTS)} (the fast mode)",
    )
    parser.add_argument(
        "--profile-backward",
        metavar="LAYOUTS",
        help="per-kernel device time of one automatic fwd+bwd per layout "
        "(e.g. vd,dv), from a jax profiler trace",
    )
    parser.add_argument(
        "--profile-fused-loss",
        metavar="LAYOUTS",
        help="the same for linear_grpo_loss(memory='fast'), whose gradient is taken in the forward",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="fwd+bwd: synchronised wall clock against back-to-back calls and "
        "the device span of a profiler trace",
    )
    parser.add_argument(
        "--device-times",
        action="store_true",
        help="device time (profiler trace) of GEMM, forward and fwd+bwd, both "
        "layouts, at V = 32768, 131072, 151936",
    )
    args = parser.parse_args()
    if args.profile_backward:
        device.profile_backward(args.profile_backward.split(","))
    elif args.profile_fused_loss:
        device.profile_backward(args.profile_fused_loss.split(","), fused_loss=True)
    else:
        print(common.metadata(), flush=True)
        name, rows, columns = _tables(args) or (
            "bench_linear",
            lambda: table(SIZES[args.sizes], args.backends.split(",")),
            COLUMNS + ["error"],
        )
        print(common.write_results(name, rows(), columns))


if __name__ == "__main__":
    main()
