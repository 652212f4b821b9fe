"""The RL losses: KL penalty, aggregation, group advantages, PPO/GRPO/REINFORCE.

The math lives in :mod:`jaxrl_kernels.rl_math`; this module validates
arguments, shapes them and routes the heavy parts through ``dispatch``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxrl_kernels import dispatch, logprob_core, rl_math, sharding
from jaxrl_kernels import validation as check
from jaxrl_kernels.logprobs import (AxisName, check_linear_head, global_vocab,
                                    linear_logprobs_rows)

_sg = jax.lax.stop_gradient


# -- validation shared by the losses -------------------------------------------------------

def _per_token(name, x, shape=None):
    x = check.floating(name, x)
    if shape is None:
        check.rank(name, x, 2, "[B, T]")
    else:
        check.shape(name, x, shape, "[B, T]")
    return x


def _optional_per_token(name, x, shape):
    return None if x is None else _per_token(name, x, shape).astype(jnp.float32)


def _mask(mask, shape):
    mask = check.mask("mask", mask)
    check.shape("mask", mask, shape, "[B, T]")
    return mask.astype(jnp.float32)


def _advantages(advantages, shape):
    advantages = check.floating("advantages", advantages)
    if advantages.shape == shape[:1]:
        advantages = jnp.broadcast_to(advantages[:, None], shape)
    elif advantages.shape != shape:
        raise ValueError(f"advantages: expected shape {shape} or {shape[:1]} ([B, T] or [B]), "
                         f"got {tuple(advantages.shape)}")
    return _sg(advantages.astype(jnp.float32))


def _max_len(max_len):
    if max_len is not None and (not isinstance(max_len, (int, np.integer)) or max_len <= 0):
        raise ValueError(f"max_len: expected a positive int or None, got {max_len!r}")
    return max_len


def _agg_mode(mode):
    return check.option("loss_agg_mode", mode,
                        rl_math.AGGREGATION_MODES + tuple(rl_math.AGGREGATION_ALIASES))


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
    check.option("estimator", estimator, rl_math.KL_ESTIMATORS)
    logp, ref_logp = sharding.pin_grad_shardings(logp, ref_logp)
    return rl_math.kl_penalty(logp, ref_logp, estimator)


def aggregate(values: ArrayLike, mask: ArrayLike, mode: str = "token_mean", *,
              max_len: int | None = None) -> jax.Array:
    """Reduce per-token values ``[B, T]`` under a {0, 1} mask to a scalar (a loss aggregation).

    Args:
      values: ``[B, T]`` float.
      mask: ``[B, T]`` bool, float or integer, values 0 or 1.
      mode: ``"token_mean"`` (``Σ m·x / max(Σ m, 1)``), ``"seq_mean_token_mean"`` (alias
        ``"sequence_mean"``: the mean over non-empty sequences of each one's masked mean),
        ``"seq_mean_token_sum"`` (the mean over sequences of masked sums) or
        ``"seq_mean_token_sum_norm"`` (``Σ m·x / (B · max_len)``).
      max_len: for ``"seq_mean_token_sum_norm"``; ``None`` means ``T``.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> values, mask = jnp.array([[1.0, 3.0], [5.0, 7.0]]), jnp.array([[1, 1], [1, 0]])
      >>> float(jk.aggregate(values, mask)), float(jk.aggregate(values, mask, "seq_mean_token_mean"))
      (3.0, 3.5)
    """
    (values,) = sharding.pin_grad_shardings(_per_token("values", values))
    mask = _mask(mask, values.shape)
    return rl_math.aggregate(values, mask, _agg_mode(mode), _max_len(max_len))


def _segments(batch, group_size, group_boundaries):
    """(segment_ids [B], number of groups, validity flag for traced boundaries)."""
    if (group_size is None) == (group_boundaries is None):
        raise ValueError("group_size / group_boundaries: give exactly one of them")
    if group_size is not None:
        if not isinstance(group_size, (int, np.integer)) or group_size <= 0 or batch % group_size:
            raise ValueError(f"group_size: expected a positive int dividing B = {batch}, "
                             f"got {group_size!r}")
        return jnp.arange(batch) // group_size, batch // int(group_size), None
    bounds = check.integer("group_boundaries", group_boundaries)
    check.rank("group_boundaries", bounds, 1, "[G + 1]")
    if bounds.shape[0] < 2:
        raise ValueError(f"group_boundaries: expected at least 2 entries [0, ..., B], "
                         f"got shape {tuple(bounds.shape)}")
    ok = (bounds[0] == 0) & (bounds[-1] == batch) & jnp.all(jnp.diff(bounds) > 0)
    if check.is_concrete(bounds):
        if not bool(ok):
            raise ValueError(f"group_boundaries: expected strictly increasing values starting at "
                             f"0 and ending at B = {batch}, got {np.asarray(bounds).tolist()}")
        ok = None
    else:
        check.boundaries("group_boundaries", bounds, batch)  # check mode only
    ids = jnp.searchsorted(bounds[1:], jnp.arange(batch), side="right")
    return ids, bounds.shape[0] - 1, ok


def group_advantages(rewards: ArrayLike, *, group_size: int | None = None,
                     group_boundaries: ArrayLike | None = None, normalize_std: bool = True,
                     std_ddof: int = 0, eps: float = 1e-6, backend: str | None = None
                     ) -> jax.Array:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)``; a group of one gets 0.

    Args:
      rewards: ``[B]``, one per sequence; groups are consecutive sequences.
      group_size: a positive int dividing ``B`` (give this or ``group_boundaries``).
      group_boundaries: ``[G + 1]`` integers ``[0, b1, ..., B]``, strictly increasing.
      normalize_std: divide by ``std_g + eps``; ``False`` gives ``r - mean_g``.
      std_ddof: the standard deviation's delta degrees of freedom.
      eps: added to the standard deviation.
      backend: ``None`` (automatic) or a backend name.

    Returns:
      float32 ``[B]``. Invalid traced ``group_boundaries`` give NaN (or raise in check mode).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> jk.group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), group_size=2, normalize_std=False)
      Array([ 0.5, -0.5,  0. ,  0. ], dtype=float32)
    """
    return _group_advantages(rewards, group_size, group_boundaries, normalize_std, std_ddof, eps,
                             backend, strict=True)


def _group_advantages(rewards, group_size, group_boundaries, normalize_std, std_ddof, eps,
                      backend, strict):
    rewards = check.as_array("rewards", rewards)
    if not (jnp.issubdtype(rewards.dtype, jnp.floating) or jnp.issubdtype(rewards.dtype, jnp.integer)):
        raise TypeError(f"rewards: expected a real dtype, got {rewards.dtype}")
    check.rank("rewards", rewards, 1, "[B]")
    check.non_negative_int("std_ddof", std_ddof)
    ids, groups, ok = _segments(rewards.shape[0], group_size, group_boundaries)
    (rewards,) = sharding.pin_grad_shardings(rewards)
    problem = dispatch.Problem("group_advantages", n_rows=rewards.shape[0])
    choice = dispatch.record("group_advantages",
                             dispatch.select("group_advantages", problem, backend,
                                             strict=strict))
    # Groups may straddle any split of B: every device computes all of them from the [B] rewards.
    rewards = sharding.replicated(rewards.astype(jnp.float32))
    adv = choice.impl(rewards, ids.astype(jnp.int32), groups, normalize_std=bool(normalize_std),
                      std_ddof=int(std_ddof), eps=eps)
    return adv if ok is None else jnp.where(ok, adv, jnp.nan)


def policy_gradient_loss(logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, *,
                         loss_agg_mode: str = "token_mean", max_len: int | None = None
                         ) -> jax.Array:
    """``aggregate(-A · logp, mask)``: REINFORCE, reward-weighted and best-of-N fine-tuning.

    Args:
      logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained.
      advantages: ``[B, T]``, or ``[B]`` broadcast over ``T``; no gradient flows to them.
      mask: ``[B, T]``, 1 on the tokens that count (the response), 0 elsewhere.
      loss_agg_mode, max_len: as in ``aggregate``.

    Returns:
      A float32 scalar loss.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logp = jnp.log(jnp.array([[0.5, 0.25], [0.5, 0.5]]))
      >>> round(float(jk.policy_gradient_loss(logp, jnp.array([1.0, 0.0]), jnp.ones((2, 2)))), 4)
      0.5199
    """
    (logp,) = sharding.pin_grad_shardings(_per_token("logp", logp))
    shape = logp.shape
    per_token = -_advantages(advantages, shape) * logp.astype(jnp.float32)
    return rl_math.aggregate(per_token, _mask(mask, shape), _agg_mode(loss_agg_mode),
                             _max_len(max_len))


# -- PPO -----------------------------------------------------------------------------------

def _variants(ratio_level, policy_loss, tis_level, tis_mode):
    return dict(ratio_level=ratio_level, policy_loss=policy_loss, tis_level=tis_level,
                tis_mode=tis_mode)


def _policy_options(ratio_level, policy_loss, tis_level, tis_mode, dual_clip):
    """The policy-loss variant options (docs/api.md "Policy-loss variants")."""
    check.option("ratio_level", ratio_level, rl_math.RATIO_LEVELS)
    check.option("policy_loss", policy_loss, rl_math.POLICY_LOSSES)
    check.option("tis_level", tis_level, rl_math.TIS_LEVELS)
    check.option("tis_mode", tis_mode, rl_math.TIS_MODES)
    if policy_loss == "cispo" and dual_clip is not None:
        raise ValueError(f"dual_clip: expected None with policy_loss='cispo' (CISPO has no dual "
                         f"clip), got {dual_clip!r}")
    return dict(ratio_level=ratio_level, policy_loss=policy_loss, tis_level=tis_level,
                tis_mode=tis_mode)


def _tis_options(rollout_logp, tis_cap):
    if (rollout_logp is None) != (tis_cap is None):
        raise ValueError("rollout_logp / tis_cap: truncated importance sampling needs both "
                         f"(got rollout_logp={'set' if rollout_logp is not None else None}, "
                         f"tis_cap={tis_cap!r})")
    if tis_cap is not None:
        check.positive("tis_cap", tis_cap)


def _ppo_config(clip_low, clip_high, dual_clip, rollout_logp, tis_cap, ref_logp, kl_coef,
                kl_estimator, has_entropy, entropy_coef, loss_agg_mode, max_len, variants):
    check.clip_options(clip_low, clip_high, dual_clip)
    _tis_options(rollout_logp, tis_cap)
    check.option("kl_estimator", kl_estimator, rl_math.KL_ESTIMATORS)
    if ref_logp is None and kl_coef != 0:
        raise ValueError(f"ref_logp: required when kl_coef != 0 (kl_coef={kl_coef!r})")
    if not has_entropy and entropy_coef != 0:
        raise ValueError(f"entropy: required when entropy_coef != 0 (entropy_coef={entropy_coef!r})")
    return rl_math.PPOConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                             tis_cap=tis_cap, kl_coef=kl_coef, kl_estimator=kl_estimator,
                             entropy_coef=entropy_coef,
                             loss_agg_mode=rl_math.canonical_mode(_agg_mode(loss_agg_mode)),
                             max_len=_max_len(max_len),
                             **_policy_options(dual_clip=dual_clip, **variants))


def _run_ppo(op, inputs, cfg, backend, strict):
    options = (("ratio_level", cfg.ratio_level), ("policy_loss", cfg.policy_loss),
               ("tis_level", cfg.tis_level), ("tis_mode", cfg.tis_mode))
    problem = dispatch.Problem(op, n_rows=inputs.logp.size, extra=options)
    choice = dispatch.select(op, problem, backend, primitive="ppo_loss", strict=strict)
    return dispatch.record("ppo_loss", choice).impl(inputs, cfg)


def ppo_loss(logp: ArrayLike, old_logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, *,
             clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
             rollout_logp: ArrayLike | None = None, tis_cap: float | None = None,
             ref_logp: ArrayLike | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
             entropy: ArrayLike | None = None, entropy_coef: float = 0.0,
             loss_agg_mode: str = "token_mean", max_len: int | None = None,
             ratio_level: str = "token", policy_loss: str = "ppo", tis_level: str = "token",
             tis_mode: str = "truncate", backend: str | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped-surrogate loss on per-token log-probs ``[B, T]``.

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
      advantages: ``[B, T]`` (e.g. from a critic) or ``[B]`` broadcast over ``T``.
      mask: ``[B, T]``, 1 on response tokens, 0 on prompt and padding.
      clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
      dual_clip: ``c > 1`` or ``None``.
      rollout_logp, tis_cap: the sampler's log-probs ``[B, T]`` and the importance-weight
        cap (give both or neither).
      ref_logp, kl_coef, kl_estimator: a KL penalty to a reference policy's log-probs.
      entropy, entropy_coef: an entropy bonus (``entropy`` ``[B, T]``).
      loss_agg_mode, max_len: as in ``aggregate``.
      ratio_level, policy_loss, tis_level, tis_mode: the variants, see above.
      backend: ``None`` (automatic), ``"reference"`` or ``"pallas"``.

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
    (logp,) = sharding.pin_grad_shardings(_per_token("logp", logp))
    shape = logp.shape
    cfg = _ppo_config(clip_low, clip_high, dual_clip, rollout_logp, tis_cap, ref_logp, kl_coef,
                      kl_estimator, entropy is not None, entropy_coef, loss_agg_mode, max_len,
                      _variants(ratio_level, policy_loss, tis_level, tis_mode))
    inputs = rl_math.PPOInputs(
        logp=logp.astype(jnp.float32),
        old_logp=_sg(_per_token("old_logp", old_logp, shape).astype(jnp.float32)),
        advantages=_advantages(advantages, shape),
        mask=_mask(mask, shape),
        rollout_logp=_sg(_optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(_optional_per_token("ref_logp", ref_logp, shape)),
        entropy=sharding.pin_grad_shardings(_optional_per_token("entropy", entropy, shape))[0])
    return _run_ppo("ppo_loss", inputs, cfg, backend, strict=True)


# -- GRPO and the fused-from-logits ops ----------------------------------------------------

def _logits_inputs(policy_logits, ref_logits, actions, old_logp, mask, vocab_axis=None):
    policy_logits = check.floating("policy_logits", policy_logits)
    check.rank("policy_logits", policy_logits, 3, "[B, T, V]")
    ref_logits = check.floating("ref_logits", ref_logits)
    check.shape("ref_logits", ref_logits, policy_logits.shape, "policy_logits.shape")
    shape = policy_logits.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    old_logp = _per_token("old_logp", old_logp, shape).astype(jnp.float32)
    mask = _mask(mask, shape)
    if policy_logits.shape[-1] == 0:
        raise ValueError("policy_logits: expected a non-empty vocabulary axis, got V = 0")
    vocab = global_vocab(policy_logits.shape[-1], vocab_axis)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    return policy_logits, ref_logits, actions, _sg(old_logp), mask


def _paired_logprobs(op, policy_logits, ref_logits, actions, mask, temperature, backend,
                     vocab_axis):
    batch, steps, vocab = policy_logits.shape
    problem = dispatch.Problem(op, n_rows=batch * steps, vocab=vocab,
                               dtype=dispatch.dtype_name(policy_logits))
    choice = dispatch.record(op, dispatch.select(op, problem, backend))
    logp, ref_logp = logprob_core.paired_logprobs(
        choice.impl, policy_logits, ref_logits, actions.astype(jnp.int32), mask != 0,
        temperature=float(temperature), vocab_axis=vocab_axis,
        record=dispatch.plan_recorder(op))
    return logp, _sg(ref_logp)


def ratio_kl(policy_logits: ArrayLike, ref_logits: ArrayLike, actions: ArrayLike,
             old_logp: ArrayLike, mask: ArrayLike, *, kl_estimator: str = "k3",
             temperature: float = 1.0, backend: str | None = None,
             vocab_axis: AxisName | None = None) -> tuple[jax.Array, jax.Array]:
    """The importance ratio and the KL to a reference, per token, from two logits in one pass.

    ``ratio = exp(logp_policy - old_logp)``, ``kl = kl_penalty(logp_policy, logp_ref)``.
    Where ``mask == 0``: ratio 1, kl 0, no gradient, and the action id is never read. The
    gradient reaches ``policy_logits`` only.

    Args:
      policy_logits: ``[B, T, V]`` float.
      ref_logits: ``[B, T, V]``, the reference model's.
      actions: ``[B, T]`` integer token ids.
      old_logp: ``[B, T]``, log-probs under the sampling policy.
      mask: ``[B, T]``, 1 on response tokens.
      kl_estimator: as in ``kl_penalty``.
      temperature: the log-probs are of ``softmax(logits / temperature)``.
      backend: ``None`` (automatic) or a backend name.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the vocabulary.

    Returns:
      ``(ratio, kl)``, both float32 ``[B, T]``.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits = jnp.zeros((1, 2, 4))
      >>> ratio, kl = jk.ratio_kl(logits, logits, jnp.array([[0, 3]]), jnp.log(jnp.full((1, 2), 0.25)),
      ...                         jnp.ones((1, 2)))
      >>> ratio.round(3), kl
      (Array([[1., 1.]], dtype=float32), Array([[0., 0.]], dtype=float32))
    """
    policy_logits, ref_logits, actions, old_logp, mask = _logits_inputs(
        policy_logits, ref_logits, actions, old_logp, mask, vocab_axis)
    check.option("kl_estimator", kl_estimator, rl_math.KL_ESTIMATORS)
    check.positive("temperature", temperature)
    logp, ref_logp = _paired_logprobs("ratio_kl", policy_logits, ref_logits, actions, mask,
                                      temperature, backend, vocab_axis)
    valid = mask != 0
    ratio = jnp.where(valid, jnp.exp(logp - old_logp), 1.0)
    kl = jnp.where(valid, rl_math.kl_penalty(logp, ref_logp, kl_estimator), 0.0)
    return ratio, kl


def _grpo_advantages(rewards, advantages, batch, group_size, group_boundaries, normalize_std,
                     eps, backend):
    rewards = check.as_array("rewards", rewards)
    check.shape("rewards", rewards, (batch,), "[B]")
    if advantages is not None:
        advantages = check.floating("advantages", advantages)
        check.shape("advantages", advantages, (batch,), "[B]")
        return _sg(advantages.astype(jnp.float32))
    return _sg(_group_advantages(rewards, group_size, group_boundaries, normalize_std, 0, eps,
                                 backend, strict=False))


def _grpo_from_logprobs(logp, ref_logp, old_logp, advantages, mask, rollout_logp, cfg):
    """(loss, policy_loss, kl) = aggregate(pg + β·kl), aggregate(pg), aggregate(kl), with pg
    the per-token policy term of ppo_loss (``rl_math.policy_surrogate``) and β = cfg.kl_coef."""
    inputs = rl_math.PPOInputs(
        logp=logp, old_logp=old_logp,
        advantages=jnp.broadcast_to(advantages[:, None], logp.shape), mask=mask,
        rollout_logp=rollout_logp, ref_logp=ref_logp)
    return rl_math.grpo_loss(inputs, cfg)


def _grpo_config(clip_low, clip_high, dual_clip, beta, kl_estimator, loss_agg_mode,
                 rollout_logp, tis_cap, variants):
    check.clip_options(clip_low, clip_high, dual_clip)
    check.option("kl_estimator", kl_estimator, rl_math.KL_ESTIMATORS)
    _tis_options(rollout_logp, tis_cap)
    return rl_math.PPOConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                             tis_cap=tis_cap, kl_coef=beta, kl_estimator=kl_estimator,
                             loss_agg_mode=rl_math.canonical_mode(_agg_mode(loss_agg_mode)),
                             **_policy_options(dual_clip=dual_clip, **variants))


def grpo_loss(policy_logits: ArrayLike, ref_logits: ArrayLike, actions: ArrayLike,
              old_logp: ArrayLike, rewards: ArrayLike, mask: ArrayLike, *,
              group_size: int | None = None, group_boundaries: ArrayLike | None = None,
              advantages: ArrayLike | None = None, clip_low: float = 0.2, clip_high: float = 0.2,
              dual_clip: float | None = None, beta: float = 0.0, kl_estimator: str = "k3",
              loss_agg_mode: str = "token_mean", normalize_std: bool = True, eps: float = 1e-6,
              temperature: float = 1.0, ratio_level: str = "token", policy_loss: str = "ppo",
              tis_level: str = "token", tis_mode: str = "truncate",
              rollout_logp: ArrayLike | None = None, tis_cap: float | None = None,
              backend: str | None = None, vocab_axis: AxisName | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GRPO from policy and reference logits ``[B, T, V]`` and one reward per sequence.

    ``A = group_advantages(rewards)`` (unless ``advantages`` ``[B]`` is given), broadcast over
    ``T``; per token ``pg`` as in ``ppo_loss`` (every variant, and rollout correction with
    ``rollout_logp`` / ``tis_cap``), ``kl = kl_penalty(logp, logp_ref)``;
    ``loss = aggregate(pg + beta·kl)``. The gradient reaches ``policy_logits`` only.

    Args:
      policy_logits, ref_logits: ``[B, T, V]`` float.
      actions: ``[B, T]`` integer token ids; never read where ``mask == 0``.
      old_logp: ``[B, T]``, log-probs under the sampling policy (no gradient).
      rewards: ``[B]``.
      mask: ``[B, T]``, 1 on response tokens.
      group_size, group_boundaries, normalize_std, eps: the groups, as in
        ``group_advantages``.
      advantages: ``[B]`` to use instead of group advantages.
      clip_low, clip_high, dual_clip, ratio_level, policy_loss, tis_level, tis_mode,
        rollout_logp, tis_cap: as in ``ppo_loss``.
      beta, kl_estimator: the KL term's weight and estimator.
      loss_agg_mode: as in ``aggregate``.
      temperature: the log-probs are of ``softmax(logits / temperature)``.
      backend: ``None`` (automatic) or a backend name.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the vocabulary.

    Returns:
      ``(loss, policy_loss, kl)``: float32 scalars, the last two aggregated like the loss.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits, actions = jnp.zeros((4, 3, 10)), jnp.zeros((4, 3), int)
      >>> old_logp = jk.token_logprobs(logits, actions)
      >>> loss, pg, kl = jk.grpo_loss(logits, logits, actions, old_logp, jnp.array([1., 0, 1, 1]),
      ...                             jnp.ones((4, 3)), group_size=2, beta=0.04)
      >>> round(float(loss), 4), float(kl)
      (0.0, 0.0)
    """
    policy_logits, ref_logits, actions, old_logp, mask = _logits_inputs(
        policy_logits, ref_logits, actions, old_logp, mask, vocab_axis)
    cfg = _grpo_config(clip_low, clip_high, dual_clip, beta, kl_estimator, loss_agg_mode,
                       rollout_logp, tis_cap,
                       _variants(ratio_level, policy_loss, tis_level, tis_mode))
    check.positive("temperature", temperature)
    rollout_logp = _sg(_optional_per_token("rollout_logp", rollout_logp, mask.shape))
    adv = _grpo_advantages(rewards, advantages, policy_logits.shape[0], group_size,
                           group_boundaries, normalize_std, eps, backend)
    logp, ref_logp = _paired_logprobs("grpo_loss", policy_logits, ref_logits, actions, mask,
                                      temperature, backend, vocab_axis)
    return _grpo_from_logprobs(logp, ref_logp, old_logp, adv, mask, rollout_logp, cfg)


# -- fused from hidden states ------------------------------------------------------------

def _linear_inputs(hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis):
    hidden, weight, bias, local_vocab = check_linear_head(hidden, weight, bias, weight_layout)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = hidden.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    old_logp = _sg(_per_token("old_logp", old_logp, shape).astype(jnp.float32))
    mask = _mask(mask, shape)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    return hidden, weight, bias, actions, old_logp, mask


def _linear_logprobs(op, hidden, weight, bias, actions, mask, weight_layout, temperature,
                     return_entropy, backend, vocab_axis, memory):
    return linear_logprobs_rows(
        hidden, weight, bias, actions, mask != 0, op=op, weight_layout=weight_layout,
        temperature=temperature, return_entropy=return_entropy, backend=backend,
        vocab_axis=vocab_axis, memory=memory)


def linear_ppo_loss(hidden: ArrayLike, weight: ArrayLike, actions: ArrayLike,
                    old_logp: ArrayLike, advantages: ArrayLike, mask: ArrayLike, *,
                    bias: ArrayLike | None = None, weight_layout: str = "vd",
                    temperature: float = 1.0, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None, rollout_logp: ArrayLike | None = None,
                    tis_cap: float | None = None, ref_logp: ArrayLike | None = None,
                    kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0,
                    loss_agg_mode: str = "token_mean", max_len: int | None = None,
                    ratio_level: str = "token", policy_loss: str = "ppo",
                    tis_level: str = "token", tis_mode: str = "truncate",
                    backend: str | None = None, vocab_axis: AxisName | None = None,
                    memory: str | int = "lean") -> tuple[jax.Array, dict[str, jax.Array]]:
    """``ppo_loss`` on the log-probs of a linear LM head, never holding ``[B, T, V]`` logits.

    The log-probs are ``linear_logprobs(hidden, weight, actions, bias, ...)``; the entropy
    comes from the same pass when ``entropy_coef != 0``. Gradients reach ``hidden``,
    ``weight`` and ``bias``.

    Args:
      hidden: ``[B, T, D]``: the hidden state at position t predicts ``actions[:, t]``
        (the token after it).
      weight: ``[V, D]`` (``weight_layout="vd"``: a head or tied embedding) or ``[D, V]``
        (``"dv"``: a Flax Dense / ``nnx.Linear`` kernel).
      actions: ``[B, T]`` integer token ids.
      old_logp: ``[B, T]``, log-probs under the sampling policy (no gradient).
      advantages: ``[B, T]`` or ``[B]``.
      mask: ``[B, T]``, 1 on response tokens.
      bias: ``[V]`` or ``None``.
      weight_layout: ``"vd"`` or ``"dv"``.
      temperature: the log-probs are of ``softmax(logits / temperature)``.
      clip_low, clip_high, dual_clip, rollout_logp, tis_cap, ref_logp, kl_coef,
        kl_estimator, entropy_coef, loss_agg_mode, max_len, ratio_level, policy_loss,
        tis_level, tis_mode: as in ``ppo_loss``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      memory: ``"lean"``, ``"fast"`` (the logits kept for the backward: 3 GEMMs instead of
        4) or a byte budget, as in ``linear_logprobs``.

    Returns:
      ``(loss, metrics)`` as in ``ppo_loss`` (``entropy`` among the metrics when
      ``entropy_coef != 0``).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden, embed = jnp.ones((2, 3, 8)), jnp.zeros((50, 8))   # tied embedding [V, D]
      >>> actions = jnp.zeros((2, 3), int)
      >>> old_logp = jk.linear_logprobs(hidden, embed, actions)
      >>> loss, metrics = jk.linear_ppo_loss(hidden, embed, actions, old_logp,
      ...                                    jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
      >>> float(loss), float(metrics["clip_fraction"])
      (0.0, 0.0)
    """
    hidden, weight, bias, actions, old_logp, mask = _linear_inputs(
        hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis)
    shape = mask.shape
    check.positive("temperature", temperature)
    with_entropy = entropy_coef != 0
    cfg = _ppo_config(clip_low, clip_high, dual_clip, rollout_logp, tis_cap, ref_logp, kl_coef,
                      kl_estimator, with_entropy, entropy_coef, loss_agg_mode, max_len,
                      _variants(ratio_level, policy_loss, tis_level, tis_mode))
    logp, entropy = _linear_logprobs("linear_ppo_loss", hidden, weight, bias, actions, mask,
                                     weight_layout, temperature, with_entropy, backend,
                                     vocab_axis, memory)
    inputs = rl_math.PPOInputs(
        logp=logp, old_logp=old_logp, advantages=_advantages(advantages, shape), mask=mask,
        rollout_logp=_sg(_optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(_optional_per_token("ref_logp", ref_logp, shape)), entropy=entropy)
    return _run_ppo("linear_ppo_loss", inputs, cfg, backend, strict=False)


def linear_grpo_loss(hidden: ArrayLike, weight: ArrayLike, actions: ArrayLike,
                     old_logp: ArrayLike, rewards: ArrayLike, mask: ArrayLike, *,
                     bias: ArrayLike | None = None, weight_layout: str = "vd",
                     ref_logp: ArrayLike | None = None, group_size: int | None = None,
                     group_boundaries: ArrayLike | None = None,
                     advantages: ArrayLike | None = None, clip_low: float = 0.2,
                     clip_high: float = 0.2, dual_clip: float | None = None, beta: float = 0.0,
                     kl_estimator: str = "k3", loss_agg_mode: str = "token_mean",
                     normalize_std: bool = True, eps: float = 1e-6, temperature: float = 1.0,
                     ratio_level: str = "token", policy_loss: str = "ppo",
                     tis_level: str = "token", tis_mode: str = "truncate",
                     rollout_logp: ArrayLike | None = None, tis_cap: float | None = None,
                     backend: str | None = None, vocab_axis: AxisName | None = None,
                     memory: str | int = "lean") -> tuple[jax.Array, jax.Array, jax.Array]:
    """``grpo_loss`` on the log-probs of a linear LM head, never holding ``[B, T, V]`` logits.

    The reference policy comes as precomputed log-probs ``ref_logp`` ``[B, T]`` (no
    gradient); ``ref_logp=None`` means no KL term, and then ``beta`` must be 0. Gradients reach
    ``hidden``, ``weight`` and ``bias``.

    Args:
      hidden: ``[B, T, D]``: the hidden state at position t predicts ``actions[:, t]``.
      weight: ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), as in ``linear_logprobs``.
      actions: ``[B, T]`` integer token ids; never read where ``mask == 0``.
      old_logp: ``[B, T]``, log-probs under the sampling policy (no gradient).
      rewards: ``[B]``, one per sequence.
      mask: ``[B, T]``, 1 on response tokens.
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      ref_logp: ``[B, T]`` reference log-probs, or ``None``.
      group_size, group_boundaries, advantages, normalize_std, eps, clip_low, clip_high,
        dual_clip, beta, kl_estimator, loss_agg_mode, ratio_level, policy_loss, tis_level,
        tis_mode, rollout_logp, tis_cap: as in ``grpo_loss``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      memory: ``"lean"``, ``"fast"`` (the logits kept for the backward: 3 GEMMs instead of
        4) or a byte budget, as in ``linear_logprobs``.

    Returns:
      ``(loss, policy_loss, kl)``: float32 scalars.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden, head = jnp.ones((4, 3, 8)), jnp.zeros((8, 50))    # nnx.Linear kernel [D, V]
      >>> actions, mask = jnp.zeros((4, 3), int), jnp.ones((4, 3))
      >>> old_logp = jk.linear_logprobs(hidden, head, actions, weight_layout="dv")
      >>> loss_fn = lambda h, w: jk.linear_grpo_loss(h, w, actions, old_logp, jnp.array(
      ...     [1.0, 0.0, 0.0, 1.0]), mask, weight_layout="dv", group_size=2)[0]
      >>> d_hidden, d_head = jax.grad(loss_fn, argnums=(0, 1))(hidden, head)
      >>> d_hidden.shape, d_head.shape
      ((4, 3, 8), (8, 50))
    """
    hidden, weight, bias, actions, old_logp, mask = _linear_inputs(
        hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis)
    cfg = _grpo_config(clip_low, clip_high, dual_clip, beta, kl_estimator, loss_agg_mode,
                       rollout_logp, tis_cap,
                       _variants(ratio_level, policy_loss, tis_level, tis_mode))
    check.positive("temperature", temperature)
    if ref_logp is None and beta != 0:
        raise ValueError(f"ref_logp: required when beta != 0 (beta={beta!r})")
    ref_logp = _sg(_optional_per_token("ref_logp", ref_logp, mask.shape))
    rollout_logp = _sg(_optional_per_token("rollout_logp", rollout_logp, mask.shape))
    adv = _grpo_advantages(rewards, advantages, hidden.shape[0], group_size, group_boundaries,
                           normalize_std, eps, backend)
    logp, _ = _linear_logprobs("linear_grpo_loss", hidden, weight, bias, actions, mask,
                               weight_layout, temperature, False, backend, vocab_axis, memory)
    return _grpo_from_logprobs(logp, ref_logp, old_logp, adv, mask, rollout_logp, cfg)


def linear_policy_gradient_loss(hidden: ArrayLike, weight: ArrayLike, actions: ArrayLike,
                                advantages: ArrayLike, mask: ArrayLike, *,
                                bias: ArrayLike | None = None, weight_layout: str = "vd",
                                temperature: float = 1.0, loss_agg_mode: str = "token_mean",
                                max_len: int | None = None, backend: str | None = None,
                                vocab_axis: AxisName | None = None,
                                memory: str | int = "lean") -> jax.Array:
    """``policy_gradient_loss`` on the log-probs of a linear LM head: ``aggregate(−A·logp)``.

    REINFORCE, reward-weighted and best-of-N fine-tuning, and plain NLL / SFT with ``A = 1``,
    from the hidden states and the head, never holding ``[B, T, V]`` logits. Gradients reach
    ``hidden``, ``weight`` and ``bias``.

    Args:
      hidden: ``[B, T, D]``: the hidden state at position t predicts ``actions[:, t]``.
      weight: ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), as in ``linear_logprobs``.
      actions: ``[B, T]`` integer token ids in ``[0, V)`` (any id where ``mask == 0``).
      advantages: ``[B, T]`` or ``[B]`` (broadcast over T); no gradient.
      mask: ``[B, T]``, 1 on the tokens that count.
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      loss_agg_mode, max_len: as in ``aggregate``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      memory: ``"lean"``, ``"fast"`` or a byte budget, as in ``linear_logprobs``.

    Returns:
      The float32 scalar loss.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden, embed = jnp.ones((2, 3, 8)), jnp.zeros((50, 8))   # tied embedding [V, D]
      >>> nll = jk.linear_policy_gradient_loss(hidden, embed, jnp.zeros((2, 3), int),
      ...                                      jnp.ones(2), jnp.ones((2, 3)))   # SFT: A = 1
      >>> round(float(nll), 3)                                         # log 50
      3.912
    """
    hidden, weight, bias, local_vocab = check_linear_head(hidden, weight, bias, weight_layout)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = hidden.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    mask = _mask(mask, shape)
    advantages = _advantages(advantages, shape)
    mode = _agg_mode(loss_agg_mode)
    max_len = _max_len(max_len)
    check.positive("temperature", temperature)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    logp, _ = _linear_logprobs("linear_policy_gradient_loss", hidden, weight, bias, actions,
                               mask, weight_layout, temperature, False, backend, vocab_axis,
                               memory)
    return rl_math.aggregate(-advantages * logp, mask, mode, max_len)
