"""The policy term of one token: importance ratios, clipped surrogates, rollout correction.

Elementwise, in float32, on tiles (Pallas) and whole arrays (jnp) alike (docs/api.md states
each formula):

* ratio r = exp(clip(logp − old_logp, −20, 20)); GSPO's sequence ratio exp(ℓ_b);
* PPO: pg = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)), with dual clip c where A < 0:
  min(pg, −A·c);
* CISPO: pg = −A · sg(clip(r, 1 − clip_low, 1 + clip_high)) · logp;
* truncated importance sampling: the weight min(exp(w), cap), or the mask [exp(w) ≤ cap].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

POLICY_LOSSES = ("ppo", "cispo")
TIS_MODES = ("truncate", "mask")
LOG_RATIO_CLIP = 20.0

_sg = jax.lax.stop_gradient


def importance_ratio(logp, old_logp):
    """r = exp(clip(logp - old_logp, -20, 20))."""
    return jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def sequence_ratio(logp, seq_log_ratio):
    """GSPO's ratio on every token of a sequence: r = sg(exp(ℓ_b)) · exp(logp - sg(logp)).

    ``seq_log_ratio`` is ℓ_b per row ([rows]), or per token (packed rows: each token's
    sequence's); the value is exp(ℓ_b) on each token and its derivative with respect to
    logp_bt is exp(ℓ_b).
    """
    scale = jnp.exp(_sg(seq_log_ratio))
    if scale.ndim < logp.ndim:
        scale = scale[:, None]
    return scale * jnp.exp(logp - _sg(logp))


def clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip=None):
    """PPO's pessimistic surrogate per token.

    pg = max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)); with dual clip c,
    where A < 0: pg = min(pg, -A·c). Returns (pg, clipped, dual_clipped) where
    the last two mark the tokens whose clipped / dual-clipped branch was taken.
    """
    unclipped = -advantages * ratio
    clipped_term = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_term > unclipped
    pg = jnp.where(clipped, clipped_term, unclipped)  # a tie takes the unclipped branch
    if dual_clip is None:
        return pg, clipped, jnp.zeros_like(clipped)
    bound = _sharded_like(jnp.broadcast_to(-advantages * dual_clip, pg.shape), pg)
    dual = (advantages < 0) & (pg > bound)
    return jnp.where(dual, bound, pg), clipped, dual


def _sharded_like(x, like):
    """``x`` sharded as ``like`` is, where mesh axes are Explicit (a no-op elsewhere): the two
    branches of a select must be sharded alike, and replicated advantages against row-split
    log-probs are not."""
    want = jax.typeof(like).sharding
    mesh = getattr(want, "mesh", None)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if (
        mesh is None
        or mesh.empty
        or explicit not in getattr(mesh, "axis_types", ())
        or jax.typeof(x).sharding == want
    ):
        return x
    return jax.reshard(x, want)


def cispo_surrogate(ratio, advantages, logp, clip_low, clip_high):
    """CISPO: pg = -A · sg(clip(r, 1-clip_low, 1+clip_high)) · logp.

    Every token keeps the gradient -A·clip(r). Returns (pg, outside), ``outside``
    marking the tokens whose r lies outside [1-clip_low, 1+clip_high].
    """
    low, high = 1.0 - clip_low, 1.0 + clip_high
    weight = _sg(jnp.clip(ratio, low, high))
    outside = (ratio < low) | (ratio > high)
    return -advantages * weight * logp, outside


def tis_weight(log_weight, cap, mode: str = "truncate"):
    """Rollout-correction weight from a log-weight, without gradient.

    ``"truncate"``: min(exp(w), cap); ``"mask"``: 1 where exp(w) <= cap, else 0
    (NaN stays NaN).
    """
    w = jnp.exp(log_weight)
    if mode == "truncate":
        return _sg(jnp.minimum(w, cap))
    return _sg(jnp.where(w > cap, 0.0, jnp.where(w <= cap, 1.0, jnp.nan)))
