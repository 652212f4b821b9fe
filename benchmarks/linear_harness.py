"""What the linear-head benchmarks share: inputs, the GEMM they are measured against, the
variants they time (public op, Pallas primitive under a config, ffi forward with a chosen
backward) and how they time them (budgeted medians, rotated rounds)."""

from __future__ import annotations

import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common, kernel_entry
from jaxrl_kernels.backends.pallas import linear as pallas_linear


def inputs(n, d, v, layout="vd", seed=0):
    """bf16 hidden [N, D], weight ([V, D] or [D, V]), int32 targets [N], float32 cotangents [N]."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d), np.float32), jnp.bfloat16)
    wshape = (v, d) if layout == "vd" else (d, v)
    w = jnp.asarray(rng.standard_normal(wshape, np.float32) * (2 / np.sqrt(d)), jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g = jnp.asarray(rng.standard_normal(n, np.float32))
    return h, w, t, g


def timed(fn, *args, budget_ms=2500.0):
    """Median ms with a run count that keeps slow variants inside the time budget."""
    return common.time_calls(fn, *args, warmup=3, runs=25, budget_ms=budget_ms).median


def gemm_call(layout="vd"):
    """hidden [N, D] x weight -> [N, V] logits in bf16, jitted (XLA's GEMM)."""
    dims = (((1,), (1,)), ((), ())) if layout == "vd" else (((1,), (0,)), ((), ()))
    return jax.jit(lambda h, w: jax.lax.dot_general(h, w, dims))


def gemm_ms(h, w, layout="vd"):
    return timed(gemm_call(layout), h, w)


def sized(n, d, v, layout="vd"):
    """(inputs, XLA's GEMM ms, the start of a result row) for one size."""
    h, w, t, g = inputs(n, d, v, layout)
    gemm = gemm_ms(h, w, layout)
    return (h, w, t, g), gemm, {"N": n, "D": d, "V": v, "gemm_ms": gemm}


def gemm_row(base):
    """The GEMM's own row of a table: forward = one GEMM."""
    return {**base, "impl": "gemm (XLA, bf16 out)", "fwd_ms": base["gemm_ms"], "fwd_x_gemm": 1.0}


def op_fns(call):
    """(forward, forward+backward) jitted from ``call(h, w, t) -> logp``."""
    fwd = jax.jit(call)

    def loss(h, w, t, g):
        return jnp.sum(call(h, w, t) * g)

    fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return fwd, fwdbwd


def measure(call, h, w, t, g, gemm, want_bwd=True):
    """Forward (and forward+backward) time, its ratio to ``gemm`` and XLA's temp buffer size."""
    fwd, fwdbwd = op_fns(call)
    row = {"fwd_ms": timed(fwd, h, w, t), "fwd_temp_mib": common.temp_mib(fwd, h, w, t)}
    row["fwd_x_gemm"] = row["fwd_ms"] / gemm
    if want_bwd:
        row["fwdbwd_ms"] = timed(fwdbwd, h, w, t, g)
        row["fwdbwd_temp_mib"] = common.temp_mib(fwdbwd, h, w, t, g)
        row["fwdbwd_x_gemm"] = row["fwdbwd_ms"] / gemm
    return row


def measure_variants(variants, base, h, w, t, g, gemm, want_bwd=True):
    """One row per (name, call): ``measure``, or the error (the others go on)."""
    rows = []
    for name, call in variants:
        try:
            row = measure(call, h, w, t, g, gemm, want_bwd)
        except Exception as err:
            traceback.print_exc()
            row = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        rows.append({**base, "impl": name, **row})
        print(rows[-1], flush=True)
    return rows


def public(backend, **kw):
    """``call(h, w, t) -> logp`` through the public op, with ``backend`` (None: automatic)."""

    def call(h, w, t):
        out = jk.linear_logprobs(h, w, t, backend=backend, **kw)
        return out[0] if isinstance(out, tuple) else out

    return call


def primitive(config, *, return_entropy=False, layout="vd"):
    """``call(h, w, t) -> logp`` through the Pallas primitive under ``config``."""

    def call(h, w, t):
        valid = jnp.ones(t.shape, jnp.bool_)
        return kernel_entry.pallas_linear_logprobs(
            h,
            w,
            None,
            t,
            valid,
            weight_layout=layout,
            temperature=1.0,
            return_entropy=return_entropy,
            config=config,
        )[0]

    return call


def make_config(base=pallas_linear.DEFAULT_CONFIG, **kw):
    """A ``pallas.linear.Config`` from ``base`` with fields replaced (tile configs as tuples)."""
    for key in ("forward", "grad"):
        if key in kw:
            kw[key] = pallas_linear.TileConfig(*kw[key])
    return dataclasses.replace(base, **kw)


def ffi_variant(layout, backward):
    """``call(h, w, t) -> logp`` with the ffi forward and the given backward part
    (``logprob_core``)."""
    from jaxrl_kernels.backends.ffi import linear as ffi_linear
    from jaxrl_kernels.dispatch.contract import Parts
    from jaxrl_kernels.engine import linear_head

    parts = Parts(ffi_linear.linear_stats, backward)

    def call(h, w, t):
        valid = jnp.ones(t.shape, jnp.bool_)
        return linear_head.linear_from_parts(
            parts, h, w, None, t, valid, linear_head.HeadCall(weight_layout=layout)
        )[0]

    return call


def ffi_chunks(mib):
    """``ffi.linear.linear_backward`` with backward chunks of ``mib`` MiB."""
    import functools

    from jaxrl_kernels.backends.ffi import linear as ffi_linear

    return functools.partial(
        ffi_linear.linear_backward, config=ffi_linear.Config(chunk_bytes=mib * 2**20)
    )


ROUNDS = 4


def rotated(variants, rounds=ROUNDS):
    """{name: (fn, args)} timed ``in_rotation``: {name: median of its rounds' medians}."""
    times = {name: [] for name in variants}
    for name in common.in_rotation(variants, rounds):
        fn, args = variants[name]
        times[name].append(timed(fn, *args))
    return {name: common.Timing(tuple(ts)).median for name, ts in times.items()}


def against_gemm(sizes, make_variants):
    """Per size and layout: XLA's GEMM and ``make_variants(h, w, t, g, layout)`` ({name: (fn,
    args)}), timed ``rotated`` after a second of GEMMs. Yields, per variant, ({N, D, V,
    layout}, name, its ms, the GEMM's ms, (fn, args))."""
    for n, d, v in sizes:
        for layout in ("vd", "dv"):
            h, w, t, g = inputs(n, d, v, layout)
            gemm_fn = gemm_call(layout)
            common.warm_up(gemm_fn, h, w)
            variants = {"gemm": (gemm_fn, (h, w)), **make_variants(h, w, t, g, layout)}
            times = rotated(variants)
            base = {"N": n, "D": d, "V": v, "layout": layout}
            for name, fn_args in list(variants.items())[1:]:
                yield base, name, times[name], times["gemm"], fn_args
            del h, w, variants
