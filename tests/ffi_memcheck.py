"""Small ffi calls for compute-sanitizer (not a pytest module).

Exercises ragged N, V and D, both layouts and dtypes, bias, ignored rows and
out-of-range targets (negative, V, far beyond V), so that every edge path of
the kernels runs at least once. Forward only (the backward is plain XLA) and with XLA's
command buffers off: a forward+backward run with them on segfaulted inside
compute-sanitizer. On a Hopper GPU:

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
        compute-sanitizer --tool memcheck --kernel-name kns=jaxrl_sm90 --error-exitcode 1 \
        python3 tests/ffi_memcheck.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from jaxrl_kernels.backends import ffi

CASES = [  # (N, D, V, layout, dtype, bias)
    (1, 8, 1, "vd", jnp.bfloat16, True),
    (3, 64, 1000, "vd", jnp.bfloat16, True),
    (130, 72, 1000, "dv", jnp.float16, True),
    (257, 136, 777, "vd", jnp.float16, False),
    (129, 64, 2056, "dv", jnp.bfloat16, False),
]


def main() -> None:
    why = ffi.unavailable_reason()
    if why:
        raise SystemExit(f"ffi unavailable: {why}")
    worst = 0.0
    for i, (n, d, v, layout, dtype, with_bias) in enumerate(CASES):
        k = jax.random.split(jax.random.key(i), 4)
        h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype)
        w = (jax.random.normal(k[1], (v, d) if layout == "vd" else (d, v)) / 4).astype(dtype)
        b = jax.random.normal(k[2], (v,)).astype(dtype) if with_bias else None
        t = np.asarray(jax.random.randint(k[3], (n,), 0, v, jnp.int32)).copy()
        t[:: 7] = -100            # ignored
        t[1:: 11] = v             # out of range: NaN
        t[2:: 13] = -(2**30)
        t[3:: 17] = 2**31 - 1
        t = jnp.asarray(t)

        def run(backend):
            # under jit the targets are traced: out-of-range ones give NaN instead of raising
            fwd = jax.jit(lambda h, w, b, t: jk.linear_logprobs(
                h, w, t, b, weight_layout=layout, ignore_index=-100, return_entropy=True,
                backend=backend))
            return [np.asarray(x, np.float64) for x in fwd(h, w, b, t)]

        got, ref = run("ffi"), run("reference")
        for g, r in zip(got, ref):
            assert np.array_equal(np.isnan(g), np.isnan(r))
            fin = ~np.isnan(r)
            worst = max(worst, float(np.max(np.abs(g[fin] - r[fin]), initial=0.0)))
        print(f"case {i}: N={n} D={d} V={v} {layout} {jnp.dtype(dtype).name} bias={with_bias} ok")
    print(f"max |ffi - reference| over logp/entropy: {worst:.3e}")
    assert worst < 5e-2, worst


if __name__ == "__main__":
    main()
