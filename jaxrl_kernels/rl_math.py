"""Token-level RL math, written once and shared by every backend.

Everything here is elementwise or a reduction over the last axis, in float32, so the Pallas
kernels call the same functions on tiles that the jnp backends call on whole arrays: the KL
estimators, importance ratios and clipped surrogates (PPO, dual clip, CISPO, truncated
importance sampling), the loss aggregations, group advantages, and the PPO/GRPO loss as sums
over tokens and sequences (docs/api.md states each formula). Options arrive checked
(``validation``); the softmax statistics of the log-probs are in :mod:`softmax_math`.
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
RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("ppo", "cispo")
TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask")
LOG_RATIO_CLIP = 20.0
KL_LOG_RATIO_CLIP = 20.0
TIS_LOG_WEIGHT_CLIP = 20.0


# -- KL, ratios, surrogates ----------------------------------------------------------------

_sg = jax.lax.stop_gradient


def kl_penalty(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL estimate with d = ref_logp - logp (see docs/api.md)."""
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "abs":
        return jnp.abs(d)
    if estimator == "k2":
        return 0.5 * d * d
    assert estimator == "k3", estimator  # one of KL_ESTIMATORS, checked at the public op
    d = jnp.clip(d, -KL_LOG_RATIO_CLIP, KL_LOG_RATIO_CLIP)
    return jnp.exp(d) - d - 1.0


def importance_ratio(logp, old_logp):
    """r = exp(clip(logp - old_logp, -20, 20))."""
    return jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))


def sequence_ratio(logp, seq_log_ratio):
    """GSPO's ratio on every token of a sequence: r = sg(exp(ℓ_b)) · exp(logp - sg(logp)).

    ``seq_log_ratio`` is ℓ_b per row ([rows]); the value is exp(ℓ_b) on each token
    and its derivative with respect to logp_bt is exp(ℓ_b).
    """
    return jnp.exp(_sg(seq_log_ratio))[:, None] * jnp.exp(logp - _sg(logp))


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
    if (mesh is None or mesh.empty or explicit not in getattr(mesh, "axis_types", ())
            or jax.typeof(x).sharding == want):
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


# -- aggregation -------------------------------------------------------------------------

def masked_row_sums(values: dict, mask) -> dict:
    """Σ_t m·v per sequence ([B, T] -> [B]) for each entry of ``values``."""
    mask = mask.astype(jnp.float32)
    return {k: jnp.sum(mask * v.astype(jnp.float32), axis=-1) for k, v in values.items()}


def aggregate_sequence_sums(seq_sum, seq_count, mode: str, seq_len: int, max_len=None):
    """The aggregation of docs/api.md from per-sequence Σ_t m·x ([B]) and Σ_t m ([B]).

    ``"token_mean"``: Σ_b seq_sum / max(Σ_b seq_count, 1);
    ``"seq_mean_token_mean"``: mean of seq_sum / seq_count over sequences with a
    valid token (0 if none); ``"seq_mean_token_sum"``: Σ_b seq_sum / B;
    ``"seq_mean_token_sum_norm"``: Σ_b seq_sum / (B · max_len), max_len = T by default.
    ``mode`` is one of :data:`AGGREGATION_MODES` (``validation.agg_mode`` resolves aliases).
    """
    batch = seq_sum.shape[0]
    if mode == "token_mean":
        return jnp.sum(seq_sum) / jnp.maximum(jnp.sum(seq_count), 1.0)
    if mode == "seq_mean_token_sum":
        return jnp.sum(seq_sum) / batch
    if mode == "seq_mean_token_sum_norm":
        length = seq_len if max_len is None else max_len
        return jnp.sum(seq_sum) / (batch * length)
    has_tokens = seq_count > 0
    per_seq = jnp.where(has_tokens, seq_sum / jnp.where(has_tokens, seq_count, 1.0), 0.0)
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)


def aggregation_weights(seq_count, mode: str, seq_len: int, max_len=None):
    """w [B] with aggregate(x) = Σ_b w_b · Σ_t m·x_bt: the derivative of the aggregation
    with respect to each valid token's value, one per sequence."""
    batch = seq_count.shape[0]
    if mode == "token_mean":
        return jnp.broadcast_to(1.0 / jnp.maximum(jnp.sum(seq_count), 1.0), (batch,))
    if mode == "seq_mean_token_sum":
        return jnp.full((batch,), 1.0 / batch, jnp.float32)
    if mode == "seq_mean_token_sum_norm":
        length = seq_len if max_len is None else max_len
        return jnp.full((batch,), 1.0 / (batch * length), jnp.float32)
    has_tokens = seq_count > 0
    per_seq = jnp.where(has_tokens, 1.0 / jnp.where(has_tokens, seq_count, 1.0), 0.0)
    return per_seq / jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)


def aggregate(values, mask, mode: str = "token_mean", max_len=None):
    """Reduce per-token [B, T] values to a scalar under ``mask`` (see docs/api.md)."""
    sums = masked_row_sums({"x": values, "count": jnp.ones_like(values)}, mask)
    return aggregate_sequence_sums(sums["x"], sums["count"], mode, values.shape[-1], max_len)


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
#
# The reference (``ppo_loss``) is written token by token: per-sequence sums of
# ``sequence_summands`` give ``sequence_terms`` (ℓ_b, the sequence TIS log-weight), then
# ``ppo_per_token`` gives each token's loss and metric parts, then ``loss_and_metrics``
# aggregates their per-sequence sums.
#
# A kernel does the forward in one pass over the tokens instead (``forward_summands`` ->
# per-sequence sums -> ``sums_to_token_terms`` -> ``loss_and_metrics``): the sums of the
# policy term are linear in what a token contributes once ℓ_b and the sequence weight are
# fixed, so it sums those contributions and applies ℓ_b and the weight per sequence
# afterwards. The backward is token-local given the [B] sequence terms (they carry no
# gradient): d loss / d per_token_bt = m_bt · ``aggregation_weights``_b, pulled back through
# ``ppo_per_token``.

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
    ratio_level: str = "token"
    policy_loss: str = "ppo"
    tis_level: str = "token"
    tis_mode: str = "truncate"


class SequenceTerms(NamedTuple):
    """Per-sequence values ([B], or [rows] of a tile) that every token of the sequence uses;
    None where the options do not need them. Neither carries a gradient."""

    log_ratio: jax.Array | None = None        # ℓ_b (ratio_level="sequence")
    tis_log_weight: jax.Array | None = None   # masked Σ (old - rollout), clipped (tis_level="sequence")


def tis_enabled(x: PPOInputs, cfg: PPOConfig) -> bool:
    """Rollout correction applies when both rollout_logp and tis_cap are given."""
    return x.rollout_logp is not None and cfg.tis_cap is not None


def sequence_summands(x: PPOInputs, cfg: PPOConfig) -> dict:
    """Per-token values whose masked sums over a sequence ``sequence_terms`` needs
    (empty for token-level options)."""
    out = {}
    if cfg.ratio_level == "sequence":
        out["count"] = jnp.ones_like(x.logp)
        out["log_ratio"] = x.logp - x.old_logp
    if cfg.tis_level == "sequence" and tis_enabled(x, cfg):
        out["tis_log_weight"] = x.old_logp - x.rollout_logp
    return out


def sequence_terms(sums: dict, cfg: PPOConfig) -> SequenceTerms:
    """From the per-sequence sums of ``sequence_summands``:

    ℓ_b = clip(Σ_t m·(logp - old_logp) / max(Σ_t m, 1), -20, 20) and
    the TIS log-weight clip(Σ_t m·(old_logp - rollout_logp), -20, 20).
    """
    log_ratio = tis_log_weight = None
    if "log_ratio" in sums:
        mean = sums["log_ratio"] / jnp.maximum(sums["count"], 1.0)
        log_ratio = _sg(jnp.clip(mean, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
    if "tis_log_weight" in sums:
        tis_log_weight = _sg(jnp.clip(sums["tis_log_weight"], -TIS_LOG_WEIGHT_CLIP,
                                      TIS_LOG_WEIGHT_CLIP))
    return SequenceTerms(log_ratio, tis_log_weight)


def _per_row(values, like):
    """[rows] values on every token of their row, shaped like ``like`` [rows, T]."""
    return jnp.broadcast_to(values[:, None], like.shape)


def _surrogate(ratio, x: PPOInputs, cfg: PPOConfig):
    """(pg, clipped, dual_clipped) of the chosen policy loss, before rollout correction."""
    if cfg.policy_loss == "cispo":
        pg, clipped = cispo_surrogate(ratio, x.advantages, x.logp, cfg.clip_low, cfg.clip_high)
        return pg, clipped, jnp.zeros_like(clipped)
    return clipped_surrogate(ratio, x.advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)


def _tis_parts(weight, cfg: PPOConfig) -> dict:
    parts = {"tis_weight": weight}
    if cfg.tis_mode == "mask":
        parts["tis_masked"] = (weight == 0).astype(jnp.float32)
    return parts


def policy_surrogate(x: PPOInputs, cfg: PPOConfig, seq: SequenceTerms = SequenceTerms()):
    """The policy term pg per token and the per-token quantities its metrics average.

    r is the token ratio exp(clip(logp - old_logp, ±20)) or, with ratio_level
    "sequence", :func:`sequence_ratio`; pg is PPO's clipped surrogate of r or CISPO's;
    with rollout correction, pg ·= the stop-gradient weight of :func:`tis_weight` on the
    token's log-weight (old - rollout) or its sequence's.
    """
    token_ratio = importance_ratio(x.logp, x.old_logp)
    ratio = token_ratio if cfg.ratio_level == "token" else sequence_ratio(x.logp, seq.log_ratio)
    pg, clipped, dual = _surrogate(ratio, x, cfg)
    parts = {
        "ratio": token_ratio,
        "clipped": clipped.astype(jnp.float32),
        "dual_clipped": dual.astype(jnp.float32),
        "approx_kl": kl_penalty(x.logp, x.old_logp, "k3"),
    }
    if tis_enabled(x, cfg):
        log_weight = (x.old_logp - x.rollout_logp if cfg.tis_level == "token"
                      else _per_row(seq.tis_log_weight, x.logp))
        weight = tis_weight(log_weight, cfg.tis_cap, cfg.tis_mode)
        pg = pg * weight
        parts.update(_tis_parts(weight, cfg))
    return pg, parts


def _penalties(x: PPOInputs, cfg: PPOConfig):
    """(kl_coef·KL - entropy_coef·entropy or None, their metric parts)."""
    rest, parts = None, {}
    if x.ref_logp is not None:
        parts["kl"] = kl_penalty(x.logp, x.ref_logp, cfg.kl_estimator)
        rest = cfg.kl_coef * parts["kl"]
    if x.entropy is not None:
        parts["entropy"] = x.entropy
        bonus = -cfg.entropy_coef * x.entropy
        rest = bonus if rest is None else rest + bonus
    return rest, parts


def ppo_per_token(x: PPOInputs, cfg: PPOConfig, seq: SequenceTerms = SequenceTerms()):
    """Per-token loss pg + kl_coef·KL - entropy_coef·entropy and the metric parts."""
    pg, parts = policy_surrogate(x, cfg, seq)
    rest, extra = _penalties(x, cfg)
    return (pg if rest is None else pg + rest), {**parts, **extra}


def token_summands(x: PPOInputs, cfg: PPOConfig, seq: SequenceTerms = SequenceTerms()) -> dict:
    """Per-token values whose masked per-sequence sums ``loss_and_metrics`` needs."""
    per_token, parts = ppo_per_token(x, cfg, seq)
    return {"loss": per_token, "count": jnp.ones_like(per_token), **parts}


def forward_summands(x: PPOInputs, cfg: PPOConfig) -> dict:
    """Per-token values whose masked per-sequence sums determine the loss and the metrics
    without knowing the sequence terms first (the one-pass forward of a kernel).

    With the token ratio, pg itself (times a token TIS weight). With the sequence ratio
    every token's pg is a function of ℓ_b scaled by the token's own data: PPO's
    surrogate is positively homogeneous in A, pg_t = w_t·|A_t|·pg(r_b, sign A_t), so the
    sums of w·A⁺, w·A⁻ and the counts of A > 0 and A < 0 suffice; CISPO's is linear in
    A·logp, pg_t = -clip(r_b)·w_t·A_t·logp_t. A sequence TIS weight multiplies the
    whole sequence and is applied to the sums.
    """
    out = {"count": jnp.ones_like(x.logp), **sequence_summands(x, cfg)}
    out["ratio"] = importance_ratio(x.logp, x.old_logp)
    out["approx_kl"] = kl_penalty(x.logp, x.old_logp, "k3")
    rest, parts = _penalties(x, cfg)
    if rest is not None:
        out["rest"] = rest
    out.update(parts)
    weight = 1.0
    if tis_enabled(x, cfg) and cfg.tis_level == "token":
        weight = tis_weight(x.old_logp - x.rollout_logp, cfg.tis_cap, cfg.tis_mode)
        out.update(_tis_parts(weight, cfg))
    a = x.advantages
    if cfg.ratio_level == "token":
        pg, clipped, dual = _surrogate(out["ratio"], x, cfg)
        out.update(pg=pg * weight, clipped=clipped.astype(jnp.float32),
                   dual_clipped=dual.astype(jnp.float32))
    elif cfg.policy_loss == "cispo":
        out["a_logp"] = weight * a * x.logp
    else:
        out.update(a_pos=weight * jnp.maximum(a, 0.0), a_neg=weight * jnp.maximum(-a, 0.0),
                   n_pos=(a > 0).astype(jnp.float32), n_neg=(a < 0).astype(jnp.float32))
    return out


def sums_to_token_terms(sums: dict, cfg: PPOConfig) -> dict:
    """The per-sequence sums of ``token_summands`` from those of ``forward_summands``."""
    seq = sequence_terms(sums, cfg)
    out = {k: sums[k] for k in ("count", "ratio", "approx_kl", "kl", "entropy", "tis_weight",
                                "tis_masked") if k in sums}
    if cfg.ratio_level == "token":
        pg, clipped, dual = sums["pg"], sums["clipped"], sums["dual_clipped"]
    elif cfg.policy_loss == "cispo":
        ratio = jnp.exp(seq.log_ratio)
        pg, outside = cispo_surrogate(ratio, sums["a_logp"], 1.0, cfg.clip_low, cfg.clip_high)
        clipped, dual = sums["count"] * outside, jnp.zeros_like(pg)
    else:
        ratio = jnp.exp(seq.log_ratio)
        pos, clip_pos, _ = clipped_surrogate(ratio, 1.0, cfg.clip_low, cfg.clip_high,
                                             cfg.dual_clip)
        neg, clip_neg, dual_neg = clipped_surrogate(ratio, -1.0, cfg.clip_low, cfg.clip_high,
                                                    cfg.dual_clip)
        pg = sums["a_pos"] * pos + sums["a_neg"] * neg
        clipped = sums["n_pos"] * clip_pos + sums["n_neg"] * clip_neg
        dual = sums["n_neg"] * dual_neg
    if seq.tis_log_weight is not None:
        weight = tis_weight(seq.tis_log_weight, cfg.tis_cap, cfg.tis_mode)
        pg = pg * weight
        out.update({k: sums["count"] * v for k, v in _tis_parts(weight, cfg).items()})
    out["loss"] = pg + sums["rest"] if "rest" in sums else pg
    out["clipped"], out["dual_clipped"] = clipped, dual
    return out


METRIC_NAMES = {
    "clipped": "clip_fraction",
    "dual_clipped": "dual_clip_fraction",
    "approx_kl": "approx_kl",
    "ratio": "ratio_mean",
    "kl": "kl",
    "entropy": "entropy",
    "tis_weight": "tis_weight_mean",
    "tis_masked": "tis_mask_fraction",
}


def loss_and_metrics(sums: dict, cfg: PPOConfig, seq_len: int):
    """(loss, metrics) from the per-sequence sums of ``token_summands`` ([B] each):
    the loss aggregated as ``cfg.loss_agg_mode`` says, each metric a masked token mean."""
    loss = aggregate_sequence_sums(sums["loss"], sums["count"], cfg.loss_agg_mode, seq_len,
                                   cfg.max_len)
    count = jnp.maximum(jnp.sum(sums["count"]), 1.0)
    metrics = {METRIC_NAMES[k]: _sg(jnp.sum(sums[k]) / count) for k in METRIC_NAMES
               if k in sums}
    return loss, metrics


def ppo_loss(x: PPOInputs, cfg: PPOConfig):
    """(loss, metrics) of our ppo_loss, in plain jnp, token by token."""
    seq = sequence_terms(masked_row_sums(sequence_summands(x, cfg), x.mask), cfg)
    sums = masked_row_sums(token_summands(x, cfg, seq), x.mask)
    return loss_and_metrics(sums, cfg, x.logp.shape[-1])


def grpo_loss(x: PPOInputs, cfg: PPOConfig):
    """(loss, policy_loss, kl) of our grpo_loss with β = ``cfg.kl_coef``:
    aggregate(pg + β·kl), aggregate(pg), aggregate(kl); kl = 0 without ref_logp."""
    seq = sequence_terms(masked_row_sums(sequence_summands(x, cfg), x.mask), cfg)
    pg, _ = policy_surrogate(x, cfg, seq)
    kl = (jnp.zeros_like(pg) if x.ref_logp is None
          else kl_penalty(x.logp, x.ref_logp, cfg.kl_estimator))
    sums = masked_row_sums({"loss": pg + cfg.kl_coef * kl, "pg": pg, "kl": kl,
                            "count": jnp.ones_like(pg)}, x.mask)
    agg = lambda k: aggregate_sequence_sums(sums[k], sums["count"], cfg.loss_agg_mode,
                                            pg.shape[-1], cfg.max_len)
    return agg("loss"), agg("pg"), agg("kl")
