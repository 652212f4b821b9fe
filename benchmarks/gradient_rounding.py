"""Which rounding sets the head gradient's error: the logits, their gradient, or the result.

Question: ``memory="fast"`` gives ``d_hidden`` and ``d_weight`` the plain bf16 code's error
(2.36e-3 in ``linear_side_by_side.md``, where lean has 1.66e-3); how much of it comes from
rounding the logits ``z``, their gradient ``dz`` or the gradients themselves, and what would
an error well under 2e-3 take?

The head's backward of ``Σ_rows g · logp[target]`` on bf16 hidden states ``h`` [N, D] and a bf16
head ``W`` [V, D] (the side-by-side's draws: ``h ~ N(0, 1)``, ``W ~ N(0, 1.5² / D)``, ``g ~
N(0, 1)``)::

    z = h·Wᵀ,   dz = g · (onehot_t − softmax(z)),   d_hidden = dz·W,   d_weight = dzᵀ·h

computed in float64 on the same bf16 inputs (the exact value), and with ``z`` rounded to
``z_dtype`` after a float32 GEMM, ``dz`` computed in float32 and rounded to ``dz_dtype``
(float16 times the power of two that brings its largest entry to 2¹⁴, as the fused loss
writes it for a float16 head), the two GEMMs in float32, and the results kept in float32 or
rounded to bf16 (what a bf16 model's gradient is). Each row: ``‖got − exact‖ / ‖exact‖``.

    python -m benchmarks.gradient_rounding            # N=1024, D=1024, V=32000, any device
    python -m benchmarks.gradient_rounding --small    # a quick look

Results: ``gradient_rounding.{json,md}`` (benchmarks.common.write_results).
"""

from __future__ import annotations

import argparse

from benchmarks import output

COLUMNS = ["z_dtype", "dz_dtype", "result", "err_d_hidden", "err_d_weight", "N", "D", "V"]
CASES = [  # (z_dtype, dz_dtype, what rounds that way)
    ("bfloat16", "bfloat16"),  # memory="fast", the plain bf16 code
    ("float32", "bfloat16"),  # logits kept in float32 (twice the memory)
    ("float16", "float16"),  # float16 logits and a scaled float16 gradient (lean's G)
    ("float32", "float32"),  # float32 throughout: the GEMMs' own rounding
]


def exact_grads(h, w, targets, g):
    """float64 ``(d_hidden, d_weight)``."""
    import jax
    import jax.numpy as jnp

    h, w = h.astype(jnp.float64), w.astype(jnp.float64)
    z = h @ w.T
    dz = g.astype(jnp.float64)[:, None] * (
        jax.nn.one_hot(targets, w.shape[0], dtype=jnp.float64) - jax.nn.softmax(z, axis=-1)
    )
    return dz @ w, dz.T @ h


def rounded_grads(h, w, targets, g, z_dtype, dz_dtype):
    """float32 ``(d_hidden, d_weight)`` with ``z`` and ``dz`` rounded as the module says."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    z = jnp.dot(h, w.T, preferred_element_type=f32).astype(z_dtype).astype(f32)
    dz = g[:, None] * (jax.nn.one_hot(targets, w.shape[0], dtype=f32) - jax.nn.softmax(z, -1))
    scale = 1.0
    if jnp.dtype(dz_dtype) == jnp.float16:
        from jaxrl_kernels.head import head_grad

        scale = head_grad.pow2_range(jnp.max(jnp.abs(dz)))
    dz = (dz * scale).astype(dz_dtype).astype(f32)
    hp = jax.lax.Precision.HIGHEST
    return (
        jnp.dot(dz, w.astype(f32), precision=hp) / scale,
        jnp.dot(dz.T, h.astype(f32), precision=hp) / scale,
    )


def rows(n, d, v, seed=0):
    """A row per case of :data:`CASES` and result dtype: the two gradients' relative errors."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(keys[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, d), jnp.float32) * (1.5 / d**0.5)).astype(jnp.bfloat16)
    targets = jax.random.randint(keys[2], (n,), 0, v)
    g = jax.random.normal(keys[3], (n,), jnp.float32)
    exact = exact_grads(h, w, targets, g)

    def err(got, want):
        return float(jnp.linalg.norm(got.astype(jnp.float64) - want) / jnp.linalg.norm(want))

    out = []
    for z_dtype, dz_dtype in CASES:
        grads = rounded_grads(h, w, targets, g, z_dtype, dz_dtype)
        for result in ("float32", "bfloat16"):
            got = [x.astype(result) for x in grads]
            out.append(
                dict(
                    z_dtype=z_dtype,
                    dz_dtype=dz_dtype,
                    result=result,
                    err_d_hidden=err(got[0], exact[0]),
                    err_d_weight=err(got[1], exact[1]),
                    N=n,
                    D=d,
                    V=v,
                )
            )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--small", action="store_true", help="N=64, D=64, V=1000")
    parser.add_argument("--name", default="gradient_rounding", help="the results' file name")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_enable_x64", True)
    from benchmarks import common

    n, d, v = (64, 64, 1000) if args.small else (1024, 1024, 32000)
    print(common.write_results(args.name, rows(n, d, v), COLUMNS))


if __name__ == "__main__":
    main()
