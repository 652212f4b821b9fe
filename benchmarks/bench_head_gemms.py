"""Per-GEMM TFLOP/s of the linear head: the three GEMMs alone, and the library's own kernels.

Question: at the sizes a trainer runs, how fast is each of the head's three GEMMs when XLA runs
it alone, and how much of ``linear_grpo_loss``'s forward+backward device time does each GEMM
take inside the library, at what rate? Every GEMM has 2·N·D·V floating-point operations; bf16
operands, float32 accumulation, bf16 result.

Rows are (size, pipeline, GEMM) with the device milliseconds per call (``ms``), the rate
(``tflops`` = 2·N·D·V / ms) and the share of the pipeline's kernel time (``frac``):

- pipeline ``XLA alone``: each GEMM its own ``jax.jit`` of one ``lax.dot_general``, in the
  layouts the library uses (``weight_layout="vd"``, head W [V, D]): ``logits h·Wᵀ`` (h [N, D],
  W [V, D] → [N, V], K = D), ``d_hidden G·W`` (G [N, V] → [N, D], K = V), ``d_weight Gᵀ·h``
  (→ [V, D], K = N); random inputs (never zeros). ``ms`` is every kernel of the call (a
  layout copy XLA adds counts; ``kernels`` names them, with launches and ms per call);
  ``frac`` is of the three together.
- pipelines ``lean`` / ``fast``: ``jax.jit(jax.value_and_grad(loss, (hidden, weight)))`` of
  ``jk.linear_grpo_loss(memory=...)`` on ``bench_tokens.inputs`` (random batch, default
  backend), profiled with jax.profiler (``common.traced``, the first traced call left out).
  Each kernel is attributed to a GEMM: the library's SM90 kernels by name
  (``common.kernel_kind``: ``linear_lse_kernel`` = the logits GEMM with the softmax
  statistics, and in fast mode the kept logits, fused; ``linear_grad_kernel`` = the logits
  computed again with their gradient, lean's second logits GEMM, row ``logits again``;
  CUTLASS ``GemmUniversal`` = d_hidden / d_weight); XLA's GEMM kernels (cuBLAS ``nvjet`` /
  ``sm90_xmma`` / ``cutlass``, Triton ``gemm_fusion``) by the output shape of the HLO
  instruction the trace names (``hlo_op``, looked up in the compiled module: [N, V] logits,
  [N, D] d_hidden, [V, D] d_weight, also in chunks), else by the kernel's name when the same
  name ran only one GEMM of the ``XLA alone`` rows. A GEMM-like kernel none of these places is
  a row ``unmatched GEMM-like`` (its name and time, no rate); every other kernel is ``other``
  (its largest kernels named). The ``total`` row is the kernels' summed time per call
  (``span_ms``: first kernel start to last kernel end; ``wall_ms``: a synchronised call by
  the host clock).

On a machine without a GPU the trace has no device kernels: each pipeline then has one row
saying so, timed by the host clock (``timer`` column), and the ``XLA alone`` rows are host
clock times too.

    python -m benchmarks.bench_head_gemms                       # the three default sizes (GPU)
    python -m benchmarks.bench_head_gemms --sizes 4096x2048x131072,8192x4096x131072
    python -m benchmarks.bench_head_gemms --small               # a toy size, any device

Results: ``bench_head_gemms.{json,md}`` in out/bench (``--out``, ``--update-results``:
benchmarks/README.md). The JSON rows keep every kernel's full name (``kernel_names``).
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import traceback

SIZES = {
    "default": [(4096, 2048, 131072), (16384, 4096, 131072), (4096, 4096, 151936)],
    "small": [(128, 96, 1000)],
}
COLUMNS = [
    "N",
    "D",
    "V",
    "pipeline",
    "gemm",
    "ms",
    "tflops",
    "frac",
    "launches",
    "kernels",
    "span_ms",
    "wall_ms",
    "timer",
]
GEMMS = ("logits h·Wᵀ", "d_hidden G·W", "d_weight Gᵀ·h")
"""The three GEMMs, in the order of a forward+backward."""
AGAIN = "logits again (+ their gradient)"
"""Lean's second logits GEMM (its grad kernel computes the logits again with their gradient)."""
UNMATCHED, OTHER = "unmatched GEMM-like", "other"
PIPELINES = ("lean", "fast")
GEMM_LIKE = re.compile(r"nvjet|gemm|cublas|cutlass|xmma|wgmma|matmul|triton.*(mm|dot)|dot", re.I)
KIND_GEMM = {"fwd": GEMMS[0], "grad": AGAIN, "gemm_dh": GEMMS[1], "gemm_dh_splitk": GEMMS[1]}
KIND_GEMM["gemm_dw"] = GEMMS[2]


def parse_sizes(text):
    """``--sizes``: a key of :data:`SIZES` or ``NxDxV[,NxDxV...]``."""
    if text in SIZES:
        return SIZES[text]
    return [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",") if part]


def flops(n, d, v):
    return 2.0 * n * d * v


def gemm_fns():
    """``{gemm: jitted f(h, w, g)}``: the three GEMMs alone, ``weight_layout="vd"``."""
    import jax

    dims = {
        GEMMS[0]: (lambda h, w, g: (h, w), (((1,), (1,)), ((), ()))),  # [N,D]·[V,D]ᵀ
        GEMMS[1]: (lambda h, w, g: (g, w), (((1,), (0,)), ((), ()))),  # [N,V]·[V,D]
        GEMMS[2]: (lambda h, w, g: (g, h), (((0,), (0,)), ((), ()))),  # [N,V]ᵀ·[N,D]
    }

    def one(pick, dn):
        return jax.jit(lambda h, w, g: jax.lax.dot_general(*pick(h, w, g), dn))

    return {gemm: one(pick, dn) for gemm, (pick, dn) in dims.items()}


def gemm_inputs(n, d, v, seed=0):
    """bf16 h [N, D] ~ N(0, 1), W [V, D] ~ N(0, 4/D), G [N, V] ~ N(0, 1e-4) (a logits
    gradient's scale)."""
    import jax
    import jax.numpy as jnp

    kh, kw, kg = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (n, d), jnp.bfloat16)
    w = (jax.random.normal(kw, (v, d), jnp.float32) * (2.0 / math.sqrt(d))).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, (n, v), jnp.float32) * 1e-4).astype(jnp.bfloat16)
    return h, w, g


def traced_calls(fn, args, calls):
    """The device kernels of ``calls`` synchronised calls under one profiler trace, per call,
    the first call (which starts the trace) left out: ``[[kernel event, ...], ...]``."""
    from benchmarks import common

    kernels, host, _ = common.traced(fn, args, calls + 1)
    return [mine for _, mine in common.kernels_by_call(kernels, host)][1:]


def short_name(name):
    """A readable name for a kernel (CUTLASS's and the library's are long templates)."""
    m = re.search(r"jaxrl_sm90::(\w+)", name)
    if m:
        return m.group(1)
    if "GemmUniversal" in name:
        return "cutlass GemmUniversal" + (" StreamK" if "StreamK" in name else "")
    return name[:60]


def hlo_shapes(hlo_text):
    """``{instruction name: dims of its (first) result}`` of a compiled module's text."""
    out = {}
    pat = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\s*[a-z]+\d*\[([\d,]*)\]")
    for line in hlo_text.splitlines():
        m = pat.match(line)
        if m:
            out[m.group(1)] = tuple(int(x) for x in m.group(2).split(",") if x)
    return out


def gemm_of_shape(dims, n, d, v):
    """The GEMM whose result has ``dims`` (leading dimensions folded into rows; chunks of
    the vocabulary count), or None."""
    if len(dims) < 2:
        return None
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if (rows, cols) in ((n, d), (d, n)):
        return GEMMS[1]
    if (rows, cols) in ((v, d), (d, v)):
        return GEMMS[2]
    if (rows, cols) in ((n, v), (v, n)):
        return GEMMS[0]
    if cols == d and n < rows < v:
        return GEMMS[2]  # a chunk of the vocabulary's rows of d_weight
    if rows == n and cols < v and v % cols == 0:
        return GEMMS[0]  # a chunk of the vocabulary's logits
    return None


def attribute(kernel, shapes, known, size):
    """The GEMM (or :data:`UNMATCHED` / :data:`OTHER`) one traced kernel belongs to."""
    from benchmarks import common

    name = kernel["name"]
    kind = common.kernel_kind(name)
    if kind in KIND_GEMM:
        return KIND_GEMM[kind]
    if "jaxrl_sm90" in name or not GEMM_LIKE.search(name):
        return OTHER
    op = str(kernel.get("args", {}).get("hlo_op", ""))
    for key in (op, op.rsplit("/", 1)[-1], op.rsplit(":", 1)[-1]):
        gemm = gemm_of_shape(shapes[key], *size) if key in shapes else None
        if gemm:
            return gemm
    if len(known.get(name, ())) == 1:
        return next(iter(known[name]))
    return UNMATCHED


def summarise(per_call, shapes, known, size):
    """``{gemm: {kernel name: [launches, µs]}}`` over the traced calls (totals), the
    kernels' busy µs per call and the span in µs per call (medians)."""
    groups = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    busy, span = [], []
    for mine in per_call:
        for k in mine:
            cell = groups[attribute(k, shapes, known, size)][k["name"]]
            cell[0] += 1
            cell[1] += k["dur"]
        busy.append(sum(k["dur"] for k in mine))
        span.append(max(k["ts"] + k["dur"] for k in mine) - mine[0]["ts"] if mine else 0.0)
    return groups, _median(busy), _median(span)


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return 0.0
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def kernels_text(names, calls, top=3):
    """``short name ×launches ms; ...`` of the largest ``top`` kernels (per call)."""
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])
    parts = [f"{short_name(k)} ×{c / calls:g} {us / 1e3 / calls:.3f}" for k, (c, us) in ranked]
    more = f"; +{len(parts) - top} more" if len(parts) > top else ""
    return "; ".join(parts[:top]) + more


def pipeline_rows(base, pipeline, groups, busy_us, span_us, calls, wall_ms):
    """The rows of one profiled pipeline: one per GEMM (in order), unmatched GEMM-like
    kernel and ``other``, then ``total``."""
    n, d, v = base["N"], base["D"], base["V"]
    rows = []
    order = [*GEMMS[:1], AGAIN, *GEMMS[1:]]
    for gemm in order + [UNMATCHED, OTHER]:
        if gemm not in groups:
            continue
        names = groups[gemm]
        entries = (
            [(gemm, names)] if gemm != UNMATCHED else [(gemm, {k: c}) for k, c in names.items()]
        )
        for label, sub in entries:
            us = sum(c[1] for c in sub.values()) / calls
            row = {
                **base,
                "pipeline": pipeline,
                "gemm": label,
                "ms": us / 1e3,
                "frac": us / busy_us if busy_us else float("nan"),
                "launches": sum(c[0] for c in sub.values()) / calls,
                "kernels": kernels_text(sub, calls),
                "kernel_names": sorted(sub),
                "timer": "device",
            }
            if label in order and us > 0:
                row["tflops"] = flops(n, d, v) / (us * 1e-6) / 1e12
            rows.append(row)
    rows.append(
        {
            **base,
            "pipeline": pipeline,
            "gemm": "total",
            "ms": busy_us / 1e3,
            "frac": 1.0,
            "launches": sum(c[0] for names in groups.values() for c in names.values()) / calls,
            "span_ms": span_us / 1e3,
            "wall_ms": wall_ms,
            "timer": "device",
        }
    )
    return rows


def xla_rows(base, runs, calls):
    """The ``XLA alone`` rows of one size, and ``{kernel name: {gemm}}`` of what ran."""
    from benchmarks import common

    n, d, v = base["N"], base["D"], base["V"]
    args = gemm_inputs(n, d, v)
    rows, known = [], collections.defaultdict(set)
    for gemm, fn in gemm_fns().items():
        try:
            common.warm_up(fn, *args, seconds=0.3)
            wall = common.median_ms(fn, *args, runs=runs)
            per_call = traced_calls(fn, args, calls)
            busy = _median([sum(k["dur"] for k in mine) for mine in per_call])
            names = collections.defaultdict(lambda: [0, 0.0])
            for k in (k for mine in per_call for k in mine):
                names[k["name"]][0] += 1
                names[k["name"]][1] += k["dur"]
                known[k["name"]].add(gemm)
            ms, timer = (busy / 1e3, "device") if busy else (wall, "wall")
            row = {
                **base,
                "pipeline": "XLA alone",
                "gemm": gemm,
                "ms": ms,
                "tflops": flops(n, d, v) / (ms * 1e-3) / 1e12,
                "launches": sum(c for c, _ in names.values()) / max(len(per_call), 1),
                "kernels": kernels_text(names, max(len(per_call), 1)) or "-",
                "kernel_names": sorted(names),
                "wall_ms": wall,
                "timer": timer,
            }
        except Exception as err:  # noqa: BLE001 - out of memory: this row says so, the rest go on
            traceback.print_exc()
            row = {**base, "pipeline": "XLA alone", "gemm": gemm, "error": _error(err)}
        print(row, flush=True)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    total = sum(r["ms"] for r in timed)
    for r in timed:
        r["frac"] = r["ms"] / total
    if len(timed) == len(GEMMS):
        rows.append(
            {
                **base,
                "pipeline": "XLA alone",
                "gemm": "total",
                "ms": total,
                "tflops": 3 * flops(n, d, v) / (total * 1e-3) / 1e12,
                "frac": 1.0,
                "timer": timed[0]["timer"],
            }
        )
        print(rows[-1], flush=True)
    del args
    return rows, known


def library_rows(base, pipeline, known, runs, calls):
    """The rows of ``linear_grpo_loss(memory=pipeline)``'s forward+backward at one size."""
    import jax

    from benchmarks import bench_tokens, common

    n, d, v = base["N"], base["D"], base["V"]
    try:
        data = bench_tokens.inputs(n, d, v)
        loss = bench_tokens.losses()[f"ours {pipeline}"]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = step.lower(*data).compile()
        shapes = hlo_shapes(compiled.as_text())
        common.warm_up(compiled, *data, seconds=0.3)
        wall = common.median_ms(compiled, *data, runs=runs)
        per_call = traced_calls(compiled, data, calls)
    except Exception as err:  # noqa: BLE001 - out of memory: this row says so, the rest go on
        traceback.print_exc()
        rows = [{**base, "pipeline": pipeline, "gemm": "total", "error": _error(err)}]
    else:
        if not any(per_call):
            rows = [
                {
                    **base,
                    "pipeline": pipeline,
                    "gemm": "(no device kernels in the trace)",
                    "ms": wall,
                    "frac": 1.0,
                    "wall_ms": wall,
                    "timer": "wall",
                }
            ]
        else:
            groups, busy, span = summarise(per_call, shapes, known, (n, d, v))
            rows = pipeline_rows(base, pipeline, groups, busy, span, len(per_call), wall)
    for row in rows:
        print(row, flush=True)
    return rows


def _error(err):
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from benchmarks import output

    output.output_arguments(parser)
    parser.add_argument(
        "--sizes", default="default", help="a preset (default, small) or NxDxV[,NxDxV...]"
    )
    parser.add_argument("--small", action="store_true", help="a toy size, any device")
    parser.add_argument("--runs", type=int, default=10, help="timed calls by the host clock")
    parser.add_argument("--calls", type=int, default=3, help="profiled calls per variant")
    parser.add_argument(
        "--pipelines", default=",".join(PIPELINES), help="memory modes profiled (lean,fast)"
    )
    parser.add_argument("--name", default="bench_head_gemms", help="the results' file name")
    args = parser.parse_args(argv)

    import jax

    from benchmarks import common

    print(common.metadata(), flush=True)
    rows = []
    for n, d, v in parse_sizes("small" if args.small else args.sizes):
        base = {"N": n, "D": d, "V": v}
        xla, known = xla_rows(base, args.runs, args.calls)
        rows += xla
        jax.clear_caches()
        for pipeline in args.pipelines.split(","):
            rows += library_rows(base, pipeline, known, args.runs, args.calls)
            jax.clear_caches()
    extra = ["error"] if any("error" in r for r in rows) else []
    print(common.write_results(args.name, rows, COLUMNS + extra))
    return rows


if __name__ == "__main__":
    main()
