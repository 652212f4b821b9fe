"""Small ffi calls for compute-sanitizer (not a pytest module).

Exercises ragged N, V and D, both layouts and dtypes, bias, ignored rows and
out-of-range targets (negative, V, far beyond V), so that every edge path of
both kernels runs at least once: the forward through the public op, the backward's grad
kernel through ``ffi.linear_backward`` in 256-column chunks (several chunks and a ragged, for
odd V odd-width, tail) against the chunked backend's float32 backward. XLA's command buffers
are off: a forward+backward run with them on segfaulted inside compute-sanitizer. On a
Hopper GPU:

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
        compute-sanitizer --tool memcheck --kernel-name kns=jaxrl_sm90 --error-exitcode 1 \
        python3 tests/support/ffi_memcheck.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from jaxrl_kernels.backends import ffi
from jaxrl_kernels.backends.chunked import logprobs as chunked
from jaxrl_kernels.backends.ffi import linear as ffi_linear

CASES = [  # (N, D, V, layout, dtype, bias)
    (1, 8, 1, "vd", jnp.bfloat16, True),
    (5, 16, 777, "vd", jnp.bfloat16, True),
    (3, 64, 1000, "vd", jnp.bfloat16, True),
    (130, 72, 1000, "dv", jnp.float16, True),
    (257, 136, 777, "vd", jnp.float16, False),
    (129, 64, 2056, "dv", jnp.bfloat16, False),
]


def main() -> None:
    why = ffi.unavailable_reason()
    if why:
        raise SystemExit(f"ffi unavailable: {why}")
    worst = worst_grad = 0.0
    for i, (n, d, v, layout, dtype, with_bias) in enumerate(CASES):
        k = jax.random.split(jax.random.key(i), 4)
        h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype)
        w = (jax.random.normal(k[1], (v, d) if layout == "vd" else (d, v)) / 4).astype(dtype)
        b = jax.random.normal(k[2], (v,)).astype(dtype) if with_bias else None
        t = np.asarray(jax.random.randint(k[3], (n,), 0, v, jnp.int32)).copy()
        t[::7] = -100  # ignored
        t[1::11] = v  # out of range: NaN
        t[2::13] = -(2**30)
        t[3::17] = 2**31 - 1
        t = jnp.asarray(t)

        def run(backend):
            # under jit the targets are traced: out-of-range ones give NaN instead of raising
            fwd = jax.jit(
                lambda h, w, b, t: jk.linear_logprobs(
                    h,
                    w,
                    t,
                    b,
                    weight_layout=layout,
                    ignore_index=-100,
                    return_entropy=True,
                    backend=backend,
                )
            )
            return [np.asarray(x, np.float64) for x in fwd(h, w, b, t)]

        got, ref = run("ffi"), run("reference")
        for g, r in zip(got, ref):
            assert np.array_equal(np.isnan(g), np.isnan(r))
            fin = ~np.isnan(r)
            worst = max(worst, float(np.max(np.abs(g[fin] - r[fin]), initial=0.0)))
        worst_grad = max(worst_grad, backward_error(h, w, b, t, layout, seed=i))
        print(f"case {i}: N={n} D={d} V={v} {layout} {jnp.dtype(dtype).name} bias={with_bias} ok")
    print(f"max |ffi - reference| over logp/entropy: {worst:.3e}")
    print(f"max relative error of the ffi backward against chunked (float32): {worst_grad:.3e}")
    assert worst < 5e-2, worst
    assert worst_grad < 1e-2, worst_grad


def backward_error(h, w, b, t, layout, seed):
    """max over d_hidden, d_weight, d_bias of ‖ffi − chunked‖ / ‖chunked‖, with ignored rows
    (lse = +inf, zero cotangents) and out-of-range targets as logprob_core passes them."""
    n = h.shape[0]
    v = w.shape[0] if layout == "vd" else w.shape[1]
    b32 = None if b is None else b.astype(jnp.float32)
    valid = (t >= 0) & (t < v)
    m, s, a, _ = chunked.linear_stats(
        h, w, b32, t, valid, weight_layout=layout, temperature=1.0, with_entropy=True
    )
    lse = jnp.where(valid, m + jnp.log(s), jnp.inf)
    ent = jnp.log(s) - a / s
    k = jax.random.split(jax.random.key(100 + seed), 2)
    g, g_ent = (jnp.where(valid, jax.random.normal(kk, (n,)), 0.0) for kk in k)
    args = (h, w, b32, t, lse, ent, g, g_ent)
    config = ffi_linear.Config(chunk_bytes=2 * n * 256)
    got = jax.jit(
        lambda *a: ffi_linear.linear_backward(
            *a, weight_layout=layout, temperature=1.0, config=config
        )
    )(*args)
    want = chunked.linear_backward(
        h.astype(jnp.float32),
        w.astype(jnp.float32),
        *args[2:],
        weight_layout=layout,
        temperature=1.0,
    )
    worst = 0.0
    for x, y in zip(got, want):
        if y is None:
            continue
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


if __name__ == "__main__":
    main()
