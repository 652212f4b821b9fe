"""The PPO and GRPO losses as sums over tokens and sequences (float32; docs/api.md).

The reference (:func:`ppo_loss`) is written token by token: per-sequence sums of
:func:`sequence_summands` give :func:`sequence_terms` (ℓ_b, the sequence TIS log-weight), then
:func:`ppo_per_token` gives each token's loss pg + kl_coef·KL − entropy_coef·entropy and its
metric parts, then :func:`loss_and_metrics` aggregates their per-sequence sums.

A kernel does the forward in one pass over the tokens instead (:func:`forward_summands` ->
per-sequence sums -> :func:`sums_to_token_terms` -> :func:`loss_and_metrics`): the sums of the
policy term are linear in what a token contributes once ℓ_b and the sequence weight are
fixed, so it sums those contributions and applies ℓ_b and the weight per sequence
afterwards. The backward is token-local given the [B] sequence terms (they carry no
gradient): d loss / d per_token_bt = m_bt · ``aggregation_weights``_b, pulled back through
:func:`ppo_per_token`. The per-token formulas are in :mod:`surrogate_math` and
:mod:`kl_math`, the aggregation in :mod:`aggregation_math`; options arrive checked
(``validation``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_kernels.formulas.aggregation_math import aggregate_sequence_sums, masked_row_sums
from jaxrl_kernels.formulas.kl_math import kl_penalty
from jaxrl_kernels.formulas.surrogate_math import (
    LOG_RATIO_CLIP,
    cispo_surrogate,
    clipped_surrogate,
    importance_ratio,
    sequence_ratio,
    tis_weight,
)

RATIO_LEVELS = ("token", "sequence")
TIS_LEVELS = ("token", "sequence")
TIS_LOG_WEIGHT_CLIP = 20.0

_sg = jax.lax.stop_gradient


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
    """The options the PPO / GRPO sums read (``config.PolicyLoss`` is the public,
    checked form; its docstring says what each means)."""

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

    log_ratio: jax.Array | None = None  # ℓ_b (ratio_level="sequence")
    tis_log_weight: jax.Array | None = (
        None  # masked Σ (old - rollout), clipped (tis_level="sequence")
    )


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
        tis_log_weight = _sg(
            jnp.clip(sums["tis_log_weight"], -TIS_LOG_WEIGHT_CLIP, TIS_LOG_WEIGHT_CLIP)
        )
    return SequenceTerms(log_ratio, tis_log_weight)


def _per_row(values, like):
    """[rows] values on every token of their row, shaped like ``like`` [rows, T]; per-token
    values (packed rows: ``segment_math`` spreads each segment's) as they are."""
    if values.ndim == like.ndim:
        return values
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
        log_weight = (
            x.old_logp - x.rollout_logp
            if cfg.tis_level == "token"
            else _per_row(seq.tis_log_weight, x.logp)
        )
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
        out.update(
            pg=pg * weight,
            clipped=clipped.astype(jnp.float32),
            dual_clipped=dual.astype(jnp.float32),
        )
    elif cfg.policy_loss == "cispo":
        out["a_logp"] = weight * a * x.logp
    else:
        out.update(
            a_pos=weight * jnp.maximum(a, 0.0),
            a_neg=weight * jnp.maximum(-a, 0.0),
            n_pos=(a > 0).astype(jnp.float32),
            n_neg=(a < 0).astype(jnp.float32),
        )
    return out


def sums_to_token_terms(sums: dict, cfg: PPOConfig) -> dict:
    """The per-sequence sums of ``token_summands`` from those of ``forward_summands``."""
    seq = sequence_terms(sums, cfg)
    out = {
        k: sums[k]
        for k in ("count", "ratio", "approx_kl", "kl", "entropy", "tis_weight", "tis_masked")
        if k in sums
    }
    if cfg.ratio_level == "token":
        pg, clipped, dual = sums["pg"], sums["clipped"], sums["dual_clipped"]
    elif cfg.policy_loss == "cispo":
        ratio = jnp.exp(seq.log_ratio)
        pg, outside = cispo_surrogate(ratio, sums["a_logp"], 1.0, cfg.clip_low, cfg.clip_high)
        clipped, dual = sums["count"] * outside, jnp.zeros_like(pg)
    else:
        ratio = jnp.exp(seq.log_ratio)
        pos, clip_pos, _ = clipped_surrogate(ratio, 1.0, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        neg, clip_neg, dual_neg = clipped_surrogate(
            ratio, -1.0, cfg.clip_low, cfg.clip_high, cfg.dual_clip
        )
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
    loss = aggregate_sequence_sums(
        sums["loss"], sums["count"], cfg.loss_agg_mode, seq_len, cfg.max_len
    )
    count = jnp.maximum(jnp.sum(sums["count"]), 1.0)
    metrics = {METRIC_NAMES[k]: _sg(jnp.sum(sums[k]) / count) for k in METRIC_NAMES if k in sums}
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
    kl = (
        jnp.zeros_like(pg)
        if x.ref_logp is None
        else kl_penalty(x.logp, x.ref_logp, cfg.kl_estimator)
    )
    sums = masked_row_sums(
        {"loss": pg + cfg.kl_coef * kl, "pg": pg, "kl": kl, "count": jnp.ones_like(pg)}, x.mask
    )
    agg = lambda k: aggregate_sequence_sums(
        sums[k], sums["count"], cfg.loss_agg_mode, pg.shape[-1], cfg.max_len
    )
    return agg("loss"), agg("pg"), agg("kl")
