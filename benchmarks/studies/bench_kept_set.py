"""The ``kept_set`` primitive alone: the ffi kernel on whole rows against the reference's jnp
passes, on float32 rows ``u`` [N, V] held in memory.

Question: what does finding each row's kept set cost by itself (top-k 50, top-p 0.95, both,
min-p 0.05), how many passes over a row does the kernel take, and how close is a pass to
reading the row at the copy bandwidth? ``u`` ~ N(0, LOGIT_STD²) (the logits of
``bench_sampler_logprobs``), ``m`` its row max. Rows:

- ``ffi``: ``backends.ffi.kept_set.find_rows`` (blocks of rows, one CTA a row);
- ``reference``: ``kept_set.find`` (candidates by ``lax.top_k``, or the pivot search);

Columns: ``ms`` the median of ``--runs`` synchronised calls after a warm-up (``--rounds``
rotated rounds, the median kept); ``passes_mean`` / ``passes_max`` the kernel's passes over
a row; ``gbps_per_pass`` the float32 bytes of ``u`` times the mean passes over ``ms``, and
``copy_gbps`` the device's copy bandwidth measured in the same run (``common``).

    python -m benchmarks.studies.bench_kept_set --runs 10      # GPU
    python -m benchmarks.studies.bench_kept_set --small        # toy sizes, any device (reference)

Results: ``bench_kept_set.{json,md}`` (``--name``) in out/bench (``--out``).
"""

from __future__ import annotations

COLUMNS = [
    "impl",
    "truncation",
    "N",
    "V",
    "ms",
    "passes_mean",
    "passes_max",
    "gbps_per_pass",
    "copy_gbps",
]
SIZES = {"full": [(4096, 131072), (8192, 151936)], "n4096": [(4096, 131072)], "small": [(64, 1000)]}
TRUNCATIONS = {
    "top-k 50": dict(top_k=50),
    "top-p 0.95": dict(top_p=0.95),
    "top-k 50, top-p 0.95": dict(top_k=50, top_p=0.95),
    "min-p 0.05": dict(min_p=0.05),
}
LOGIT_STD = 4.0


def measure(size, runs, rounds, small):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import common
    from jaxrl_kernels import dispatch
    from jaxrl_kernels.dispatch.contract import Problem
    from jaxrl_kernels.formulas import sampler_math
    from jaxrl_kernels.head import kept_set

    n, v = size
    u = jax.random.normal(jax.random.key(0), (n, v), jnp.float32) * LOGIT_STD
    m = jnp.max(u, -1)
    active = jnp.ones((n,), bool)
    impls = {"reference": kept_set.find}
    if not small:
        choice = dispatch.select(
            "linear_logprobs", Problem(n_rows=n, vocab=v), primitive="kept_set"
        )
        if choice.backend == "ffi":
            impls = {"ffi": choice.impl, **impls}
    copy = common.copy_bandwidth_gbps() if not small else None
    rows, steps = [], []
    for impl, find in impls.items():
        for name, trunc in TRUNCATIONS.items():
            t = sampler_math.truncation(**trunc)
            fn = jax.jit(
                lambda u, m, a, find=find, t=t: (
                    find(kept_set.Logits.of_array(u), n, v, m, a, t).passes
                )
            )
            passes = np.asarray(fn(u, m, active))
            row = dict(
                impl=impl,
                truncation=name,
                N=n,
                V=v,
                passes_mean=float(passes.mean()),
                passes_max=int(passes.max()),
                copy_gbps=copy,
            )
            rows.append(row)
            steps.append((row, fn))
    common.rotated_ms(
        steps, (u, m, active), runs=runs, rounds=rounds, warm_seconds=0.0 if small else 1.0
    )
    for row in rows:
        row["ms"] = row.pop("fwdbwd_ms")
        if row["impl"] == "ffi":
            row["gbps_per_pass"] = 4 * n * v * row["passes_mean"] / row["ms"] / 1e6
    return rows


def main(argv=None):
    from benchmarks import common

    return common.sized_main(
        argv,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_kept_set",
        columns=COLUMNS,
        measure=measure,
        rounds=2,
    )


if __name__ == "__main__":
    main()
