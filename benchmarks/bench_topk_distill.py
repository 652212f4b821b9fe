"""Distillation from a served teacher's top-k: ``linear_topk_distill_loss`` against one id per token.

Question: with K teacher ids per token (K = 64, N×D×V = 4096×2048×151936, bf16), does the
forward+backward of ``linear_topk_distill_loss`` stay within 1.1× of ``linear_logprobs`` at
one id per token, with lean memory (no ``[N, V]`` buffer), and how does it compare with the
plain jnp code in the same run? Each row is ``jax.jit(jax.value_and_grad(loss, (hidden,
weight)))``, compiled once; bf16 hidden ``[B, T, D]`` (B·T = N) and head ``[V, D]``:

- ``logprobs 1 id``: ``jk.linear_logprobs`` at the teacher's first id, ``memory="lean"``,
  backend automatic, summed against a fixed random cotangent ``g ~ U[0.5, 1.5)`` (``Σ g·logp``,
  so that the backward runs): the 1.1× goal's reference, ``x_1id`` = 1;
- ``logprobs K ids``: the same at all K ids (``[B, T, K]`` targets, its own cotangent);
- ``topk lean``: ``jk.linear_topk_distill_loss`` with ``memory="lean"``, ``tail`` "drop" and
  "bucket" (the teacher's and the student's mass outside the ids as one more outcome);
- ``topk fast``: the same with ``memory="fast"`` (the student's logits kept for the
  backward), tail "drop";
- ``jnp bf16``: the plain jnp code: ``einsum`` to bf16 logits, float32
  ``jax.nn.log_softmax``, ``take_along_axis`` at the K ids, the forward KL over them
  (tail "drop", token mean).

The teacher (:func:`teacher`): per token, K distinct random ids and log-probs at them in
decreasing order, a share ``Σ p_t ~ U[0.5, 0.99)`` of its mass (``teacher_mass``: the mean
over tokens), the rest outside the ids. The mask is all ones.

Columns: ``fwdbwd_ms`` the median of ``--runs`` synchronised calls by the host clock after a
warm-up, in ``--rounds`` rounds whose order rotates (the median over rounds); ``x_1id`` its
ratio to the ``logprobs 1 id`` row of the same size; ``temp_mib`` XLA's temp size of the
compiled executable (``memory_analysis``); ``no_nv_buffer`` whether it is below one bf16
``[N, V]`` array (``nv_mib``); ``err_loss``, ``err_dh``, ``err_dW``: relative max-norm errors
``max|got − ref| / max|ref|`` of the loss and of d_hidden, d_weight against a reference of
the same loss computed once on the same (upcast) inputs with the logits materialised, in
float64 on CPU and float32 (``precision="highest"``) elsewhere.

    python -m benchmarks.bench_topk_distill --runs 10       # GPU: --sizes full
    python -m benchmarks.bench_topk_distill --small         # toy sizes, any device, seconds

Sizes ``full``: the goal's shape (4096×2048×151936, K = 64) and 4096×2048×131072 with K in
{1, 8, 64}. Results: ``bench_topk_distill.{json,md}`` (``--name``) in out/bench (``--out``,
``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

COLUMNS = [
    "impl",
    "tail",
    "N",
    "D",
    "V",
    "K",
    "fwdbwd_ms",
    "x_1id",
    "temp_mib",
    "nv_mib",
    "no_nv_buffer",
    "teacher_mass",
    "loss",
    "err_loss",
    "err_dh",
    "err_dW",
    "error",
]
SIZES = {  # (N, D, V, K)
    "full": [(4096, 2048, 151936, 64)] + [(4096, 2048, 131072, k) for k in (1, 8, 64)],
    "small": [(64, 32, 1000, 8)],
}
TEACHER_STD = 2.0  # std of the teacher's logits at its K ids
BASE = "logprobs 1 id"


def inputs(n, d, v, k, seed=0):
    """bf16 hidden [B, T, D] ~ N(0, 1) (B = 2 sequences per 1024 tokens, at least 2), head
    [V, D] ~ N(0, 2²/D), the teacher's ids [B, T, K] and log-probs (:func:`teacher`), the
    mask, and the cotangents [B, T] and [B, T, K] ~ U[0.5, 1.5) of the log-prob rows; drawn
    on the host (no compile), float32 draws rounded to bf16 on the device."""
    import jax.numpy as jnp
    import numpy as np

    b = max(2, 2 * (n // 1024))
    t = n // b
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((b, t, d), np.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d), np.float32) * np.float32(2.0 / d**0.5)).astype(
        jnp.bfloat16
    )
    ids, logp = teacher(rng, b * t, v, k)
    g1 = rng.uniform(0.5, 1.5, (b, t)).astype(np.float32)
    gk = rng.uniform(0.5, 1.5, (b, t, k)).astype(np.float32)
    return (
        h,
        w,
        jnp.asarray(ids.reshape(b, t, k)),
        jnp.asarray(logp.reshape(b, t, k)),
        jnp.ones((b, t), jnp.float32),
        jnp.asarray(g1),
        jnp.asarray(gk),
    )


def teacher(rng, rows, v, k):
    """Per row, K distinct ids (uniform, redrawn where a row repeats one) and a teacher's
    log-probs at them in decreasing order: ``log m + log_softmax(TEACHER_STD · z)``,
    ``z ~ N(0, 1)``, with the mass ``m = Σ p_t ~ U[0.5, 0.99)`` (the rest of the teacher's
    distribution lies outside the ids)."""
    import numpy as np

    ids = rng.integers(0, v, (rows, k))
    while True:
        ordered = np.sort(ids, axis=1)
        again = np.any(ordered[:, 1:] == ordered[:, :-1], axis=1)
        if not again.any():
            break
        ids[again] = rng.integers(0, v, (int(again.sum()), k))
    z = -np.sort(-TEACHER_STD * rng.standard_normal((rows, k)), axis=1)
    z -= z.max(axis=1, keepdims=True)
    log_sm = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    mass = rng.uniform(0.5, 0.99, (rows, 1))
    return ids.astype(np.int32), (np.log(mass) + log_sm).astype(np.float32)


def losses():
    """``{impl: (tail, reference kind, loss(h, w, ids, t_logp, mask, g1, gk))}``."""
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    def one_id(h, w, ids, t_logp, mask, g1, gk):
        return jnp.sum(jk.linear_logprobs(h, w, ids[..., 0], memory="lean") * g1)

    def k_ids(h, w, ids, t_logp, mask, g1, gk):
        return jnp.sum(jk.linear_logprobs(h, w, ids, memory="lean") * gk)

    def topk(tail, memory):
        config = jk.TopKDistillLoss(tail=tail)

        def loss(h, w, ids, t_logp, mask, g1, gk):
            return jk.linear_topk_distill_loss(
                h, w, ids, t_logp, mask, config=config, memory=memory
            )[0]

        return loss

    def plain(h, w, ids, t_logp, mask, g1, gk):
        logits = jnp.einsum("btd,vd->btv", h, w)  # bf16
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        student = jnp.take_along_axis(logp, ids, axis=-1)
        d = jnp.sum(jnp.exp(t_logp) * (t_logp - student), axis=-1)
        return jnp.sum(d * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return {
        BASE: ("", "1 id", one_id),
        "logprobs K ids": ("", "K ids", k_ids),
        "topk lean": ("drop", "drop", topk("drop", "lean")),
        "topk lean bucket": ("bucket", "bucket", topk("bucket", "lean")),
        "topk fast": ("drop", "drop", topk("drop", "fast")),
        "jnp bf16": ("drop", "drop", plain),
    }


def reference(data):
    """``{kind: (loss, d_hidden, d_weight)}`` of every loss of :func:`losses`, with the
    logits materialised from the upcast inputs: float64 on CPU (x64 enabled inside), float32
    at the highest matmul precision elsewhere; the results stay in that dtype."""
    import jax
    import jax.numpy as jnp

    h, w, ids, t_logp, mask, g1, gk = data
    wide = jax.default_backend() == "cpu"

    def logp_at(hh, ww, at):
        z = jnp.einsum("btd,vd->btv", hh, ww, precision=jax.lax.Precision.HIGHEST)
        return jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), at, axis=-1)

    def kl(tail):
        def loss(hh, ww, tl, m, at, g1, gk):
            s = logp_at(hh, ww, at)
            p = jnp.exp(tl)
            d = jnp.sum(p * (tl - s), axis=-1)
            if tail == "bucket":
                r_t, r_s = 1.0 - jnp.sum(p, -1), 1.0 - jnp.sum(jnp.exp(s), -1)
                log_r_t = jnp.log(jnp.where(r_t > 0, r_t, 1.0))
                d = d + jnp.where(r_t > 0, r_t * (log_r_t - jnp.log(r_s)), 0.0)
            return jnp.sum(d * m) / jnp.maximum(jnp.sum(m), 1.0)

        return loss

    kinds = {
        "1 id": lambda hh, ww, tl, m, at, g1, gk: jnp.sum(
            logp_at(hh, ww, at[..., :1])[..., 0] * g1
        ),
        "K ids": lambda hh, ww, tl, m, at, g1, gk: jnp.sum(logp_at(hh, ww, at) * gk),
        "drop": kl("drop"),
        "bucket": kl("bucket"),
    }

    @jax.jit
    def all_kinds(*args):
        return {
            kind: (lambda value, grads: (value, *grads))(
                *jax.value_and_grad(loss, argnums=(0, 1))(*args)
            )
            for kind, loss in kinds.items()
        }

    with jax.enable_x64(wide):
        dtype = jnp.float64 if wide else jnp.float32
        hh, ww, tl, m, c1, ck = (x.astype(dtype) for x in (h, w, t_logp, mask, g1, gk))
        return jax.block_until_ready(all_kinds(hh, ww, tl, m, ids, c1, ck))


def rel_err(got, ref):
    """``max|got − ref| / max|ref|``, in the reference's dtype."""
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(ref.dtype == jnp.float64):
        got = jnp.asarray(got).astype(ref.dtype)
        return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def measure(size, runs, rounds, small):
    """The rows of one size (N, D, V, K)."""
    import jax

    from benchmarks import common

    n, d, v, k = size
    data = inputs(n, d, v, k)
    ref = reference(data)
    teacher_mass = float(jax.numpy.mean(jax.numpy.sum(jax.numpy.exp(data[3]), -1)))
    nv_mib = n * v * 2 / 2**20
    rows, steps = [], []
    for impl, (tail, kind, loss) in losses().items():
        row = {
            "impl": impl,
            "tail": tail,
            "N": n,
            "D": d,
            "V": v,
            "K": k,
            "nv_mib": nv_mib,
            "teacher_mass": teacher_mass,
        }
        try:
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*data).compile()
            row["temp_mib"] = step.memory_analysis().temp_size_in_bytes / 2**20
            row["no_nv_buffer"] = row["temp_mib"] < nv_mib
            value, (dh, dw) = step(*data)
            want, want_dh, want_dw = ref[kind]
            row.update(
                loss=float(value),
                err_loss=rel_err(value, want),
                err_dh=rel_err(dh, want_dh),
                err_dW=rel_err(dw, want_dw),
            )
            steps.append((row, step))
        except Exception as e:  # noqa: BLE001 - an impl out of memory still leaves its row
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{impl} N={n} D={d} V={v} K={k}: {row['error']}", flush=True)
        rows.append(row)
    common.rotated_ms(steps, data, runs=runs, rounds=rounds, warm_seconds=0.0 if small else 0.3)
    base = next((row["fwdbwd_ms"] for row, _ in steps if row["impl"] == BASE), float("nan"))
    for row, _ in steps:
        row["x_1id"] = row["fwdbwd_ms"] / base
    for row in rows:
        print(row, flush=True)
    del data, ref, steps
    if not small:
        jax.clear_caches()  # the executables of this size leave the device
    return rows


def main(argv=None):
    from benchmarks import common

    return common.sized_main(
        argv,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_topk_distill",
        columns=COLUMNS,
        measure=measure,
        rounds=3,
    )


if __name__ == "__main__":
    main()
