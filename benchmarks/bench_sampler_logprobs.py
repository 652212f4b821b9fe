"""Sampler-matched log-probs: ``linear_logprobs`` with ``top_k`` / ``top_p`` against without.

Question: what do the processed distribution's log-probs (top-k 50, top-p 0.95, both) cost,
forward + backward, against plain ``linear_logprobs`` at 4096×2048×131072 and
8192×4096×151936 (bf16), with what memory (no ``[N, V]`` buffer in lean mode) and error, and
against the plain jnp code a user would write for them in the same run? Each row is
``jax.jit(jax.value_and_grad(Σ g·logp, (hidden, weight)))``, compiled once, ``g`` a fixed
random cotangent ``~ U[0.5, 1.5)``; bf16 hidden ``[B, T, D]`` ~ N(0, 1) and head ``[V, D]``
~ N(0, (LOGIT_STD² / D)), so that the logits have about that standard deviation:

- ``lean``: ``jk.linear_logprobs``, ``memory="lean"``, backend automatic; ``none`` is the
  plain call (``x_plain`` = 1 for its size);
- ``fast``: the same with ``memory="fast"``;
- ``jnp bf16``: ``einsum`` to bf16 logits, float32, the kept set by ``lax.top_k`` and a sort
  with a cumulative sum (the truncation's definition), ``z_t`` minus the kept set's
  ``logsumexp`` (finite where the target is outside it, as ours).

Columns: ``fwdbwd_ms`` the median of ``--runs`` synchronised calls after a warm-up, in
``--rounds`` rotated rounds (the median over rounds); ``x_plain`` its ratio to the lean
untruncated row of the same size; ``temp_mib`` XLA's temp size of the compiled executable
(``memory_analysis``); ``no_nv_buffer`` whether it is below one bf16 ``[N, V]`` array
(``nv_mib``); ``kept`` the mean size of a row's kept set; ``err_logp``, ``err_dh``,
``err_dW`` relative max-norm errors against ``backend="reference"`` (float32 logits,
materialised) of the same call.

    python -m benchmarks.bench_sampler_logprobs --runs 10      # GPU
    python -m benchmarks.bench_sampler_logprobs --small        # toy sizes, any device

Results: ``bench_sampler_logprobs.{json,md}`` (``--name``) in out/bench (``--out``).
"""

from __future__ import annotations

COLUMNS = [
    "impl",
    "truncation",
    "N",
    "D",
    "V",
    "fwdbwd_ms",
    "x_plain",
    "temp_mib",
    "nv_mib",
    "no_nv_buffer",
    "kept",
    "err_logp",
    "err_dh",
    "err_dW",
    "error",
]
SIZES = {
    "full": [(4096, 2048, 131072), (8192, 4096, 151936)],
    "n4096": [(4096, 2048, 131072)],
    "n8192": [(8192, 4096, 151936)],
    "small": [(64, 32, 1000)],
}
TRUNCATIONS = {  # name: the jk.Sampler's options (sampler_of), as in plain_jnp
    "none": {},
    "top-k 50": dict(top_k=50),
    "top-p 0.95": dict(top_p=0.95),
    "top-k 50, top-p 0.95": dict(top_k=50, top_p=0.95),
}
LOGIT_STD = 4.0


def sampler_of(trunc):
    """The ``jk.Sampler`` of one of :data:`TRUNCATIONS` (``None`` for the plain call)."""
    import jaxrl_kernels as jk

    return jk.Sampler(**trunc) if trunc else None


def inputs(n, d, v, seed=0):
    import jax.numpy as jnp
    import numpy as np

    b = max(2, n // 1024)
    t = n // b
    rng = np.random.default_rng(seed)
    # cast on the host: no float32 copy of the weight on the device, which would set the
    # process's peak (studies.bench_sampler_forward --peak) above the call's own
    h = jnp.asarray(rng.standard_normal((b, t, d), np.float32).astype(jnp.bfloat16))
    w = jnp.asarray(
        (rng.standard_normal((v, d), np.float32) * np.float32(LOGIT_STD / d**0.5)).astype(
            jnp.bfloat16
        )
    )
    targets = jnp.asarray(rng.integers(0, v, (b, t)).astype(np.int32))
    g = jnp.asarray(rng.uniform(0.5, 1.5, (b, t)).astype(np.float32))
    return h, w, targets, g


def plain_jnp(h, w, targets, g, trunc):
    """The code a user writes: bf16 logits, the kept set from a sort, masked log_softmax."""
    import jax
    import jax.numpy as jnp

    z = jnp.einsum("btd,vd->btv", h, w).astype(jnp.float32)
    keep = jnp.ones(z.shape, bool)
    if "top_k" in trunc:
        kth = jax.lax.top_k(z, trunc["top_k"])[0][..., -1:]
        keep &= z >= kth
    if "top_p" in trunc:
        zk = jnp.where(keep, z, -jnp.inf)
        order = jnp.argsort(-zk, axis=-1)
        p = jax.nn.softmax(jnp.take_along_axis(zk, order, axis=-1), axis=-1)
        above = jnp.cumsum(p, axis=-1) - p
        keep_sorted = jax.lax.stop_gradient(above < trunc["top_p"])
        keep &= jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    z_t = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    logp = z_t - jax.nn.logsumexp(jnp.where(keep, z, -jnp.inf), axis=-1)
    return jnp.sum(g * logp)


def calls():
    """``{(impl, truncation): loss(h, w, targets, g)}``."""
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    def ours(memory, trunc, backend=None):
        sampler = sampler_of(trunc)

        def loss(h, w, targets, g):
            return jnp.sum(
                g
                * jk.linear_logprobs(h, w, targets, sampler=sampler, memory=memory, backend=backend)
            )

        return loss

    out = {}
    for name, trunc in TRUNCATIONS.items():
        out[("lean", name)] = ours("lean", trunc)
        out[("fast", name)] = ours("fast", trunc)
        out[("jnp bf16", name)] = (lambda t: lambda h, w, x, g: plain_jnp(h, w, x, g, t))(trunc)
    return out


def rel_err(got, ref):
    import jax.numpy as jnp

    ref = jnp.asarray(ref, jnp.float32)
    got = jnp.asarray(got).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def reference(data, trunc):
    """``(logp, d_hidden, d_weight, mean kept-set size)`` by the reference backend, one
    sequence of the batch at a time (its float32 logits, sorted for top-p, take several
    ``[N, V]`` buffers: at 8192×151936 more than the GPU holds at once)."""
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    h, w, targets, g = data
    w32 = w.astype(jnp.float32)

    sampler = sampler_of(trunc)

    @jax.jit
    def run(h, targets, g):
        f = lambda h, w: jk.linear_logprobs(h, w, targets, sampler=sampler, backend="reference")
        logp, vjp = jax.vjp(f, h, w32)
        return logp, *vjp(g)

    logps, dhs, dw = [], [], None
    for i in range(h.shape[0]):
        logp_i, dh_i, dw_i = run(h[i : i + 1].astype(jnp.float32), targets[i : i + 1], g[i : i + 1])
        logps.append(logp_i)
        dhs.append(dh_i)
        dw = dw_i if dw is None else dw + dw_i
    logp, dh = jnp.concatenate(logps), jnp.concatenate(dhs)
    kept = None
    if trunc:
        from jaxrl_kernels.formulas import sampler_math

        rows = jnp.einsum("btd,vd->btv", h[:1, :64].astype(jnp.float32), w32)
        kept = float(
            jnp.mean(
                jnp.sum(
                    sampler_math.kept_mask(
                        rows.reshape(-1, rows.shape[-1]), sampler_math.truncation(**trunc)
                    ),
                    axis=-1,
                )
            )
        )
    return logp, dh, dw, kept


def measure(size, runs, rounds, small):
    import jax

    import jaxrl_kernels as jk
    from benchmarks import common

    n, d, v = size
    data = inputs(n, d, v)
    nv_mib = n * v * 2 / 2**20
    refs = {name: reference(data, trunc) for name, trunc in TRUNCATIONS.items()}
    rows, steps = [], []
    for (impl, name), loss in calls().items():
        row = {
            "impl": impl,
            "truncation": name,
            "N": n,
            "D": d,
            "V": v,
            "nv_mib": nv_mib,
            "kept": refs[name][3],
        }
        try:
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*data).compile()
            row["temp_mib"] = step.memory_analysis().temp_size_in_bytes / 2**20
            row["no_nv_buffer"] = row["temp_mib"] < nv_mib
            _, (dh, dw) = step(*data)
            logp = (
                jk.linear_logprobs(
                    data[0], data[1], data[2], sampler=sampler_of(TRUNCATIONS[name]), memory="lean"
                )
                if impl == "lean"
                else None
            )
            want_logp, want_dh, want_dw, _ = refs[name]
            row.update(err_dh=rel_err(dh, want_dh), err_dW=rel_err(dw, want_dw))
            if logp is not None:
                row["err_logp"] = rel_err(logp, want_logp)
            steps.append((row, step))
        except Exception as e:  # noqa: BLE001 - an impl out of memory still leaves its row
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{impl} {name} N={n} D={d} V={v}: {row['error']}", flush=True)
        rows.append(row)
    common.rotated_ms(steps, data, runs=runs, rounds=rounds, warm_seconds=0.0 if small else 0.3)
    base = next(
        (
            row["fwdbwd_ms"]
            for row, _ in steps
            if row["impl"] == "lean" and row["truncation"] == "none"
        ),
        float("nan"),
    )
    for row, _ in steps:
        row["x_plain"] = row["fwdbwd_ms"] / base
    for row in rows:
        print(row, flush=True)
    del data, refs, steps
    if not small:
        jax.clear_caches()
    return rows


def main(argv=None):
    from benchmarks import common

    return common.sized_main(
        argv,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_sampler_logprobs",
        columns=COLUMNS,
        measure=measure,
        rounds=2,
    )


if __name__ == "__main__":
    main()
