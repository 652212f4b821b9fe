"""A realistic RL batch for the linear head: peaked next-token distributions, sampled actions,
padded completions.

Benchmarks and accuracy grids that draw hidden states and a head at random get rows whose
every probability is about ``1/V`` (entropy ≈ log V ≈ 11.8 nats at V = 131072): nothing like
a language model sampling its own rollouts, whose next-token distributions are peaked (a
causal LM trained on Python sources: held-out entropy median 0.74 nats, 90th percentile 4.8,
top-1 mass median 0.82) and whose batches are padded (completions end at different lengths).
This generator is calibrated to those statistics; it is not a trained model:

* the head ``W`` [V, D]: rows of unit norm in random directions (every column a real token,
  none trivially skippable);
* each position's hidden state ``h = κ₁·W[a] + κ₂·W[b] + s·ξ`` (``ξ ~ N(0, I_D)``): a
  background of logits ``z_v ≈ s·N(0, 1)`` (the tail's log-mass is about ``log V + s²/2``),
  the intended token ``a`` ``δ₁`` nats above that tail and, on 40 % of the rows, a second
  token ``b`` below ``a``; rows are confident (55 %, δ₁ ~ N(4.5, 1.5²), s ~ U(1, 2.5)),
  hesitant (30 %, N(1.5, 1.5²), the same s) or open (15 %, N(−1, 1.5²), s ~ U(3.5, 4.5)),
  :data:`MIXTURE`. The intended
  tokens follow a Zipf law (exponent 1.1) over a random ranking of the vocabulary;
* the actions are sampled from ``softmax(h·Wᵀ)`` as a sampler draws a rollout;
* padding: ``B`` completions of at most ``T`` tokens, lengths ``T·Beta(2(1−p), 2p)`` (mean
  ``(1 − p)·T``, many at the cap as truncated rollouts are), each masked from its length on.

:func:`statistics` gives what to report beside a benchmark: per-row entropy quantiles, top-1
mass, entries above 2⁻¹² per row, the padded fraction. The shapes carry over because the
calibration is per row in nats relative to the tail (``log V``): the same generator at
V = 8192 or 151936 gives the same entropy and top-1 profile.

    python -m benchmarks.realistic_batch --n 4096 --d 2048 --v 131072 --padding 0.35
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

MIXTURE = ((0.55, 4.5, 1.5, 1.0, 2.5), (0.30, 1.5, 1.5, 1.0, 2.5), (0.15, -1.0, 1.5, 3.5, 4.5))
"""Per component: (weight, mean and std of δ₁ — the intended token's logit over the tail's
log-mass, in nats —, the range of the background's std ``s``). An open row's broader
background (``s`` 3.5-4.5) puts its tail's mass on a few hundred tokens, not on all V."""
SECOND = 0.4
"""The fraction of rows with a second intended token."""
ZIPF = 1.1


@dataclasses.dataclass(frozen=True)
class Batch:
    hidden: object  # [B, T, D]
    weight: object  # [V, D]
    actions: object  # [B, T] int32
    mask: object  # [B, T] float32, 0 on padding

    def as_tuple(self):
        return self.hidden, self.weight, self.actions, self.mask


def shape_of(n_tokens: int) -> tuple[int, int]:
    """``(B, T)`` of ``n_tokens``: T = 512 tokens per completion where that divides, at least 2
    completions."""
    t = 512 if n_tokens >= 1024 and n_tokens % 512 == 0 else max(1, n_tokens // 2)
    return n_tokens // t, t


def make(n_tokens, d, v, *, padding=0.0, seed=0, dtype="bfloat16", chunk=2048) -> Batch:
    """A realistic batch of ``n_tokens`` positions (the module docstring), on the default
    device. ``chunk``: rows per sampling step (a [chunk, V] float32 buffer)."""
    import jax
    import jax.numpy as jnp

    b, t = shape_of(n_tokens)
    n = b * t
    keys = jax.random.split(jax.random.key(seed), 10)
    w = jax.random.normal(keys[0], (v, d), jnp.float32)
    w = w / jnp.linalg.norm(w, axis=1, keepdims=True)
    ranks = jax.random.permutation(keys[1], v)
    zipf = -ZIPF * jnp.log(jnp.arange(1, v + 1, dtype=jnp.float32))
    a = ranks[jax.random.categorical(keys[2], zipf, shape=(n,))]
    b2 = ranks[jax.random.categorical(keys[3], zipf, shape=(n,))]
    weights = jnp.asarray([m[0] for m in MIXTURE])
    comp = jax.random.categorical(keys[5], jnp.log(weights), shape=(n,))
    means, stds, s_lo, s_hi = (jnp.asarray([m[i] for m in MIXTURE])[comp] for i in (1, 2, 3, 4))
    s = jax.random.uniform(keys[4], (n,), minval=s_lo, maxval=s_hi)
    delta = means + stds * jax.random.normal(keys[6], (n,))
    kappa1 = math.log(v) + s**2 / 2 + delta
    has_second = jax.random.uniform(keys[7], (n,)) < SECOND
    kappa2 = jnp.where(has_second, kappa1 - jnp.abs(2.0 * jax.random.normal(keys[8], (n,))), 0.0)
    xi = jax.random.normal(keys[9], (n, d))
    h = kappa1[:, None] * w[a] + kappa2[:, None] * w[b2] + s[:, None] * xi
    h, w = h.astype(dtype), w.astype(dtype)
    actions = _sample(jax.random.fold_in(keys[0], 1), h, w, chunk)
    mask = padding_mask(jax.random.fold_in(keys[0], 2), b, t, padding)
    return Batch(h.reshape(b, t, d), w, actions.reshape(b, t), mask)


def _sample(key, h, w, chunk):
    """One action per row of ``softmax(h·Wᵀ)`` (float32 logits of the 16-bit operands), in
    blocks of ``chunk`` rows."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def block(k, hb):
        z = jnp.einsum("nd,vd->nv", hb, w, preferred_element_type=jnp.float32)
        return jax.random.categorical(k, z, axis=-1).astype(jnp.int32)

    n = h.shape[0]
    parts = [block(jax.random.fold_in(key, i), h[i : i + chunk]) for i in range(0, n, chunk)]
    return jnp.concatenate(parts)


def padding_mask(key, b, t, padding):
    """[B, T] float32: completion ``i`` covers positions ``[0, L_i)``, ``L_i / T ~ Beta(2(1−p),
    2p)`` (at least 1 token); all ones for ``padding`` 0."""
    import jax
    import jax.numpy as jnp

    if padding <= 0:
        return jnp.ones((b, t), jnp.float32)
    frac = jax.random.beta(key, 2 * (1 - padding), 2 * padding, (b,))
    lengths = jnp.maximum(1, jnp.round(frac * t)).astype(jnp.int32)
    return (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)


def statistics(batch: Batch, rows=512) -> dict:
    """Per-row entropy quantiles (nats), top-1 mass, entries above 2⁻¹², the action's
    log-prob median, over the first ``rows`` unpadded positions; and the padded fraction."""
    import jax.numpy as jnp
    import numpy as np

    keep = np.asarray(batch.mask).reshape(-1) != 0
    idx = np.flatnonzero(keep)[:rows]
    h = batch.hidden.reshape(-1, batch.hidden.shape[-1])[idx]
    z = jnp.einsum("nd,vd->nv", h, batch.weight, preferred_element_type=jnp.float32)
    logp = np.asarray(z - jax_logsumexp(z), np.float64)
    p = np.exp(logp)
    ent = -(p * logp).sum(-1)
    acts = np.asarray(batch.actions).reshape(-1)[idx]
    q = lambda x, qs: {f"p{int(100 * k)}": float(np.quantile(x, k)) for k in qs}
    return dict(
        rows=len(idx),
        entropy=q(ent, (0.1, 0.5, 0.9)),
        top1=q(p.max(-1), (0.1, 0.5, 0.9)),
        above_2m12=q((p > 2.0**-12).sum(-1), (0.1, 0.5, 0.9)),
        action_logp_median=float(np.median(logp[np.arange(len(idx)), acts])),
        padded=float(1 - keep.mean()),
    )


def jax_logsumexp(z):
    import jax

    return jax.nn.logsumexp(z, axis=-1, keepdims=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--v", type=int, default=131072)
    parser.add_argument("--padding", type=float, default=0.35)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch = make(args.n, args.d, args.v, padding=args.padding, seed=args.seed)
    print(json.dumps(dict(vars(args), **statistics(batch)), indent=1))


if __name__ == "__main__":
    main()
