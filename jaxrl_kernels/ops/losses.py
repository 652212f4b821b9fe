"""The RL losses on per-token log-probs: KL penalty, aggregation, group advantages, policy
gradient and PPO.

The math lives in :mod:`kl_math`, :mod:`aggregation_math`, :mod:`surrogate_math` and
:mod:`ppo_math`; the losses' options in :class:`jaxrl_kernels.config.PolicyLoss`. This module
validates arguments (once, here, with :mod:`jaxrl_kernels.validation`), shapes them and routes
the heavy parts through ``dispatch``. The same losses from logits are in
:mod:`logits_losses`, from a linear head's hidden states in :mod:`linear_losses`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_kernels import sharding
from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.config.policy import (
    ADVANTAGE_GROUPS,
    PG_UNUSED,
    Groups,
    PolicyLoss,
    policy_options,
)
from jaxrl_kernels.formulas import kl_math, ppo_math, segment_math
from jaxrl_kernels.ops import segments
from jaxrl_kernels.ops.policy_terms import compute_group_advantages, kernel_config, run_ppo

_sg = jax.lax.stop_gradient


# -- the small pieces ----------------------------------------------------------------------


def kl_penalty(logp: ArrayLike, ref_logp: ArrayLike, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(policy ‖ reference) from the sampled tokens' log-probs.

    With ``d = ref_logp - logp``: ``"k1"``: ``-d``; ``"abs"``: ``|d|``; ``"k2"``: ``d²/2``;
    ``"k3"``: ``exp(d) - d - 1`` with ``d`` clipped to ``[-20, 20]``. Gradients flow to both.

    Args:
      logp: the policy's log-probs, any shape, float.
      ref_logp: the reference policy's, same shape.
      estimator: ``"k1"``, ``"abs"``, ``"k2"`` or ``"k3"``.

    Returns:
      float32, the shape of ``logp``.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> kl = jk.kl_penalty(jnp.array([-1.0, -2.0]), jnp.array([-1.0, -1.0]))  # k3
      >>> [round(float(x), 3) for x in kl]
      [0.0, 0.718]
    """
    logp = check.floating("logp", logp)
    ref_logp = check.floating("ref_logp", ref_logp)
    check.shape("ref_logp", ref_logp, logp.shape, "logp.shape")
    check.option("estimator", estimator, kl_math.KL_ESTIMATORS)
    logp, ref_logp = sharding.pin_grad_shardings(logp, ref_logp)
    return kl_math.kl_penalty(logp, ref_logp, estimator)


def aggregate(
    values: ArrayLike,
    mask: ArrayLike,
    mode: str = "token_mean",
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    max_len: int | None = None,
) -> jax.Array:
    """Reduce per-token values ``[B, T]`` under a {0, 1} mask to a scalar (a loss aggregation).

    Args:
      values: ``[B, T]`` float.
      mask: ``[B, T]`` bool, float or integer, values 0 or 1.
      mode: ``"token_mean"`` (``Σ m·x / max(Σ m, 1)``), ``"seq_mean_token_mean"`` (alias
        ``"sequence_mean"``: the mean over non-empty sequences of each one's masked mean),
        ``"seq_mean_token_sum"`` (the mean over sequences of masked sums) or
        ``"seq_mean_token_sum_norm"`` (``Σ m·x / (B · max_len)``).
      segment_ids: ``[B, T]`` integers in ``[-1, S)``, or ``None``: packed rows, sequence
        ``s`` being the positions whose id is ``s`` (``-1``: in no sequence, masked); the
        modes then read "sequence" as segment (docs/api.md, "Packed sequences").
      num_segments: S, a static int; required with ``segment_ids``.
      max_len: for ``"seq_mean_token_sum_norm"``; ``None`` means ``T`` (required with
        ``segment_ids``).

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> values, mask = jnp.array([[1.0, 3.0], [5.0, 7.0]]), jnp.array([[1, 1], [1, 0]])
      >>> float(jk.aggregate(values, mask)), float(jk.aggregate(values, mask, "seq_mean_token_mean"))
      (3.0, 3.5)
    """
    (values,) = sharding.pin_grad_shardings(check.per_token("values", values))
    mask = check.token_mask(mask, values.shape)
    mode, max_len = check.agg_mode(mode), check.max_len(max_len)
    pack = segments.packing(segment_ids, num_segments, values.shape)
    max_len = segments.max_len(mode, max_len, pack, "max_len")
    return segment_math.aggregate(values, segments.mask(mask, pack), pack, mode, max_len)


def group_advantages(
    rewards: ArrayLike,
    *,
    groups: Groups | None = None,
    backend: str | None = None,
    **deprecated: Any,
) -> jax.Array:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)``; a group of one gets 0.

    Args:
      rewards: ``[B]``, one per sequence; groups are consecutive sequences.
      groups: a ``jk.Groups``: ``size`` (a positive int dividing ``B``) or ``boundaries``
        (``[G + 1]`` integers ``[0, b1, ..., B]``, strictly increasing), ``normalize_std``
        (divide by ``std_g + eps``; ``False`` gives ``r - mean_g``), ``std_ddof`` and ``eps``.
      backend: ``None`` (automatic) or a backend name.
      **deprecated: ``group_size``, ``group_boundaries``, ``normalize_std``, ``std_ddof``,
        ``eps`` (use ``groups=``), until 0.3.

    Returns:
      float32 ``[B]``. Invalid traced ``boundaries`` give NaN (or raise in check mode).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> jk.group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]),
      ...                     groups=jk.Groups(size=2, normalize_std=False))
      Array([ 0.5, -0.5,  0. ,  0. ], dtype=float32)
    """
    groups = legacy.take(
        "group_advantages",
        deprecated,
        {"groups": groups},
        (ADVANTAGE_GROUPS,),
    )["groups"]
    return compute_group_advantages(rewards, groups, backend=backend, strict=True)


def policy_gradient_loss(
    logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    config: PolicyLoss | None = None,
    **deprecated: Any,
) -> jax.Array:
    """``aggregate(-A · logp, mask)``: REINFORCE, reward-weighted and best-of-N fine-tuning.

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained.
      advantages: ``[B, T]``, or ``[B]`` broadcast over ``T`` (``[S]`` over each sequence's
        tokens with ``segment_ids``); no gradient flows to them.
      mask: ``[B, T]``, 1 on the tokens that count (the response), 0 elsewhere.
      segment_ids: ``[B, T]`` packed rows' segment ids, as in ``aggregate``, or ``None``.
      num_segments: S (static); optional where ``advantages`` is ``[S]``.
      config: a ``jk.PolicyLoss``; its ``loss_agg_mode`` and ``max_len`` (as in
        ``aggregate``) apply, its other attributes must be at their defaults.
      **deprecated: ``loss_agg_mode``, ``max_len`` (use ``config=``), until 0.3.

    Returns:
      A float32 scalar loss.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logp = jnp.log(jnp.array([[0.5, 0.25], [0.5, 0.5]]))
      >>> round(float(jk.policy_gradient_loss(logp, jnp.array([1.0, 0.0]), jnp.ones((2, 2)))), 4)
      0.5199
    """
    options = policy_options("policy_gradient_loss", config, deprecated, unused=PG_UNUSED)["config"]
    (logp,) = sharding.pin_grad_shardings(check.per_token("logp", logp))
    shape = logp.shape
    pack = segments.packing(segment_ids, num_segments, shape, {"advantages": advantages})
    per_token = -segments.token_advantages(advantages, shape, pack) * logp.astype(jnp.float32)
    mask, mode = check.token_mask(mask, shape), check.agg_mode(options.loss_agg_mode)
    max_len = segments.max_len(mode, options.max_len, pack)
    return segment_math.aggregate(per_token, segments.mask(mask, pack), pack, mode, max_len)


# -- PPO -----------------------------------------------------------------------------------


def ppo_loss(
    logp: ArrayLike,
    old_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    rollout_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    entropy: ArrayLike | None = None,
    config: PolicyLoss | None = None,
    backend: str | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped-surrogate loss on per-token log-probs ``[B, T]``.

    The options are ``config``'s (a ``jk.PolicyLoss``; its defaults without one):
    ``r = exp(clip(logp - old_logp, ±20))``;
    ``pg = max(-A·r, -A·clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c``,
    where ``A < 0``: ``pg = min(pg, -A·c)``; with ``rollout_logp`` and ``tis_cap``:
    ``pg ·= sg(min(exp(old_logp - rollout_logp), tis_cap))``; per token
    ``pg + kl_coef·KL(logp, ref_logp) - entropy_coef·entropy``, aggregated under ``mask``.
    Gradients reach ``logp`` and ``entropy`` only. The variants (``ratio_level="sequence"``
    for GSPO, ``policy_loss="cispo"``, ``tis_level`` / ``tis_mode``) are in docs/api.md,
    "Policy-loss variants"; the named recipes in docs/recipes.md.

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained.
      old_logp: ``[B, T]``, the same under the policy that sampled them (no gradient).
      advantages: ``[B, T]`` (e.g. from a critic) or ``[B]`` broadcast over ``T`` (``[S]``
        with ``segment_ids``).
      mask: ``[B, T]``, 1 on response tokens, 0 on prompt and padding.
      segment_ids: ``[B, T]`` packed rows' segment ids, as in ``aggregate``, or ``None``:
        the sequence options (sequence aggregation, ``ratio_level="sequence"``,
        ``tis_level="sequence"``) then take each segment as a sequence.
      num_segments: S (static); optional where ``advantages`` is ``[S]``.
      rollout_logp: the sampler's log-probs ``[B, T]`` (with ``config.tis_cap``, and only
        with it).
      ref_logp: a reference policy's log-probs ``[B, T]`` for the KL penalty (required when
        ``config.kl_coef != 0``).
      entropy: ``[B, T]``, for the entropy bonus (required when
        ``config.entropy_coef != 0``).
      config: a ``jk.PolicyLoss``: clip range, dual clip, TIS cap, KL and entropy weights,
        aggregation and the variants (``None``: its defaults).
      backend: ``None`` (automatic), ``"reference"`` or ``"pallas"``.
      **deprecated: the ``PolicyLoss`` attributes as keywords (``clip_high=``, ...; use
        ``config=``), until 0.3.

    Returns:
      ``(loss, metrics)``: a float32 scalar and a dict of float32 scalars
      (``clip_fraction``, ``dual_clip_fraction``, ``approx_kl``, ``ratio_mean``, and
      ``kl`` / ``entropy`` / ``tis_weight_mean`` / ``tis_mask_fraction`` when they apply).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logp = jnp.log(jnp.full((2, 3), 0.5))
      >>> loss, metrics = jk.ppo_loss(logp, logp, jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
      >>> float(loss), float(metrics["ratio_mean"])
      (0.0, 1.0)
    """
    options = policy_options("ppo_loss", config, deprecated)["config"]
    cfg = kernel_config(
        options,
        has_rollout=rollout_logp is not None,
        has_ref=ref_logp is not None,
        has_entropy=entropy is not None,
    )
    (logp,) = sharding.pin_grad_shardings(check.per_token("logp", logp))
    shape = logp.shape
    pack = segments.packing(segment_ids, num_segments, shape, {"advantages": advantages})
    segments.max_len(cfg.loss_agg_mode, cfg.max_len, pack)
    inputs = ppo_math.PPOInputs(
        logp=logp.astype(jnp.float32),
        old_logp=_sg(check.per_token("old_logp", old_logp, shape).astype(jnp.float32)),
        advantages=segments.token_advantages(advantages, shape, pack),
        mask=segments.mask(check.token_mask(mask, shape), pack),
        rollout_logp=_sg(check.optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(check.optional_per_token("ref_logp", ref_logp, shape)),
        entropy=sharding.pin_grad_shardings(check.optional_per_token("entropy", entropy, shape))[0],
    )
    return run_ppo("ppo_loss", inputs, cfg, backend=backend, strict=True, packing=pack)
