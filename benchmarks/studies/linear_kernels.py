"""The linear head's kernel-level studies, each answered once (docs/performance.md and
docs/design/linear_backward.md quote them): the SM90 forward and logit-gradient kernels alone
over all of V beside one GEMM (``--kernels``); SM clock, power and time per call of variants
run back to back at the power limit (``--clocks KIND``: ``bench_clocks_KIND``); the ffi
backward as one call at several chunk sizes against the same chunks as a loop of the grad
call and XLA's GEMMs (``--fused``); backward variants beside the automatic choice
(``--backward``); Pallas launch plans of the forward (``--sweep``); one call each of the
kernels for ncu (``--profile``, ``--ncu-summary`` to read its log). The kernel variants they
time are in ``benchmarks/studies/variants/``; the inputs, GEMMs and timing are
``benchmarks.linear_harness``'.

    python -m benchmarks.studies.linear_kernels --kernels     # SM90 kernels vs one GEMM
    python -m benchmarks.studies.linear_kernels --fused       # one-call ffi backward A/B
    python -m benchmarks.studies.linear_kernels --clocks ops  # SM clock, power, back to back
    python -m benchmarks.studies.linear_kernels --backward    # backward variants, auto
    python -m benchmarks.studies.linear_kernels --sweep       # pallas tile configs
    ncu --clock-control none -k regex:'stats|gemm|nvjet' --section SpeedOfLight \
        --section WarpStateStats python -m benchmarks.studies.linear_kernels --profile

Results (``--out``, ``--update-results``: benchmarks/README.md): ``bench_sm90_kernels``,
``bench_clocks_KIND``, ``bench_fused_backward``, ``bench_linear_backward``,
``bench_linear_sweep`` (``.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, output
from benchmarks.linear_harness import (
    ROUNDS,
    against_gemm,
    ffi_chunks,
    ffi_variant,
    gemm_call,
    gemm_row,
    inputs,
    make_config,
    measure_variants,
    op_fns,
    primitive,
    public,
    sized,
    timed,
)
from benchmarks.side_by_side.jax_worker import xla_materialised
from jaxrl_kernels.backends.pallas import linear as pallas_linear

SIZES = {
    "tiny": [(64, 96, 1000)],
    "sweep": [(4096, 2048, 131072)],
    "backward": [(4096, 2048, 131072), (8192, 4096, 131072)],
    "backward_base": [(4096, 2048, 131072)],
    "backward_large": [(8192, 4096, 131072)],
}
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


def sm90_kernel_variants(h, w, t, g, layout):
    """The SM90 kernels alone over all of V (C = V) as jitted calls with their arguments:
    "forward" (statistics + combine), "logit gradient" (with its float16 copy of W) and
    "logit gradient, no weight copy"."""
    from benchmarks.studies.variants import ffi_xla_gemms
    from jaxrl_kernels.backends.ffi import linear as ffi_linear
    from jaxrl_kernels.head import head_grad

    v = w.shape[0] if layout == "vd" else w.shape[1]
    valid = jnp.ones(t.shape, jnp.bool_)
    fwd = jax.jit(lambda h, w, t: ffi_linear._forward_call(h, w, None, t, valid, layout, 1.0))
    lse = fwd(h, w, t)[2]
    variants = {"forward": (fwd, (h, w, t))}
    for name, copy in (("logit gradient", True), ("logit gradient, no weight copy", False)):
        write = ffi_xla_gemms.write_grad(None, t, layout, weight_copy=copy)
        grad = jax.jit(
            lambda h, w, lse, g, write=write, copy=copy: write(
                head_grad.RowGrad.of(lse, g, None, None, 1.0), 0, v, h, w, 1.0
            )[: 1 + copy]
        )
        variants[name] = (grad, (h, w, lse, g))
    return variants


def kernel_table(
    sizes=((4096, 2048, 32768), (4096, 2048, 131072), (4096, 4096, 131072), (8192, 4096, 151936)),
):
    """The two SM90 kernels alone over all of V, each against one XLA GEMM of the same shape:
    the forward (statistics + combine) and the backward's logit-gradient kernel in one launch
    (C = V, with its float16 copy of W). After a second of GEMMs to bring the clocks up, the
    three are timed in turn, ROUNDS times, each round starting one further along (drift and
    order hit all alike); each row is the median of its rounds' medians."""
    rows = []
    for base, name, ms, gemm, _ in against_gemm(sizes, sm90_kernel_variants):
        rows.append(
            {
                **base,
                "kernel": name,
                "ms": ms,
                "x_gemm": ms / gemm,
                "gemm_ms": gemm,
                "rounds": ROUNDS,
            }
        )
        print(rows[-1], flush=True)
    return rows


SMI_FIELDS = (
    "clocks.sm",
    "power.draw",
    "power.limit",
    "temperature.gpu",
    "clocks_event_reasons.active",
)


def sampled_gpu_state(run, period_ms=50, skip=10):
    """``run()`` while nvidia-smi samples the SM clock, board power, power limit, temperature
    and clock-event reasons every ``period_ms``: (run's result, {field: median over the
    samples after the first ``skip``}, reasons as the most frequent bit mask)."""
    import collections
    import subprocess

    smi = subprocess.Popen(
        [
            "nvidia-smi",
            f"--query-gpu={','.join(SMI_FIELDS)}",
            "--format=csv,noheader,nounits",
            f"-lms={period_ms}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        result = run()
    finally:
        smi.terminate()
        text = smi.communicate()[0]
    samples = [[x.strip() for x in line.split(",")] for line in text.splitlines()]
    samples = [x for x in samples if len(x) == len(SMI_FIELDS)][skip:]
    state = (
        {f: float(np.median([float(x[i]) for x in samples])) for i, f in enumerate(SMI_FIELDS[:-1])}
        if samples
        else {}
    )
    state["reasons"] = (
        collections.Counter(x[-1] for x in samples).most_common(1)[0][0] if samples else None
    )
    state["samples"] = len(samples)
    return result, state


def steady_state(variants, *, seconds=3.0, sync_every=8, rounds=2):
    """Each variant ``{(impl, layout, V): (fn, args)}`` back to back for ``seconds`` (a
    synchronisation every ``sync_every`` calls, as a training loop runs) with the GPU's SM
    clock, power and clock-event reasons sampled meanwhile (``sampled_gpu_state``), each
    starting from an idle GPU, in ``rounds`` rotated rounds: one row per variant, its
    per-call time and sampled state the medians over its rounds, and the energy per call
    (power x time)."""
    got = {key: [] for key in variants}
    for fn, args in variants.values():
        common.warm_up(fn, *args, seconds=0.3)
    for key in common.in_rotation(variants, rounds):
        fn, args = variants[key]
        time.sleep(1.0)

        def loop(fn=fn, args=args):
            return common.time_calls(fn, *args, warmup=0, runs=1, calls=sync_every, seconds=seconds)

        timing, state = sampled_gpu_state(loop)
        got[key].append((timing.mean, timing.calls * len(timing.samples), state))
    rows = []
    for (impl, layout, vocab), runs in got.items():
        med = lambda f: float(np.median([r[2][f] for r in runs if r[2].get(f) is not None]))
        per_call = float(np.median([r[0] for r in runs]))
        rows.append(
            {
                "V": vocab,
                "layout": layout,
                "impl": impl,
                "per_call_ms": per_call,
                "calls": sum(r[1] for r in runs),
                "sm_clock_mhz": med("clocks.sm"),
                "power_w": med("power.draw"),
                "energy_j": per_call * med("power.draw") / 1e3,
                "power_limit_w": med("power.limit"),
                "temperature_c": med("temperature.gpu"),
                "clock_reasons": runs[-1][2].get("reasons"),
                "rounds": len(runs),
            }
        )
        print(rows[-1], flush=True)
    return rows


def clock_variants(kind, n=4096, d=2048, v=131072):
    """The variant sets of ``--clocks``: "ops" (one GEMM, our forward and forward+backward in
    both layouts, XLA's materialised forward+backward), "forward" (one GEMM and our forward
    at V = 32768, 131072, 151936), "kernels" (the SM90 kernels alone over all of V, beside
    one GEMM), "chunks" (forward+backward at several backward chunk sizes)."""
    variants = {}
    for vocab in (32768, 131072, 151936) if kind == "forward" else (v,):
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, vocab, layout)
            variants[("gemm", layout, vocab)] = (gemm_call(layout), (h, w))
            if kind in ("ops", "forward"):
                fwd, fwdbwd = op_fns(public(None, weight_layout=layout))
                variants[("forward", layout, vocab)] = (fwd, (h, w, t))
                if kind == "ops":
                    variants[("forward+backward", layout, vocab)] = (fwdbwd, (h, w, t, g))
            elif kind == "kernels":
                for name, call in sm90_kernel_variants(h, w, t, g, layout).items():
                    name = "forward kernels" if name == "forward" else name
                    variants[(name, layout, vocab)] = call
            elif kind == "chunks":
                for mib in (24, 32, 48, 64):
                    fwdbwd = op_fns(ffi_variant(layout, ffi_chunks(mib)))[1]
                    variants[(f"forward+backward, {mib} MiB chunks", layout, vocab)] = (
                        fwdbwd,
                        (h, w, t, g),
                    )
    if kind == "ops":
        h, w, t, g = inputs(n, d, v)
        variants[("xla materialised forward+backward", "vd", v)] = (
            op_fns(xla_materialised)[1],
            (h, w, t, g),
        )
    return variants


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
    from benchmarks.studies.variants import ffi_xla_gemms
    from jaxrl_kernels.backends import ffi

    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            (h, w, t, g), gemm, base = sized(n, d, v, layout)
            variants = [(f"auto, {layout}", public(None, weight_layout=layout))]
            if ffi.unavailable_reason() is None:
                for mib in (32, 128):
                    variants.append(
                        (
                            f"ffi fwd + ffi bwd {mib} MiB chunks, {layout}",
                            ffi_variant(layout, ffi_chunks(mib)),
                        )
                    )
                variants.append(
                    (
                        f"ffi fwd + ffi bwd as a loop of XLA GEMMs, {layout}",
                        ffi_variant(layout, ffi_xla_gemms.linear_backward),
                    )
                )
                variants.append(
                    (
                        f"ffi fwd + pallas (Triton) bwd, {layout}",
                        ffi_variant(layout, pallas_linear.linear_backward),
                    )
                )
            if layout == "vd":
                variants += [
                    (name, primitive(make_config(**kw))) for name, kw in BWD_VARIANTS.items()
                ]
            variants.append(
                (
                    f"reference (XLA materialised), {layout}",
                    public("reference", weight_layout=layout),
                )
            )
            rows += measure_variants(variants, base, h, w, t, g, gemm)
            del h, w
    return rows


def epilogue_rows(name, config, h, w, base, gemm):
    """The statistics kernel alone under ``config``, and the same kernel with its softmax cut
    to a running max (``variants/pallas_max_epilogue.py``): what the epilogue costs."""
    from benchmarks.studies.variants import pallas_max_epilogue

    rows = []
    for label, fn in (
        (" stats kernel alone", pallas_max_epilogue.stats_call),
        (" stats kernel alone, GEMM+max only", pallas_max_epilogue.max_call),
    ):
        call = jax.jit(functools.partial(fn, layout="vd", config=config))
        ms = timed(call, h, w)
        rows.append(
            {
                **base,
                "impl": name + label,
                "fwd_ms": ms,
                "fwd_x_gemm": ms / gemm,
                "fwd_temp_mib": common.temp_mib(call, h, w),
            }
        )
        print(rows[-1], flush=True)
    return rows


def sweep(sizes):
    rows = []
    for n, d, v in sizes:
        (h, w, t, g), gemm, base = sized(n, d, v)
        rows.append(gemm_row(base))
        for name, kw in FWD_VARIANTS.items():
            rows += measure_variants(
                [(name, primitive(make_config(**kw)))], base, h, w, t, g, gemm, want_bwd=False
            )
            if name in GEMM_ONLY:
                rows += epilogue_rows(name, make_config(**kw), h, w, base, gemm)
        rows += measure_variants(
            [(name, primitive(make_config(**kw))) for name, kw in BWD_VARIANTS.items()],
            base,
            h,
            w,
            t,
            g,
            gemm,
        )
        for layout in ("dv",):
            args, gemm_dv, _ = sized(n, d, v, layout)
            rows += measure_variants(
                [
                    (
                        f"default, weight_layout={layout}",
                        primitive(pallas_linear.DEFAULT_CONFIG, layout=layout),
                    )
                ],
                base,
                *args,
                gemm_dv,
            )
    return rows


def profile_targets():
    """One call each of the pallas forward, its statistics kernel with the epilogue cut to a
    running max, XLA's GEMM and the pallas forward+backward at N=4096, D=2048, V=131072 (for
    ``ncu -k regex:'stats|gemm|nvjet'``)."""
    from benchmarks.studies.variants import pallas_max_epilogue

    h, w, t, _ = inputs(4096, 2048, 131072)
    config = pallas_linear.DEFAULT_CONFIG
    jax.block_until_ready(jax.jit(primitive(config))(h, w, t))
    jax.block_until_ready(
        jax.jit(functools.partial(pallas_max_epilogue.max_call, layout="vd", config=config))(h, w)
    )
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
    from benchmarks.studies.variants import ffi_xla_gemms

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
        rows.append(
            {
                **base,
                "impl": name,
                "fwdbwd_ms": ms,
                "fwdbwd_x_gemm": ms / gemm,
                "fwdbwd_temp_mib": common.temp_mib(fn, *args),
                "gemm_ms": gemm,
                "rounds": ROUNDS,
            }
        )
        print(rows[-1], flush=True)
    return rows


def _sizes(args, default):
    return default if args.sizes == "default" else SIZES[args.sizes]


def _clock_rows(kind, n=4096, d=2048):
    return [{"N": n, "D": d, **row} for row in steady_state(clock_variants(kind, n, d))]


def _tables(args):
    """The mode the flags ask for, as (results name, rows thunk, columns)."""
    if args.fused:
        return (
            "bench_fused_backward",
            lambda: fused_table(_sizes(args, SIZES["backward"])),
            [
                "N",
                "D",
                "V",
                "layout",
                "impl",
                "fwdbwd_ms",
                "fwdbwd_x_gemm",
                "fwdbwd_temp_mib",
                "gemm_ms",
                "rounds",
            ],
        )
    if args.clocks:
        return (
            f"bench_clocks_{args.clocks}",
            lambda: _clock_rows(args.clocks),
            [
                "N",
                "D",
                "V",
                "layout",
                "impl",
                "per_call_ms",
                "energy_j",
                "sm_clock_mhz",
                "power_w",
                "power_limit_w",
                "temperature_c",
                "clock_reasons",
                "calls",
                "rounds",
            ],
        )
    if args.kernels:
        return (
            "bench_sm90_kernels",
            kernel_table,
            ["N", "D", "V", "layout", "kernel", "ms", "x_gemm", "gemm_ms", "rounds"],
        )
    if args.backward:
        return (
            "bench_linear_backward",
            lambda: backward_table(_sizes(args, SIZES["backward"])),
            COLUMNS + ["error"],
        )
    return ("bench_linear_sweep", lambda: sweep(_sizes(args, SIZES["sweep"])), COLUMNS + ["error"])


def ncu_summary(path):
    """Per-kernel-name totals of an ``ncu --csv --metrics gpu__time_duration.sum`` log."""
    import collections
    import csv

    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {
            "ns": 1e-6,
            "us": 1e-3,
            "usecond": 1e-3,
            "nsecond": 1e-6,
            "ms": 1.0,
            "msecond": 1.0,
        }.get(rec.get("Metric Unit", "ns"), 1e-6)
        name = rec["Kernel Name"][:60]
        totals[name][0] += 1
        totals[name][1] += float(rec["Metric Value"].replace(",", "")) * scale
    for name, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{ms:10.3f} ms {count:6d}x  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument(
        "--sizes",
        default="default",
        choices=["default", *sorted(SIZES)],
        help="the sizes of --fused, --backward, --sweep (default: the mode's)",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--kernels",
        action="store_true",
        help="the SM90 forward and logit-gradient kernels alone, beside one GEMM",
    )
    mode.add_argument(
        "--clocks",
        choices=("ops", "forward", "kernels", "chunks"),
        help="SM clock, power and time per call of variants run back to back (see clock_variants)",
    )
    mode.add_argument(
        "--fused",
        action="store_true",
        help="fwd+bwd: the one-call ffi backward at several chunk sizes against "
        "the loop of XLA GEMMs",
    )
    mode.add_argument(
        "--backward",
        action="store_true",
        help="backward variants and the automatic choice, both layouts",
    )
    mode.add_argument("--sweep", action="store_true", help="Pallas launch plans of the forward")
    mode.add_argument("--profile", action="store_true", help="one call of each, for ncu")
    mode.add_argument("--ncu-summary", metavar="LOG", help="summarize an ncu --csv duration log")
    args = parser.parse_args()
    if args.ncu_summary:
        ncu_summary(args.ncu_summary)
    elif args.profile:
        profile_targets()
    else:
        print(common.metadata(), flush=True)
        name, rows, columns = _tables(args)
        print(common.write_results(name, rows(), columns))


if __name__ == "__main__":
    main()
