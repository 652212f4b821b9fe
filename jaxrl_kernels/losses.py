"""The RL losses: KL penalty, aggregation, group advantages, PPO/GRPO/REINFORCE.

The math lives in :mod:`jaxrl_kernels.rl_math`; this module validates
arguments, shapes them and routes the heavy parts through ``dispatch``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import dispatch, logprob_core, rl_math, sharding
from jaxrl_kernels import validation as check
from jaxrl_kernels.logprobs import check_linear_head, global_vocab, linear_logprobs_rows

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

def kl_penalty(logp, ref_logp, estimator="k3"):
    """Per-token KL estimate between the policy and a reference, d = ref_logp - logp.

    ``"k1"``: -d; ``"abs"``: |d|; ``"k2"``: d²/2; ``"k3"``: exp(d) - d - 1 with d clipped to [-20, 20].
    """
    logp = check.floating("logp", logp)
    ref_logp = check.floating("ref_logp", ref_logp)
    check.shape("ref_logp", ref_logp, logp.shape, "logp.shape")
    check.option("estimator", estimator, rl_math.KL_ESTIMATORS)
    return rl_math.kl_penalty(logp, ref_logp, estimator)


def aggregate(values, mask, mode="token_mean", *, max_len=None):
    """Loss aggregation of per-token [B, T] values under a {0,1} mask (modes: docs/api.md)."""
    values = _per_token("values", values)
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


def group_advantages(rewards, *, group_size=None, group_boundaries=None, normalize_std=True,
                     std_ddof=0, eps=1e-6, backend=None):
    """Group-relative advantages: (r - mean_g) / (std_g + eps); a group of one gets 0.

    rewards: [B]. Groups are consecutive: ``group_size`` (divides B) or
    ``group_boundaries`` ([0, b1, ..., B], strictly increasing).
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
    problem = dispatch.Problem("group_advantages", n_rows=rewards.shape[0])
    choice = dispatch.record("group_advantages",
                             dispatch.select("group_advantages", problem, backend,
                                             strict=strict))
    # Groups may straddle any split of B: every device computes all of them from the [B] rewards.
    rewards = sharding.replicated(rewards.astype(jnp.float32))
    adv = choice.impl(rewards, ids.astype(jnp.int32), groups, normalize_std=bool(normalize_std),
                      std_ddof=int(std_ddof), eps=eps)
    return adv if ok is None else jnp.where(ok, adv, jnp.nan)


def policy_gradient_loss(logp, advantages, mask, *, loss_agg_mode="token_mean", max_len=None):
    """aggregate(-A · logp): REINFORCE, reward-weighted and best-of-N fine-tuning."""
    logp = _per_token("logp", logp)
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


def ppo_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
             rollout_logp=None, tis_cap=None, ref_logp=None, kl_coef=0.0, kl_estimator="k3",
             entropy=None, entropy_coef=0.0, loss_agg_mode="token_mean", max_len=None,
             ratio_level="token", policy_loss="ppo", tis_level="token", tis_mode="truncate",
             backend=None):
    """PPO's clipped-surrogate loss on per-token log-probs [B, T]; returns (loss, metrics).

    r = exp(clip(logp - old_logp, ±20)); pg = max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)),
    dual clip c: where A < 0, pg = min(pg, -A·c); TIS: pg ·= sg(min(exp(old - rollout), tis_cap));
    per-token = pg + kl_coef·KL(logp, ref_logp) - entropy_coef·entropy, aggregated under mask.
    Gradients reach logp and entropy only.

    Variants (docs/api.md "Policy-loss variants"): ``ratio_level="sequence"`` (GSPO) puts
    r = exp(ℓ_b), ℓ_b = clip(masked mean of logp - old_logp over sequence b, ±20), on every
    token of b, with d r / d logp_bt = exp(ℓ_b); ``policy_loss="cispo"``:
    pg = -A·sg(clip(r, 1-clip_low, 1+clip_high))·logp; ``tis_level="sequence"`` uses the
    sequence's clipped masked sum of old - rollout as every token's log-weight;
    ``tis_mode="mask"`` weights 1 where exp(log-weight) <= tis_cap, else 0.
    """
    logp = _per_token("logp", logp)
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
        entropy=_optional_per_token("entropy", entropy, shape))
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


def ratio_kl(policy_logits, ref_logits, actions, old_logp, mask, *, kl_estimator="k3",
             temperature=1.0, backend=None, vocab_axis=None):
    """(ratio, kl) per token from policy and reference logits [B, T, V], in one pass.

    ratio = exp(logp_π - old_logp); kl = kl_penalty(logp_π, logp_ref). Where
    mask == 0: ratio = 1, kl = 0, no gradient. Gradient reaches policy_logits only.
    Inside ``jax.shard_map``, ``vocab_axis`` names the axis splitting the vocabulary.
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


def grpo_loss(policy_logits, ref_logits, actions, old_logp, rewards, mask, *, group_size=None,
              group_boundaries=None, advantages=None, clip_low=0.2, clip_high=0.2,
              dual_clip=None, beta=0.0, kl_estimator="k3", loss_agg_mode="token_mean",
              normalize_std=True, eps=1e-6, temperature=1.0, ratio_level="token",
              policy_loss="ppo", tis_level="token", tis_mode="truncate", rollout_logp=None,
              tis_cap=None, backend=None, vocab_axis=None):
    """GRPO from logits [B, T, V]: returns (loss, policy_loss, kl).

    advantages = group_advantages(rewards) unless given ([B]); per token pg as in
    ppo_loss (every policy-loss variant; rollout correction with ``rollout_logp`` [B, T]
    and ``tis_cap``, an addition beyond our signature), kl = kl_penalty(logp, logp_ref);
    loss = aggregate(pg + β·kl).
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
                     return_entropy, backend, vocab_axis):
    return linear_logprobs_rows(
        hidden, weight, bias, actions, mask != 0, op=op, weight_layout=weight_layout,
        temperature=temperature, return_entropy=return_entropy, backend=backend,
        vocab_axis=vocab_axis)


def linear_ppo_loss(hidden, weight, actions, old_logp, advantages, mask, *, bias=None,
                    weight_layout="vd", temperature=1.0, clip_low=0.2, clip_high=0.2,
                    dual_clip=None, rollout_logp=None, tis_cap=None, ref_logp=None, kl_coef=0.0,
                    kl_estimator="k3", entropy_coef=0.0, loss_agg_mode="token_mean",
                    max_len=None, ratio_level="token", policy_loss="ppo", tis_level="token",
                    tis_mode="truncate", backend=None, vocab_axis=None):
    """ppo_loss on log-probs of a linear LM head, never holding [B, T, V] logits.

    hidden: [B, T, D]; weight [V, D] ("vd") or [D, V] ("dv"). The entropy is
    computed in the same pass when entropy_coef != 0. Returns (loss, metrics). Inside
    ``jax.shard_map``, ``vocab_axis`` names the axis splitting the weight's vocabulary.
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
                                     vocab_axis)
    inputs = rl_math.PPOInputs(
        logp=logp, old_logp=old_logp, advantages=_advantages(advantages, shape), mask=mask,
        rollout_logp=_sg(_optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(_optional_per_token("ref_logp", ref_logp, shape)), entropy=entropy)
    return _run_ppo("linear_ppo_loss", inputs, cfg, backend, strict=False)


def linear_grpo_loss(hidden, weight, actions, old_logp, rewards, mask, *, bias=None,
                     weight_layout="vd", ref_logp=None, group_size=None, group_boundaries=None,
                     advantages=None, clip_low=0.2, clip_high=0.2, dual_clip=None, beta=0.0,
                     kl_estimator="k3", loss_agg_mode="token_mean", normalize_std=True, eps=1e-6,
                     temperature=1.0, ratio_level="token", policy_loss="ppo", tis_level="token",
                     tis_mode="truncate", rollout_logp=None, tis_cap=None, backend=None,
                     vocab_axis=None):
    """grpo_loss on log-probs of a linear LM head; ref_logp [B, T] precomputed.

    ref_logp=None means no reference: kl = 0, and beta must be 0 (else ValueError).
    ``rollout_logp`` / ``tis_cap`` as in grpo_loss. Returns (loss, policy_loss, kl); never
    holds [B, T, V] logits. Inside ``jax.shard_map``, ``vocab_axis`` names the axis splitting
    the weight's vocabulary.
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
                               weight_layout, temperature, False, backend, vocab_axis)
    return _grpo_from_logprobs(logp, ref_logp, old_logp, adv, mask, rollout_logp, cfg)
