"""The fast mode's two backward GEMMs from the kept gradient: XLA's against ffi's custom call.

Question: a branch of row skipping runs the fast losses' backward GEMMs (``d_hidden = c·dz·W``,
``d_weight = c·dzᵀ·h``) on the first S of the N rows of the kept gradient ``dz`` [N, V]. XLA's
GEMMs take ``dz[:S]`` as a copy (``kept_grads.leading_rows_grads``); ffi's ``kept_gemms`` reads
the rows in place (``backends.ffi.kept_gemms``). How fast is each, at S = N and at S < N, and
what temp does each hold? bf16, ``"vd"`` weight; each row is ``jax.jit`` of the GEMMs alone on
random operands, timed as ``bench_tokens`` times (median of ``--runs`` synchronised calls,
rotated rounds); ``tflops`` counts the two GEMMs' ``2 · 2·S·D·V`` flops; ``temp_mib`` is XLA's
``temp_size_in_bytes`` (the copy, where there is one, and the GEMMs' workspaces).

    python -m benchmarks.studies.bench_kept_gemms --runs 10     # GPU (Hopper: ffi)
"""

from __future__ import annotations

COLUMNS = ["impl", "N", "S", "D", "V", "ms", "tflops", "temp_mib", "max_rel_dh", "max_rel_dw"]
SIZES = {
    "full": [(4096, 2048, 131072), (16384, 4096, 131072)],
    "small": [(256, 64, 1024)],
}
FRACTIONS = (1.0, 5 / 8, 1 / 8)
"""S / N of the rows: every row (the branch of N rows), and two branches of row skipping."""


def measure(size, runs, rounds, small):
    """The rows of one (N, D, V): each fraction of :data:`FRACTIONS`, XLA's GEMMs and (where the
    ffi backend runs) ffi's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import common
    from jaxrl_kernels.backends import ffi
    from jaxrl_kernels.backends.ffi import kept_gemms
    from jaxrl_kernels.head import kept_grads

    del small
    rows = []
    for n, d, v in [size]:
        key = jax.random.split(jax.random.key(0), 3)
        dz = (jax.random.normal(key[0], (n, v), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        hidden = jax.random.normal(key[1], (n, d), jnp.float32).astype(jnp.bfloat16)
        weight = (jax.random.normal(key[2], (v, d), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
        c = jnp.float32(0.5)
        for fraction in FRACTIONS:
            s = max(128, int(n * fraction) // 128 * 128)
            impls = {"xla": kept_grads.leading_rows_grads}
            if ffi.unavailable_reason() is None:
                impls["ffi"] = kept_gemms.kept_grad_gemms
            steps, outs = [], {}
            for name, impl in impls.items():
                fn = jax.jit(
                    lambda dz, h, w, c, impl=impl, s=s: impl(h[:s], w, dz, c, weight_layout="vd")
                )
                outs[name] = jax.tree.map(
                    lambda x: np.asarray(x.astype(jnp.float32)), fn(dz, hidden, weight, c)
                )
                temp = common.temp_mib(fn, dz, hidden, weight, c)
                row = dict(impl=name, N=n, S=s, D=d, V=v, temp_mib=temp)
                steps.append((row, fn))
            common.rotated_ms(
                steps,
                (dz, hidden, weight, c),
                runs=runs,
                rounds=rounds,
                warm_seconds=0.5,
                key="ms",
            )
            ref_dh, ref_dw = outs["xla"]
            for row, _ in steps:
                row["tflops"] = 4.0 * s * d * v / (row["ms"] * 1e-3) / 1e12
                dh, dw = outs[row["impl"]]
                row["max_rel_dh"] = float(np.max(np.abs(dh - ref_dh)) / np.max(np.abs(ref_dh)))
                row["max_rel_dw"] = float(np.max(np.abs(dw - ref_dw)) / np.max(np.abs(ref_dw)))
                rows.append(row)
                print(row, flush=True)
    return rows


def main(argv=None):
    from benchmarks import common

    return common.sized_main(
        argv,
        description=__doc__.splitlines()[0],
        sizes=SIZES,
        name="bench_kept_gemms",
        columns=COLUMNS,
        measure=measure,
        rounds=2,
    )


if __name__ == "__main__":
    main()
