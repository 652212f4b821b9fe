"""The SM90 kernels alone and the device under sustained load: the forward and the
logit-gradient kernel over all of V beside one GEMM (``--kernels``), and SM clock, power and
time per call of variants run back to back (``--clocks``). Run through
``python -m benchmarks.bench_linear``."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.linear_harness import (ROUNDS, against_gemm, ffi_chunks, ffi_variant,
                                       gemm_call, inputs, op_fns, public)
from benchmarks.side_by_side.jax_worker import xla_materialised


def sm90_kernel_variants(h, w, t, g, layout):
    """The SM90 kernels alone over all of V (C = V) as jitted calls with their arguments:
    "forward" (statistics + combine), "logit gradient" (with its float16 copy of W) and
    "logit gradient, no weight copy"."""
    from benchmarks.variants import ffi_xla_gemms
    from jaxrl_kernels.head import head_grad
    from jaxrl_kernels.backends.ffi import linear as ffi_linear

    v = w.shape[0] if layout == "vd" else w.shape[1]
    valid = jnp.ones(t.shape, jnp.bool_)
    fwd = jax.jit(lambda h, w, t: ffi_linear._forward_call(h, w, None, t, valid, layout, 1.0))
    lse = fwd(h, w, t)[2]
    variants = {"forward": (fwd, (h, w, t))}
    for name, copy in (("logit gradient", True), ("logit gradient, no weight copy", False)):
        write = ffi_xla_gemms.write_grad(None, t, layout, weight_copy=copy)
        grad = jax.jit(lambda h, w, lse, g, write=write, copy=copy: write(
            head_grad.RowGrad.of(lse, g, None, None, 1.0), 0, v, h, w, 1.0)[:1 + copy])
        variants[name] = (grad, (h, w, lse, g))
    return variants


def kernel_table(sizes=((4096, 2048, 32768), (4096, 2048, 131072), (4096, 4096, 131072),
                        (8192, 4096, 151936))):
    """The two SM90 kernels alone over all of V, each against one XLA GEMM of the same shape:
    the forward (statistics + combine) and the backward's logit-gradient kernel in one launch
    (C = V, with its float16 copy of W). After a second of GEMMs to bring the clocks up, the
    three are timed in turn, ROUNDS times, each round starting one further along (drift and
    order hit all alike); each row is the median of its rounds' medians."""
    rows = []
    for base, name, ms, gemm, _ in against_gemm(sizes, sm90_kernel_variants):
        rows.append({**base, "kernel": name, "ms": ms, "x_gemm": ms / gemm, "gemm_ms": gemm,
                     "rounds": ROUNDS})
        print(rows[-1], flush=True)
    return rows


SMI_FIELDS = ("clocks.sm", "power.draw", "power.limit", "temperature.gpu",
              "clocks_event_reasons.active")


def sampled_gpu_state(run, period_ms=50, skip=10):
    """``run()`` while nvidia-smi samples the SM clock, board power, power limit, temperature
    and clock-event reasons every ``period_ms``: (run's result, {field: median over the
    samples after the first ``skip``}, reasons as the most frequent bit mask)."""
    import collections
    import subprocess

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                            "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                           stdout=subprocess.PIPE, text=True)
    try:
        result = run()
    finally:
        smi.terminate()
        text = smi.communicate()[0]
    samples = [[x.strip() for x in line.split(",")] for line in text.splitlines()]
    samples = [x for x in samples if len(x) == len(SMI_FIELDS)][skip:]
    state = {f: float(np.median([float(x[i]) for x in samples])) for i, f in
             enumerate(SMI_FIELDS[:-1])} if samples else {}
    state["reasons"] = collections.Counter(x[-1] for x in samples).most_common(1)[0][0] \
        if samples else None
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
            return common.time_calls(fn, *args, warmup=0, runs=1, calls=sync_every,
                                     seconds=seconds)

        timing, state = sampled_gpu_state(loop)
        got[key].append((timing.mean, timing.calls * len(timing.samples), state))
    rows = []
    for (impl, layout, vocab), runs in got.items():
        med = lambda f: float(np.median([r[2][f] for r in runs if r[2].get(f) is not None]))
        per_call = float(np.median([r[0] for r in runs]))
        rows.append({"V": vocab, "layout": layout, "impl": impl, "per_call_ms": per_call,
                     "calls": sum(r[1] for r in runs), "sm_clock_mhz": med("clocks.sm"),
                     "power_w": med("power.draw"), "energy_j": per_call * med("power.draw") / 1e3,
                     "power_limit_w": med("power.limit"), "temperature_c": med("temperature.gpu"),
                     "clock_reasons": runs[-1][2].get("reasons"), "rounds": len(runs)})
        print(rows[-1], flush=True)
    return rows


def clock_variants(kind, n=4096, d=2048, v=131072):
    """The variant sets of ``--clocks``: "ops" (one GEMM, our forward and forward+backward in
    both layouts, XLA's materialised forward+backward), "forward" (one GEMM and our forward
    at V = 32768, 131072, 151936), "kernels" (the SM90 kernels alone over all of V, beside
    one GEMM), "chunks" (forward+backward at several backward chunk sizes)."""
    variants = {}
    for vocab in ((32768, 131072, 151936) if kind == "forward" else (v,)):
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
                        fwdbwd, (h, w, t, g))
    if kind == "ops":
        h, w, t, g = inputs(n, d, v)
        variants[("xla materialised forward+backward", "vd", v)] = (
            op_fns(xla_materialised)[1], (h, w, t, g))
    return variants
