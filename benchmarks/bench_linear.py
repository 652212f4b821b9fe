"""linear_logprobs: pallas vs chunked vs reference (materialised logits), beside one GEMM.

For each size (bf16, ``weight_layout="vd"``): the median time of the forward (logp only,
and pallas with entropy) and of forward + backward (gradient to hidden and weight of
Σ g·logp), XLA's temp buffer size of each compiled function, and the time of the single
[N, D] x [D, V] product (XLA, bf16 out) measured in the same process.

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
    PYTHONPATH=$PWD python3 -m benchmarks.bench_linear --gemm-schedules  # CUTLASS raster/swizzle

Results: ``bench_linear.{json,md}`` / ``bench_linear_sweep.{json,md}`` in out/bench (``--out``,
``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common, output
from benchmarks.side_by_side.jax_worker import xla_materialised
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


def inputs(n, d, v, layout="vd", seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d), np.float32), jnp.bfloat16)
    wshape = (v, d) if layout == "vd" else (d, v)
    w = jnp.asarray(rng.standard_normal(wshape, np.float32) * (2 / np.sqrt(d)), jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g = jnp.asarray(rng.standard_normal(n, np.float32))
    return h, w, t, g


def timed(fn, *args, budget_ms=2500.0):
    """Median ms with a run count that keeps slow variants inside the time budget."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = 1e3 * (time.perf_counter() - start)
    runs = int(max(5, min(25, budget_ms / max(first, 1e-3))))
    return common.median_ms(fn, *args, warmup=2, runs=runs)


def gemm_call(layout="vd"):
    """hidden [N, D] x weight -> [N, V] logits in bf16, jitted (XLA's GEMM)."""
    dims = (((1,), (1,)), ((), ())) if layout == "vd" else (((1,), (0,)), ((), ()))
    return jax.jit(lambda h, w: jax.lax.dot_general(h, w, dims))


def gemm_ms(h, w, layout="vd"):
    return timed(gemm_call(layout), h, w)


def op_fns(call):
    """(forward, forward+backward) jitted from ``call(h, w, t) -> logp``."""
    fwd = jax.jit(call)

    def loss(h, w, t, g):
        return jnp.sum(call(h, w, t) * g)

    fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return fwd, fwdbwd


def measure(call, h, w, t, g, gemm, want_bwd=True):
    fwd, fwdbwd = op_fns(call)
    row = {"fwd_ms": timed(fwd, h, w, t), "fwd_temp_mib": common.temp_mib(fwd, h, w, t)}
    row["fwd_x_gemm"] = row["fwd_ms"] / gemm
    if want_bwd:
        row["fwdbwd_ms"] = timed(fwdbwd, h, w, t, g)
        row["fwdbwd_temp_mib"] = common.temp_mib(fwdbwd, h, w, t, g)
        row["fwdbwd_x_gemm"] = row["fwdbwd_ms"] / gemm
    return row


def measure_variants(variants, base, h, w, t, g, gemm):
    """One row per (name, call): forward and forward+backward, or the error (the others go on)."""
    rows = []
    for name, call in variants:
        try:
            row = measure(call, h, w, t, g, gemm)
        except Exception as err:
            traceback.print_exc()
            row = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        rows.append({**base, "impl": name, **row})
        print(rows[-1], flush=True)
    return rows


def public(backend, **kw):
    def call(h, w, t):
        out = jk.linear_logprobs(h, w, t, backend=backend, **kw)
        return out[0] if isinstance(out, tuple) else out
    return call


def primitive(config, *, return_entropy=False, layout="vd"):
    def call(h, w, t):
        valid = jnp.ones(t.shape, jnp.bool_)
        return pallas_linear.linear_logprobs(h, w, None, t, valid, weight_layout=layout,
                                             temperature=1.0, return_entropy=return_entropy,
                                             config=config)[0]
    return call


def table(sizes, backends):
    rows = []
    for n, d, v in sizes:
        h, w, t, g = inputs(n, d, v)
        gemm = gemm_ms(h, w)
        base = {"N": n, "D": d, "V": v, "gemm_ms": gemm}
        rows.append({**base, "impl": "gemm (XLA, bf16 out)", "fwd_ms": gemm, "fwd_x_gemm": 1.0})
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
GEMM_ONLY = ("128x256x64 w8 s4 tps4",)  # also timed with the epilogue cut to a running max

BWD_VARIANTS = {
    "pallas fwd+bwd, f16 G (Triton recompute), 32 MiB": dict(),
}


def ffi_variant(layout, backward):
    """linear_logprobs with the ffi forward and the given backward part (logprob_core)."""
    from jaxrl_kernels import logprob_core
    from jaxrl_kernels.backends import ffi

    parts = logprob_core.Parts(ffi.linear_stats, backward)

    def call(h, w, t):
        valid = jnp.ones(t.shape, jnp.bool_)
        return logprob_core.linear_logprobs(parts, h, w, None, t, valid, weight_layout=layout,
                                            temperature=1.0, return_entropy=False)[0]
    return call


def backward_table(sizes):
    """The automatic choice, the ffi backward at two more chunk sizes and as a loop of XLA
    GEMMs, the ffi forward with the Triton-recompute backward, pallas variants and XLA's
    materialised path, both weight layouts, per size."""
    import functools
    from jaxrl_kernels.backends import ffi

    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            gemm = gemm_ms(h, w, layout)
            base = {"N": n, "D": d, "V": v, "gemm_ms": gemm}
            variants = [(f"auto, {layout}", public(None, weight_layout=layout))]
            if ffi.unavailable_reason() is None:
                for mib in (32, 128):
                    variants.append((f"ffi fwd + ffi bwd {mib} MiB chunks, {layout}", ffi_variant(
                        layout, functools.partial(ffi.linear_backward, chunk_bytes=mib * 2**20))))
                variants.append((f"ffi fwd + ffi bwd as a loop of XLA GEMMs, {layout}",
                                 ffi_variant(layout, functools.partial(ffi.linear_backward,
                                                                       gemms="xla"))))
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


def make_config(base=pallas_linear.DEFAULT_CONFIG, **kw):
    for key in ("forward", "grad"):
        if key in kw:
            kw[key] = pallas_linear.TileConfig(*kw[key])
    return dataclasses.replace(base, **kw)


def sweep(sizes):
    rows = []
    for n, d, v in sizes:
        h, w, t, g = inputs(n, d, v)
        gemm = gemm_ms(h, w)
        base = {"N": n, "D": d, "V": v, "gemm_ms": gemm}
        rows.append({**base, "impl": "gemm (XLA, bf16 out)", "fwd_ms": gemm, "fwd_x_gemm": 1.0})
        for name, kw in FWD_VARIANTS.items():
            for epilogue in ("softmax", "max") if name in GEMM_ONLY else ("softmax",):
                cfg = make_config(**kw, epilogue=epilogue)
                label = name + ("" if epilogue == "softmax" else " GEMM+max only")
                try:
                    row = measure(primitive(cfg), h, w, t, g, gemm, want_bwd=False)
                except Exception as err:
                    row = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                rows.append({**base, "impl": label, **row})
                print(rows[-1], flush=True)
        for name, kw in BWD_VARIANTS.items():
            try:
                row = measure(primitive(make_config(**kw)), h, w, t, g, gemm)
            except Exception as err:
                row = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            rows.append({**base, "impl": name, **row})
            print(rows[-1], flush=True)
        for layout in ("dv",):
            hd, wd, td, gd = inputs(n, d, v, layout)
            row = measure(primitive(pallas_linear.DEFAULT_CONFIG, layout=layout), hd, wd, td, gd,
                          gemm_ms(hd, wd, layout))
            rows.append({**base, "impl": f"default, weight_layout={layout}", **row})
            print(rows[-1], flush=True)
    return rows


def profile_targets():
    """One call each of the pallas forward, its GEMM+max-only variant and XLA's GEMM at
    N=4096, D=2048, V=131072 (for ``ncu -k regex:'stats|gemm|nvjet'``)."""
    h, w, t, _ = inputs(4096, 2048, 131072)
    for cfg in (pallas_linear.DEFAULT_CONFIG,
                dataclasses.replace(pallas_linear.DEFAULT_CONFIG, epilogue="max")):
        jax.block_until_ready(jax.jit(primitive(cfg))(h, w, t))
    dims = (((1,), (1,)), ((), ()))
    jax.block_until_ready(jax.jit(lambda h, w: jax.lax.dot_general(h, w, dims))(h, w))
    g = jnp.ones(t.shape, jnp.float32)
    _, fwdbwd = op_fns(primitive(pallas_linear.DEFAULT_CONFIG))
    jax.block_until_ready(fwdbwd(h, w, t, g))


def in_rotation(keys, rounds):
    """``keys`` in turn, ``rounds`` times, each round starting one further along (so that
    drift and order hit all alike)."""
    keys = list(keys)
    for r in range(rounds):
        yield from keys[r % len(keys):] + keys[:r % len(keys)]


def timeline(layouts=("vd", "dv"), n=4096, d=2048, v=131072, calls=6, reps=8):
    """Where the wall clock of one forward+backward goes, against its device time: for the
    automatic path per layout, XLA's materialised path and one GEMM, the median of
    synchronised calls (host clock around ``block_until_ready``), ``pipelined_ms``, and from
    a profiler trace of ``calls`` synchronised calls (``call_spans``; the first one, which
    pays for starting the trace, left out) the lead, span, busy time and tail."""
    rows = []
    variants = {}
    for layout in layouts:
        h, w, t, g = inputs(n, d, v, layout)
        variants[f"jaxrl_kernels {layout}"] = (op_fns(public(None, weight_layout=layout))[1],
                                               (h, w, t, g))
    h, w, t, g = inputs(n, d, v)
    variants["xla materialised vd"] = (op_fns(xla_materialised)[1], (h, w, t, g))
    variants["gemm vd"] = (gemm_call("vd"), (h, w))
    for name, (fn, args) in variants.items():
        common.warm_up(fn, *args)
        blocking = common.median_ms(fn, *args, warmup=2, runs=15)
        piped = common.pipelined_ms(fn, args, reps)
        spans, kernels, host = common.call_spans(fn, args, calls)
        med = [float(np.median(col)) for col in list(zip(*(spans[1:] or spans)))[:4]] or [None] * 4
        row = {"N": n, "D": d, "V": v, "impl": name, "blocking_ms": blocking,
               "pipelined_ms": piped, "reps": reps, "trace_lead_ms": med[0],
               "trace_span_ms": med[1], "trace_busy_ms": med[2], "trace_tail_ms": med[3],
               "traced_calls": len(spans), "xla_flags": os.environ.get("XLA_FLAGS", "")}
        rows.append(row)
        print(row, flush=True)
        marks = [e for e in host if re.fullmatch(r"call\d+", e["name"])]
        if marks:  # what the host did before the last traced call's first kernel
            m = marks[-1]
            mine = [k for k in kernels if m["ts"] <= k["ts"] < m["ts"] + m["dur"]]
            first = mine[0]["ts"] if mine else m["ts"] + m["dur"]
            print(f"  last traced call: first kernel at +{(first - m['ts']) / 1e3:.3f} ms "
                  f"({mine[0]['name'][:50] if mine else '-'}); host events before it:")
            before = [e for e in host if m["ts"] <= e["ts"] < first and e is not m and
                      e["dur"] >= 10.0][:30]
            for e in before:
                print(f"    +{(e['ts'] - m['ts']) / 1e3:7.3f} ms {e['dur'] / 1e3:7.3f} ms "
                      f"{e['name'][:70]}")
            gaps = sorted(((b["ts"] - (a["ts"] + a["dur"])) / 1e3, a["name"][:40], b["name"][:40])
                          for a, b in zip(mine, mine[1:]))[-5:]
            for gap, a, b in reversed(gaps):
                print(f"    gap {gap:.3f} ms between {a} and {b}")
    return rows


DEVICE_SIZES = [(4096, 2048, 32768), (4096, 2048, 131072), (4096, 2048, 151936)]


def device_table(sizes=DEVICE_SIZES, rounds=3, calls=8):
    """Device time (profiler trace, ``call_spans``) of one GEMM, the automatic forward and the
    automatic forward+backward, both weight layouts, and XLA's materialised forward+backward
    ("vd"): per variant the median over ``rounds`` rotated rounds of ``calls`` synchronised
    calls each (the first call of each trace left out) of the span from the first kernel's
    start to the last one's end; beside it the synchronised wall clock and the back-to-back
    per-call time (``pipelined_ms``). Ratios are to the GEMM of the same layout."""
    rows = []
    for n, d, v in sizes:
        variants = {}
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            fwd, fwdbwd = op_fns(public(None, weight_layout=layout))
            variants[("gemm", layout)] = (gemm_call(layout), (h, w))
            variants[("forward", layout)] = (fwd, (h, w, t))
            variants[("forward+backward", layout)] = (fwdbwd, (h, w, t, g))
        h, w, t, g = inputs(n, d, v)
        variants[("xla materialised forward+backward", "vd")] = (op_fns(xla_materialised)[1],
                                                                 (h, w, t, g))
        for fn, args in variants.values():
            common.warm_up(fn, *args, seconds=0.5)
        spans = {key: [] for key in variants}
        for key in in_rotation(variants, rounds):
            fn, args = variants[key]
            spans[key] += common.call_spans(fn, args, calls + 1)[0][1:]
        for (impl, layout), (fn, args) in variants.items():
            span = float(np.median([s[1] for s in spans[(impl, layout)]]))
            gemm = float(np.median([s[1] for s in spans[("gemm", layout)]]))
            rows.append({"N": n, "D": d, "V": v, "layout": layout, "impl": impl,
                         "device_ms": span, "x_gemm": span / gemm,
                         "busy_ms": float(np.median([s[2] for s in spans[(impl, layout)]])),
                         "blocking_ms": common.median_ms(fn, *args, warmup=1, runs=10),
                         "pipelined_ms": common.pipelined_ms(fn, args, reps=6, trials=5),
                         "calls": len(spans[(impl, layout)])})
            print(rows[-1], flush=True)
        del variants
    return rows


GEMM_SCHEDULES = ("", "h1", "m1", "n1", "m2", "n2", "m4", "n4", "m8", "n8")


def gemm_schedules_table(sizes, rounds=6, calls=3):
    """The backward's CUTLASS GEMMs under each tile-scheduler raster order and swizzle
    (JAXRL_SM90_GEMM_SCHEDULE, read by the custom call at run time, so one compiled
    forward+backward serves all): per layout and schedule the median device span of the
    automatic forward+backward and the per-call device time of its CUTLASS GEMM kernels,
    over ``rounds`` rotated rounds of ``calls`` traced calls."""
    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            fwdbwd = op_fns(public(None, weight_layout=layout))[1]
            common.warm_up(fwdbwd, h, w, t, g)
            got = {sch: [] for sch in GEMM_SCHEDULES}
            for sch in in_rotation(GEMM_SCHEDULES, rounds):
                os.environ["JAXRL_SM90_GEMM_SCHEDULE"] = sch
                got[sch] += common.call_spans(fwdbwd, (h, w, t, g), calls + 1,
                                              match="GemmUniversal")[0][1:]
            os.environ.pop("JAXRL_SM90_GEMM_SCHEDULE", None)
            for sch, spans in got.items():
                rows.append({"N": n, "D": d, "V": v, "layout": layout,
                             "schedule": sch or "default (heuristic, 1)",
                             "fwdbwd_device_ms": float(np.median([x[1] for x in spans])),
                             "gemms_ms": float(np.median([x[4] for x in spans])),
                             "calls": len(spans)})
                print(rows[-1], flush=True)
            del h, w
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
    for key in in_rotation(variants, rounds):
        fn, args = variants[key]
        time.sleep(1.0)

        def loop(fn=fn, args=args):
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                out = fn(*args)
                calls += 1
                if calls % sync_every == 0:
                    jax.block_until_ready(out)
            jax.block_until_ready(out)
            return calls, time.perf_counter() - start

        (calls, elapsed), state = sampled_gpu_state(loop)
        got[key].append((1e3 * elapsed / calls, calls, state))
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
    import functools
    from jaxrl_kernels.backends import ffi

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
                    fwdbwd = op_fns(ffi_variant(layout, functools.partial(
                        ffi.linear_backward, chunk_bytes=mib * 2**20)))[1]
                    variants[(f"forward+backward, {mib} MiB chunks", layout, vocab)] = (
                        fwdbwd, (h, w, t, g))
    if kind == "ops":
        h, w, t, g = inputs(n, d, v)
        variants[("xla materialised forward+backward", "vd", v)] = (
            op_fns(xla_materialised)[1], (h, w, t, g))
    return variants


def profile_backward(layouts, n=4096, d=2048, v=131072):
    """Per-kernel device time of one automatic forward+backward per layout, from a jax profiler
    trace (CUPTI), plus the compiled HLO (which kernels XLA fused). Written to the results directory (common.results_dir)."""
    import collections

    out = common.results_dir()
    for layout in layouts:
        h, w, t, g = inputs(n, d, v, layout)
        _, fwdbwd = op_fns(public(None, weight_layout=layout))
        (out / f"profile_{layout}.hlo.txt").write_text(
            fwdbwd.lower(h, w, t, g).compile().as_text())
        jax.block_until_ready(fwdbwd(h, w, t, g))
        kernels, host, meta = common.traced(fwdbwd, (h, w, t, g))
        totals = collections.defaultdict(lambda: [0, 0.0])
        span = [float("inf"), 0.0]
        after_grad = 0  # the backward's CUTLASS GEMMs: d_hidden, then d_weight, after each grad kernel
        for e in kernels:
            name = e["name"][:70]
            if "grad_kernel" in name:
                after_grad = 0
            elif "GemmUniversal" in name:
                name = ("d_hidden" if after_grad == 0 else "d_weight") + " GEMM (CUTLASS)"
                after_grad += 1
            totals[name][0] += 1
            totals[name][1] += e["dur"] / 1e3
            span = [min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])]
        lines = [f"{layout}: N={n} D={d} V={v}, device events {sum(c for c, _ in totals.values())}, "
                 f"busy {sum(ms for _, ms in totals.values()):.3f} ms of a "
                 f"{(span[1] - span[0]) / 1e3:.3f} ms span"]
        for name, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"{ms:9.3f} ms {count:5d}x  {name}")
        wall = common.median_ms(fwdbwd, h, w, t, g, warmup=2, runs=10)
        lines.append(f"wall clock of one call (median of 10): {wall:.3f} ms; host threads' "
                     "longest events in the traced call:")
        names = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
                 for e in meta if e.get("name") == "thread_name"}
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for e in host:
            key = f"{names.get((e.get('pid'), e.get('tid')), '?')[:24]}: {e['name'][:60]}"
            by_name[key][0] += 1
            by_name[key][1] += e["dur"] / 1e3
        for name, (count, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]:
            lines.append(f"{ms:9.3f} ms {count:5d}x  {name}")
        text = "\n".join(lines)
        (out / f"profile_{layout}.txt").write_text(text + "\n")
        print(text, flush=True)


ROUNDS = 4


def rotated(variants, rounds=ROUNDS):
    """{name: (fn, args)} timed ``in_rotation``: {name: median of its rounds' medians}."""
    times = {name: [] for name in variants}
    for name in in_rotation(variants, rounds):
        fn, args = variants[name]
        times[name].append(timed(fn, *args))
    return {name: float(np.median(ts)) for name, ts in times.items()}


FUSED_CHUNKS_MIB = (32, 64, 128)


def fused_table(sizes):
    """Forward+backward with the ffi backward as one custom call (CUTLASS GEMMs) at several
    chunk sizes, against the same chunks as a loop of the grad call and XLA's GEMMs, both
    layouts, timed in rotated rounds after a second of GEMMs; each row with XLA's temp size."""
    import functools
    from jaxrl_kernels.backends import ffi

    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            gemm_fn = gemm_call(layout)
            common.warm_up(gemm_fn, h, w)
            variants = {"gemm": (gemm_fn, (h, w))}
            for mib in FUSED_CHUNKS_MIB:
                fwdbwd = op_fns(ffi_variant(layout, functools.partial(
                    ffi.linear_backward, chunk_bytes=mib * 2**20)))[1]
                variants[f"one call, CUTLASS GEMMs, {mib} MiB chunks"] = (fwdbwd, (h, w, t, g))
            fwdbwd = op_fns(ffi_variant(layout, functools.partial(ffi.linear_backward,
                                                                  gemms="xla")))[1]
            variants["grad call in a loop of XLA GEMMs, 64 MiB chunks"] = (fwdbwd, (h, w, t, g))
            times = rotated(variants)
            for name in list(variants)[1:]:
                fn, args = variants[name]
                rows.append({"N": n, "D": d, "V": v, "layout": layout, "impl": name,
                             "fwdbwd_ms": times[name], "fwdbwd_x_gemm": times[name] / times["gemm"],
                             "fwdbwd_temp_mib": common.temp_mib(fn, *args),
                             "gemm_ms": times["gemm"], "rounds": ROUNDS})
                print(rows[-1], flush=True)
            del h, w
    return rows


def sm90_kernel_variants(h, w, t, g, layout):
    """The SM90 kernels alone over all of V (C = V) as jitted calls with their arguments:
    "forward" (statistics + combine), "logit gradient" (with its float16 copy of W) and
    "logit gradient, no weight copy"."""
    from jaxrl_kernels.backends import ffi, head_grad

    v = w.shape[0] if layout == "vd" else w.shape[1]
    valid = jnp.ones(t.shape, jnp.bool_)
    fwd = jax.jit(lambda h, w, t: ffi._forward_call(h, w, None, t, valid, layout, 1.0))
    lse = fwd(h, w, t)[2]
    variants = {"forward": (fwd, (h, w, t))}
    for name, copy in (("logit gradient", True), ("logit gradient, no weight copy", False)):
        write = ffi._write_grad(None, t, layout, weight_copy=copy)
        grad = jax.jit(lambda h, w, lse, g, write=write, copy=copy: write(
            head_grad.RowGrad.of(lse, g, None, None, 1.0), 0, v, h, w, 1.0)[:1 + copy])
        variants[name] = (grad, (h, w, lse, g))
    return variants


def kernel_table(sizes=((4096, 2048, 32768), (4096, 2048, 131072), (4096, 4096, 131072),
                        (8192, 4096, 151936))):
    """The two SM90 kernels alone over all of V, each against one XLA GEMM of the same shape:
    the forward (statistics + combine) and the backward's logit-gradient kernel in one launch
    (C = V, with its float16 copy of W). After a second of GEMMs to bring the clocks up, the three are timed in turn,
    ROUNDS times, each round starting one further along (drift and order hit all alike); each
    row is the median of its rounds' medians."""
    rows = []
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            gemm_fn = gemm_call(layout)
            common.warm_up(gemm_fn, h, w)
            variants = {"gemm": (gemm_fn, (h, w)), **sm90_kernel_variants(h, w, t, g, layout)}
            times = rotated(variants)
            gemm = times["gemm"]
            for name in list(variants)[1:]:
                ms = times[name]
                rows.append({"N": n, "D": d, "V": v, "layout": layout, "kernel": name, "ms": ms,
                             "x_gemm": ms / gemm, "gemm_ms": gemm, "rounds": ROUNDS})
                print(rows[-1], flush=True)
            del h, w
    return rows


def ncu_summary(path):
    """Per-kernel-name totals of an ``ncu --csv --metrics gpu__time_duration.sum`` log."""
    import csv
    import collections
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "ms": 1.0,
                 "msecond": 1.0}.get(rec.get("Metric Unit", "ns"), 1e-6)
        name = rec["Kernel Name"][:60]
        totals[name][0] += 1
        totals[name][1] += float(rec["Metric Value"].replace(",", "")) * scale
    for name, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{ms:10.3f} ms {count:6d}x  {name}")


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
    parser.add_argument("--fused", action="store_true",
                        help="fwd+bwd: the one-call ffi backward at several chunk sizes against "
                             "the loop of XLA GEMMs")
    parser.add_argument("--kernels", action="store_true",
                        help="the SM90 forward and logit-gradient kernels alone, beside one GEMM")
    parser.add_argument("--timeline", action="store_true",
                        help="fwd+bwd: synchronised wall clock against back-to-back calls and "
                             "the device span of a profiler trace")
    parser.add_argument("--gemm-schedules", action="store_true",
                        help="the backward's CUTLASS GEMMs under each raster order / swizzle")
    parser.add_argument("--clocks", choices=("ops", "forward", "kernels", "chunks"),
                        help="SM clock, power and time per call of variants run back to back "
                             "(see clock_variants)")
    parser.add_argument("--device-times", action="store_true",
                        help="device time (profiler trace) of GEMM, forward and fwd+bwd, both "
                             "layouts, at V = 32768, 131072, 151936")
    parser.add_argument("--ncu-summary", help="summarize an ncu --csv duration log")
    args = parser.parse_args()
    if args.ncu_summary:
        ncu_summary(args.ncu_summary)
        return
    if args.fused:
        sizes = SIZES["backward"] if args.sizes == "all" else SIZES[args.sizes]
        print(common.metadata(), flush=True)
        print(common.write_results("bench_fused_backward", fused_table(sizes),
                                   ["N", "D", "V", "layout", "impl", "fwdbwd_ms", "fwdbwd_x_gemm",
                                    "fwdbwd_temp_mib", "gemm_ms", "rounds"]))
        return
    if args.timeline:
        print(common.metadata(), flush=True)
        tag = "_nocmdbuf" if "enable_command_buffer=" in os.environ.get("XLA_FLAGS", "") else ""
        print(common.write_results("bench_timeline" + tag, timeline(),
                                   ["N", "D", "V", "impl", "blocking_ms", "pipelined_ms", "reps",
                                    "trace_lead_ms", "trace_span_ms", "trace_busy_ms",
                                    "trace_tail_ms", "traced_calls", "xla_flags"]))
        return
    if args.gemm_schedules:
        print(common.metadata(), flush=True)
        sizes = SIZES["backward"] if args.sizes == "all" else SIZES[args.sizes]
        print(common.write_results("bench_gemm_schedules", gemm_schedules_table(sizes),
                                   ["N", "D", "V", "layout", "schedule", "fwdbwd_device_ms",
                                    "gemms_ms", "calls"]))
        return
    if args.clocks:
        print(common.metadata(), flush=True)
        n, d = 4096, 2048
        rows = [{"N": n, "D": d, **row}
                for row in steady_state(clock_variants(args.clocks, n, d))]
        print(common.write_results(f"bench_clocks_{args.clocks}", rows,
                                   ["N", "D", "V", "layout", "impl", "per_call_ms", "energy_j",
                                    "sm_clock_mhz", "power_w", "power_limit_w",
                                    "temperature_c", "clock_reasons", "calls", "rounds"]))
        return
    if args.device_times:
        print(common.metadata(), flush=True)
        sizes = DEVICE_SIZES if args.sizes == "all" else SIZES[args.sizes]
        print(common.write_results("bench_device_times", device_table(sizes),
                                   ["N", "D", "V", "layout", "impl", "device_ms", "x_gemm",
                                    "busy_ms", "blocking_ms", "pipelined_ms", "calls"]))
        return
    if args.profile:
        profile_targets()
        return
    if args.kernels:
        print(common.metadata(), flush=True)
        rows = kernel_table()
        print(common.write_results("bench_sm90_kernels", rows, ["N", "D", "V", "layout", "kernel",
                                                                "ms", "x_gemm", "gemm_ms",
                                                                "rounds"]))
        return
    if args.profile_backward:
        profile_backward(args.profile_backward.split(","))
        return
    print(common.metadata(), flush=True)
    if args.backward:
        sizes = SIZES["backward"] if args.sizes == "all" else SIZES[args.sizes]
        rows = backward_table(sizes)
        print(common.write_results("bench_linear_backward", rows, COLUMNS + ["error"]))
    elif args.sweep:
        sizes = SIZES["sweep"] if args.sizes == "all" else SIZES[args.sizes]
        rows = sweep(sizes)
        print(common.write_results("bench_linear_sweep", rows, COLUMNS + ["error"]))
    else:
        rows = table(SIZES[args.sizes], args.backends.split(","))
        print(common.write_results("bench_linear", rows, COLUMNS + ["error"]))


if __name__ == "__main__":
    main()
