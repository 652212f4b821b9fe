"""Batch-invariant log-probs: what ``batch_invariant=True`` costs, and whether it holds, per backend.

Question: on this device, how much slower is ``linear_logprobs`` (and ``token_logprobs`` on
logits) forward + backward with ``batch_invariant=True`` than without, on every backend that
serves it, at token counts that are and are not multiples of the kernels' tiles; and are the
first rows' log-probs and their rows of the gradient bitwise those of the same rows computed
alone? Each row is ``jax.jit(jax.value_and_grad(Σ g·logp, (hidden, weight)))`` (logits for
``token_logprobs``), bf16, ``g ~ U[0.5, 1.5)``, the median of ``--runs`` synchronised calls
after a warm-up, the default and invariant calls of one backend and size timed in rotated
rounds (``common.rotated_ms``):

- ``fwdbwd_ms`` default, ``invariant_ms`` with ``batch_invariant=True``, ``x_default`` their
  ratio;
- ``bitwise``: with ``batch_invariant=True``, the first ``ALONE`` rows' log-probs and rows of
  ``d_hidden`` (``d_logits``) at this N have the bits of the same rows' call at N = ``ALONE``;
- ffi rows on a GPU: the mean device ms per call by kernel kind (``common.kernel_kind``:
  forward, grad kernel, weight copy, d_hidden's GEMM unsplit and split-K,
  d_weight's, the rest) of the default call and (``inv_``) the invariant one, from one
  profiler trace of 3 calls each.

    python -m benchmarks.bench_batch_invariant --runs 20     # GPU
    python -m benchmarks.bench_batch_invariant --small       # toy sizes, any device
    python -m benchmarks.bench_batch_invariant --backends ffi  # only these backends' rows

Results: ``bench_batch_invariant.{json,md}`` (``--name``) in out/bench (``--out``).
"""

from __future__ import annotations

KINDS = ("fwd", "grad", "copy_ms", "gemm_dh", "gemm_dh_splitk", "gemm_dw", "other")
"""The kernel kinds of the ffi rows' breakdown (``common.KERNELS`` but absmax)."""
COLUMNS = (
    ["op", "backend", "N", "D", "V", "fwdbwd_ms", "invariant_ms", "x_default", "bitwise"]
    + [k for kind in KINDS for k in (kind, "inv_" + kind)]
    + ["error"]
)
SIZES = {
    "full": [(n, 2048, 131072) for n in (1000, 4096, 16384)],
    "n4096": [(4096, 2048, 131072)],
    "n1000_n4096": [(n, 2048, 131072) for n in (1000, 4096)],
    "small": [(8, 32, 1000), (100, 32, 1000)],
}
LINEAR_BACKENDS = ("ffi", "pallas", "chunked")
TOKEN_BACKENDS = ("pallas", "reference")
SMALL_BACKENDS = {"linear_logprobs": ("chunked", "reference"), "token_logprobs": ("reference",)}
ALONE = 7


def inputs(n, d, v, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d), np.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d), np.float32) * np.float32(2.0 / d**0.5)).astype(
        jnp.bfloat16
    )
    targets = jnp.asarray(rng.integers(0, v, (n,)).astype(np.int32))
    g = jnp.asarray(rng.uniform(0.5, 1.5, (n,)).astype(np.float32))
    return h, w, targets, g


def step(op, backend, invariant):
    """``jit(value_and_grad)`` of ``Σ g·logp`` in the op's differentiable inputs."""
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    if op == "linear_logprobs":

        def loss(h, w, t, g):
            return jnp.sum(
                g * jk.linear_logprobs(h, w, t, backend=backend, batch_invariant=invariant)
            )

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def loss_logits(x, t, g):
        return jnp.sum(g * jk.token_logprobs(x, t, backend=backend, batch_invariant=invariant))

    return jax.jit(jax.value_and_grad(loss_logits))


def row_outputs(op, backend, data):
    """(log-probs, per-row gradient) of the invariant call: d_hidden or d_logits."""
    import jax

    import jaxrl_kernels as jk

    if op == "linear_logprobs":
        h, w, t, g = data
        f = lambda h: jk.linear_logprobs(h, w, t, backend=backend, batch_invariant=True)
    else:
        x, t, g = data
        f = lambda x: jk.token_logprobs(x, t, backend=backend, batch_invariant=True)
    logp, vjp = jax.jit(lambda a: jax.vjp(f, a))(data[0])
    return logp, jax.jit(vjp)(g)[0]


def same_bits(a, b):
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def measure(size, runs, rounds, small, only=()):
    """The rows of one size; ``only`` (``--backends``): the backends whose rows run (empty:
    all)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import common

    n, d, v = size
    h, w, t, g = inputs(n, d, v)
    logits = None
    rows = []
    for op in ("linear_logprobs", "token_logprobs"):
        backends = (
            SMALL_BACKENDS[op]
            if small
            else (LINEAR_BACKENDS if op == "linear_logprobs" else TOKEN_BACKENDS)
        )
        if op == "token_logprobs":
            logits = jnp.einsum("nd,vd->nv", h, w)
        data = (h, w, t, g) if op == "linear_logprobs" else (logits, t, g)
        for backend in backends:
            if only and backend not in only:
                continue
            row = {"op": op, "backend": backend, "N": n, "D": d, "V": v}
            try:
                default, invariant = step(op, backend, False), step(op, backend, True)
                timing = [({"which": "default"}, default), ({"which": "invariant"}, invariant)]
                common.rotated_ms(
                    timing, data, runs=runs, rounds=rounds, warm_seconds=0.0 if small else 0.3
                )
                row["fwdbwd_ms"] = timing[0][0]["fwdbwd_ms"]
                row["invariant_ms"] = timing[1][0]["fwdbwd_ms"]
                row["x_default"] = row["invariant_ms"] / row["fwdbwd_ms"]
                logp, grad = row_outputs(op, backend, data)
                alone = tuple(x[:ALONE] if x.ndim and x.shape[0] == n else x for x in data)
                logp1, grad1 = row_outputs(op, backend, alone)
                row["bitwise"] = same_bits(logp[:ALONE], logp1) and same_bits(grad[:ALONE], grad1)
                if backend == "ffi" and not small:
                    row.update(common.kernel_ms(default, data, KINDS))
                    row.update(
                        {
                            "inv_" + k: ms
                            for k, ms in common.kernel_ms(invariant, data, KINDS).items()
                        }
                    )
            except Exception as e:  # noqa: BLE001 - a backend that fails still leaves its row
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(row, flush=True)
            rows.append(row)
        if not small:
            jax.clear_caches()
    return rows


def main(argv=None):
    import argparse
    import functools

    from benchmarks import common

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backends", default="", help="comma-separated; default: all")
    known, rest = parser.parse_known_args(argv)
    only = tuple(b for b in known.backends.split(",") if b)
    return common.sized_main(
        rest,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_batch_invariant",
        columns=COLUMNS,
        measure=functools.partial(measure, only=only),
        rounds=3,
    )


if __name__ == "__main__":
    main()
