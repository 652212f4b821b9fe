"""Token-level RL math, written once and shared by every backend.

Everything here is elementwise or a reduction over the last axis, in float32,
so the Pallas kernels call the same functions on tiles that the jnp backends
call on whole arrays.

Softmax statistics per row of ``z = logits / T`` (online, tile by tile):

* ``m``  running max,
* ``s = Σ exp(z - m)``,
* ``a = Σ exp(z - m) · (z - m)`` (only for entropy),

so that ``lse = m + log s`` and ``entropy = log s - a / s`` (no cancellation
even for |z| ~ 1e4).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
AGGREGATION_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
AGGREGATION_ALIASES = {"sequence_mean": "seq_mean_token_mean"}
LOG_RATIO_CLIP = 20.0
KL_LOG_RATIO_CLIP = 20.0


# -- softmax statistics on tiles ---------------------------------------------------------

def online_softmax_init(shape, with_entropy: bool):
    m = jnp.full(shape, -jnp.inf, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return (m, zero, zero) if with_entropy else (m, zero)


def online_softmax_update(stats, z):
    """Fold a tile ``z[..., tile]`` (float32, -inf where masked) into ``stats``."""
    m_old = stats[0]
    m_new = jnp.maximum(m_old, jnp.max(z, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all -inf so far: keep exps at 0
    scale = jnp.exp(m_old - m_safe)
    shifted = z - m_safe[..., None]
    e = jnp.exp(shifted)
    s = stats[1] * scale + jnp.sum(e, axis=-1)
    if len(stats) == 2:
        return (m_new, s)
    # a' = scale·(a + s·(m_old - m_new)); where nothing was seen yet, s = a = 0.
    a_carry = jnp.where(stats[1] > 0, stats[2] + stats[1] * (m_old - m_safe), 0.0)
    a = a_carry * scale + jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1)
    return (m_new, s, a)


def online_softmax_merge(x, y):
    """Combine the statistics of two disjoint column sets (the split-V combine)."""
    m = jnp.maximum(x[0], y[0])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    cx, cy = jnp.exp(x[0] - m_safe), jnp.exp(y[0] - m_safe)
    s = x[1] * cx + y[1] * cy
    if len(x) == 2:
        return (m, s)
    ax = jnp.where(x[1] > 0, x[2] + x[1] * (x[0] - m_safe), 0.0)
    ay = jnp.where(y[1] > 0, y[2] + y[1] * (y[0] - m_safe), 0.0)
    return (m, s, ax * cx + ay * cy)


def online_softmax_finalize(stats):
    """``(lse, entropy or None)`` from the running statistics."""
    log_s = jnp.log(stats[1])
    lse = stats[0] + log_s
    entropy = log_s - stats[2] / stats[1] if len(stats) == 3 else None
    return lse, entropy


def combine_vocab_shards(stats, target_rel, holds_target, axes):
    """Row statistics of the whole vocabulary from those of each device's slice of it.

    ``stats = (m, s[, a])`` over this device's columns, ``target_rel = z_target − m`` where
    ``holds_target`` (this slice holds the target column). Over the mesh ``axes`` (none: one
    slice, returned as is) only these per-row values cross devices:
    ``m* = max m``, ``s* = Σ s·e``, ``a* = Σ e·(a + s·(m − m*))`` with ``e = exp(m − m*)``, and
    the target's ``z_t − m* = target_rel + m − m*`` from the one slice that holds it.
    Returns ``(stats*, target_rel*, holders)``: holders counts the slices that hold the target
    (1 for a target inside [0, V), 0 outside).
    """
    holders = holds_target.astype(jnp.int32)
    if not axes:
        return tuple(stats), jnp.where(holds_target, target_rel, 0.0), holders
    m = stats[0]
    m_all = jax.lax.pmax(m, axes)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    shift = jnp.where(m == -jnp.inf, 0.0, m - m_safe)
    scale = jnp.exp(m - m_safe)
    out = (m_all, jax.lax.psum(stats[1] * scale, axes))
    if len(stats) == 3:
        a = jnp.where(stats[1] > 0, stats[2] + stats[1] * shift, 0.0) * scale
        out += (jax.lax.psum(a, axes),)
    target = jax.lax.psum(jnp.where(holds_target, target_rel + shift, 0.0), axes)
    return out, target, jax.lax.psum(holders, axes)


def finalize_row_stats(stats, target_rel, holders, row_valid):
    """(logp, entropy | None, lse, active) per row from whole-vocabulary statistics.

    ``logp = (z_t − m) − log s`` (exact even where |z| ~ 1e4), ``entropy = log s − a/s``,
    ``lse = m + log s``. ``active`` rows (valid, target inside the vocabulary) are the ones
    with a gradient; invalid rows give 0, out-of-range targets NaN.
    """
    log_s = jnp.log(stats[1])
    entropy = log_s - stats[2] / stats[1] if len(stats) == 3 else None
    in_range = holders == 1
    logp, entropy = finalize_logprob(target_rel, log_s, entropy, in_range, row_valid)
    return logp, entropy, stats[0] + log_s, row_valid & in_range


def logprob_grad_tile(z, lse, entropy, is_target, g_logp, g_entropy, temperature):
    """d loss / d logits on a tile, from per-row cotangents of logp and entropy.

    With p = exp(z - lse):  d logp/d logits = (onehot - p) / T and
    d entropy/d logits = -p · (z - Σ p z) / T = -p · (log p + H) / T.
    ``g_entropy``/``entropy`` may be None (no entropy output).
    """
    logp_all = z - lse[..., None]
    p = jnp.exp(logp_all)
    dz = g_logp[..., None] * (jnp.where(is_target, 1.0, 0.0) - p)
    if g_entropy is not None:
        dz = dz - g_entropy[..., None] * p * jnp.where(p > 0, logp_all + entropy[..., None], 0.0)
    return dz / temperature


def finalize_logprob(target_z, lse, entropy, target_in_range, row_valid):
    """Per-row outputs: 0 on invalid rows, NaN where the target is out of range.

    ``target_z`` and ``lse`` may carry the same shift (e.g. both taken relative
    to the row max, which keeps logp exact when |z| is large).
    """
    nan = jnp.float32(jnp.nan)
    logp = jnp.where(row_valid, jnp.where(target_in_range, target_z - lse, nan), 0.0)
    if entropy is not None:
        entropy = jnp.where(row_valid, jnp.where(target_in_range, entropy, nan), 0.0)
    return logp, entropy


# -- KL, ratios, surrogates ----------------------------------------------------------------

def kl_penalty(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL estimate with d = ref_logp - logp (see SPEC)."""
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "abs":
        return jnp.abs(d)
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = jnp.clip(d, -KL_LOG_RATIO_CLIP, KL_LOG_RATIO_CLIP)
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"estimator: unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def importance_ratio(logp, old_logp):
    """r = exp(clip(logp - old_logp, -20, 20))."""
    return jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


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
    bound = -advantages * dual_clip
    dual = (advantages < 0) & (pg > bound)
    return jnp.where(dual, bound, pg), clipped, dual


def tis_weight(old_logp, rollout_logp, cap):
    """Truncated importance weight min(exp(old - rollout), cap), without gradient."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - rollout_logp), cap))


# -- aggregation -------------------------------------------------------------------------

def canonical_mode(mode: str) -> str:
    mode = AGGREGATION_ALIASES.get(mode, mode)
    if mode not in AGGREGATION_MODES:
        valid = ", ".join(AGGREGATION_MODES + tuple(AGGREGATION_ALIASES))
        raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; valid: {valid}")
    return mode


def aggregate(values, mask, mode: str = "token_mean", max_len=None):
    """Reduce per-token [B, T] values to a scalar under ``mask`` (see SPEC)."""
    mode = canonical_mode(mode)
    values = values.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    masked = mask * values
    if mode == "token_mean":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0)
    seq_sum = jnp.sum(masked, axis=-1)
    if mode == "seq_mean_token_sum":
        return jnp.mean(seq_sum)
    if mode == "seq_mean_token_sum_norm":
        length = values.shape[-1] if max_len is None else max_len
        return jnp.sum(masked) / (values.shape[0] * length)
    count = jnp.sum(mask, axis=-1)
    has_tokens = count > 0
    per_seq = jnp.where(has_tokens, seq_sum / jnp.where(has_tokens, count, 1.0), 0.0)
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)


def masked_mean(values, mask):
    return aggregate(values, mask, "token_mean")


# -- group advantages ----------------------------------------------------------------------

def group_advantages(rewards, segment_ids, num_groups: int, *, normalize_std=True,
                     std_ddof=0, eps=1e-6):
    """adv = r - mean_g (÷ (std_g + eps)); a group of one gets 0."""
    rewards = rewards.astype(jnp.float32)
    ones = jnp.ones_like(rewards)
    count = jax.ops.segment_sum(ones, segment_ids, num_groups)
    mean = jax.ops.segment_sum(rewards, segment_ids, num_groups) / jnp.maximum(count, 1.0)
    centred = rewards - mean[segment_ids]
    if normalize_std:
        sq = jax.ops.segment_sum(centred * centred, segment_ids, num_groups)
        var = sq / jnp.maximum(count - std_ddof, 1.0)
        std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)  # finite grad at 0
        centred = centred / (std[segment_ids] + eps)
    return jnp.where(count[segment_ids] > 1, centred, 0.0)


# -- the PPO loss -----------------------------------------------------------------------

class PPOInputs(NamedTuple):
    """[B, T] float32 arrays (advantages already broadcast); optional ones may be None."""

    logp: jax.Array
    old_logp: jax.Array
    advantages: jax.Array
    mask: jax.Array
    rollout_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    entropy: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token_mean"
    max_len: int | None = None


def ppo_per_token(x: PPOInputs, cfg: PPOConfig):
    """Per-token loss and the per-token quantities the metrics average."""
    ratio = importance_ratio(x.logp, x.old_logp)
    pg, clipped, dual = clipped_surrogate(ratio, x.advantages, cfg.clip_low, cfg.clip_high,
                                          cfg.dual_clip)
    parts = {
        "ratio": ratio,
        "clipped": clipped.astype(jnp.float32),
        "dual_clipped": dual.astype(jnp.float32),
        "approx_kl": kl_penalty(x.logp, x.old_logp, "k3"),
    }
    if x.rollout_logp is not None and cfg.tis_cap is not None:
        weight = tis_weight(x.old_logp, x.rollout_logp, cfg.tis_cap)
        pg = pg * weight
        parts["tis_weight"] = weight
    per_token = pg
    if x.ref_logp is not None:
        kl = kl_penalty(x.logp, x.ref_logp, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        parts["kl"] = kl
    if x.entropy is not None:
        per_token = per_token - cfg.entropy_coef * x.entropy
        parts["entropy"] = x.entropy
    return per_token, parts


METRIC_NAMES = {
    "clipped": "clip_fraction",
    "dual_clipped": "dual_clip_fraction",
    "approx_kl": "approx_kl",
    "ratio": "ratio_mean",
    "kl": "kl",
    "entropy": "entropy",
    "tis_weight": "tis_weight_mean",
}


def ppo_loss(x: PPOInputs, cfg: PPOConfig):
    """(loss, metrics): aggregate(per-token loss); metrics are masked token means."""
    per_token, parts = ppo_per_token(x, cfg)
    loss = aggregate(per_token, x.mask, cfg.loss_agg_mode, cfg.max_len)
    metrics = {METRIC_NAMES[k]: jax.lax.stop_gradient(masked_mean(v, x.mask))
               for k, v in parts.items()}
    return loss, metrics
