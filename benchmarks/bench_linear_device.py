"""Where the linear head's time goes on the device: the wall clock against device time
(``--timeline``), device time of GEMM / forward / forward+backward (``--device-times``) and
the per-kernel device time of one forward+backward (``--profile-backward``). Run through
``python -m benchmarks.bench_linear``."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common
from benchmarks.linear_harness import gemm_call, inputs, op_fns, public
from benchmarks.side_by_side.jax_worker import xla_materialised


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
        variants[f"jaxrl_kernels {layout}"] = (
            op_fns(public(None, weight_layout=layout))[1],
            (h, w, t, g),
        )
    h, w, t, g = inputs(n, d, v)
    variants["xla materialised vd"] = (op_fns(xla_materialised)[1], (h, w, t, g))
    variants["gemm vd"] = (gemm_call("vd"), (h, w))
    for name, (fn, args) in variants.items():
        common.warm_up(fn, *args)
        blocking = common.median_ms(fn, *args, warmup=2, runs=15)
        piped = common.pipelined_ms(fn, args, reps)
        spans, kernels, host = common.call_spans(fn, args, calls)
        med = [float(np.median(col)) for col in list(zip(*(spans[1:] or spans)))[:4]] or [None] * 4
        row = {
            "N": n,
            "D": d,
            "V": v,
            "impl": name,
            "blocking_ms": blocking,
            "pipelined_ms": piped,
            "reps": reps,
            "trace_lead_ms": med[0],
            "trace_span_ms": med[1],
            "trace_busy_ms": med[2],
            "trace_tail_ms": med[3],
            "traced_calls": len(spans),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
        rows.append(row)
        print(row, flush=True)
        marks = [e for e in host if re.fullmatch(r"call\d+", e["name"])]
        if marks:  # what the host did before the last traced call's first kernel
            m = marks[-1]
            mine = [k for k in kernels if m["ts"] <= k["ts"] < m["ts"] + m["dur"]]
            first = mine[0]["ts"] if mine else m["ts"] + m["dur"]
            print(
                f"  last traced call: first kernel at +{(first - m['ts']) / 1e3:.3f} ms "
                f"({mine[0]['name'][:50] if mine else '-'}); host events before it:"
            )
            before = [
                e for e in host if m["ts"] <= e["ts"] < first and e is not m and e["dur"] >= 10.0
            ][:30]
            for e in before:
                print(
                    f"    +{(e['ts'] - m['ts']) / 1e3:7.3f} ms {e['dur'] / 1e3:7.3f} ms "
                    f"{e['name'][:70]}"
                )
            gaps = sorted(
                ((b["ts"] - (a["ts"] + a["dur"])) / 1e3, a["name"][:40], b["name"][:40])
                for a, b in zip(mine, mine[1:])
            )[-5:]
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
        variants[("xla materialised forward+backward", "vd")] = (
            op_fns(xla_materialised)[1],
            (h, w, t, g),
        )
        for fn, args in variants.values():
            common.warm_up(fn, *args, seconds=0.5)
        spans = {key: [] for key in variants}
        for key in common.in_rotation(variants, rounds):
            fn, args = variants[key]
            spans[key] += common.call_spans(fn, args, calls + 1)[0][1:]
        for (impl, layout), (fn, args) in variants.items():
            span = float(np.median([s[1] for s in spans[(impl, layout)]]))
            gemm = float(np.median([s[1] for s in spans[("gemm", layout)]]))
            rows.append(
                {
                    "N": n,
                    "D": d,
                    "V": v,
                    "layout": layout,
                    "impl": impl,
                    "device_ms": span,
                    "x_gemm": span / gemm,
                    "busy_ms": float(np.median([s[2] for s in spans[(impl, layout)]])),
                    "blocking_ms": common.median_ms(fn, *args, warmup=1, runs=10),
                    "pipelined_ms": common.pipelined_ms(fn, args, reps=6, trials=5),
                    "calls": len(spans[(impl, layout)]),
                }
            )
            print(rows[-1], flush=True)
        del variants
    return rows


def fused_grpo_fwdbwd(layout):
    """``value_and_grad`` of ``linear_grpo_loss(..., memory="fast")`` on B = N one-token
    sequences with advantages g (its gradient taken in the forward), as ``f(h, w, t, g)``."""

    def loss(h, w, t, g):
        old = jax.lax.stop_gradient(jk.linear_logprobs(h, w, t, weight_layout=layout))
        return jk.linear_grpo_loss(
            h[:, None],
            w,
            t[:, None],
            old[:, None],
            jnp.zeros_like(g),
            jnp.ones((h.shape[0], 1)),
            advantages=g,
            weight_layout=layout,
            memory="fast",
        )[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def profile_backward(layouts, n=4096, d=2048, v=131072, fused_loss=False):
    """Per-kernel device time of one automatic forward+backward per layout, from a jax profiler
    trace (CUPTI), plus the compiled HLO (which kernels XLA fused). Written under results/.
    ``fused_loss``: ``linear_grpo_loss(memory="fast")`` instead (``profile_fused_{layout}``;
    its trace includes the lean forward that draws the old log-probs)."""
    import collections

    out = common.results_dir()
    for layout in layouts:
        h, w, t, g = inputs(n, d, v, layout)
        if fused_loss:
            fwdbwd = fused_grpo_fwdbwd(layout)
            layout = f"fused_{layout}"
        else:
            _, fwdbwd = op_fns(public(None, weight_layout=layout))
        (out / f"profile_{layout}.hlo.txt").write_text(fwdbwd.lower(h, w, t, g).compile().as_text())
        jax.block_until_ready(fwdbwd(h, w, t, g))
        kernels, host, meta = common.traced(fwdbwd, (h, w, t, g))
        totals = collections.defaultdict(lambda: [0, 0.0])
        span = [float("inf"), 0.0]
        after_grad = (
            0  # the backward's CUTLASS GEMMs: d_hidden, then d_weight, after each grad kernel
        )
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
        lines = [
            f"{layout}: N={n} D={d} V={v}, device events {sum(c for c, _ in totals.values())}, "
            f"busy {sum(ms for _, ms in totals.values()):.3f} ms of a "
            f"{(span[1] - span[0]) / 1e3:.3f} ms span"
        ]
        for name, (count, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:25]:
            lines.append(f"{ms:9.3f} ms {count:5d}x  {name}")
        wall = common.median_ms(fwdbwd, h, w, t, g, warmup=2, runs=10)
        lines.append(
            f"wall clock of one call (median of 10): {wall:.3f} ms; host threads' "
            "longest events in the traced call:"
        )
        names = {
            (e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
            for e in meta
            if e.get("name") == "thread_name"
        }
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
