"""The Pallas ops ``ppo_loss`` over [B, T], ``segment_ppo_loss`` (packed rows) and
``group_advantages`` (their kernels and launch plan: ``ppo_kernels.py``, ``group_kernels.py``).

``ppo_loss`` runs as small stages, kernels that map [B, T] tokens to per-sequence values
with plain jnp in between, so that no kernel holds state that crosses sequences or
T-ranges (a device holding part of T runs the same kernels on its part; the per-sequence
sums are what crosses):

1. ``ppo_kernels.forward_sums`` (kernel): per sequence, the masked sums Σ_t m·v of
   ``ppo_math.forward_summands`` over the tokens of the input.
2. jnp: ``ppo_math.sums_to_token_terms`` applies ℓ_b and the sequence TIS weight per
   sequence; ``ppo_math.loss_and_metrics`` aggregates (all four modes) and takes the
   masked-mean metrics. ``ppo_math.sequence_terms`` gives the [B] terms the backward uses.
3. ``ppo_kernels.token_grads`` (kernel, the backward): given per-sequence coefficients
   c_b = g · ``aggregation_math.aggregation_weights``_b (jnp) and the [B] sequence terms, each
   token's d logp (and d entropy) is the pull-back of c_b·m through
   ``ppo_math.ppo_per_token``. ℓ_b carries no gradient (docs/api.md), so this is token-local.
   Nothing flows to old/rollout/ref log-probs, advantages or the mask.

``segment_ppo_loss`` (packed rows: sequence s is the tokens with segment id s, several per
row, ``segment_math``) runs the same stages with the per-sequence sums taken per segment. A
row-summing kernel cannot give those (a row holds several sequences, in any order), so:

1. ``ppo_kernels.token_summands`` (kernel): the same masked summands m·v, written per token
   ([B, T] each, K of them: the memory of K float32 copies of the tokens, the price of
   keeping the kernel token-local).
2. jnp: ``segment_math.segment_sums`` adds them per segment ([S]: the padded layout's [B]
   sums with the S sequences as rows); then ``ppo_math`` as above, with ``max_len`` the
   length of ``seq_mean_token_sum_norm`` as in ``segment_math.ppo_loss`` (the ops require it
   there).
3. ``ppo_kernels.token_grads`` (kernel) with c_s = g · ``aggregation_weights``_s (of the [S]
   counts) and the [S] sequence terms on every token of their segment
   (``segment_math.spread``, 0 off every segment, where m = 0 anyway). Per token the
   derivative is the one of stage 3 above, since the terms carry no gradient.

``group_advantages``: ``group_kernels.group_advantages_call``, one program per group, scanning
the rewards :data:`GROUP_BLOCK` at a time. Its gradient (rarely wanted) is the reference's,
from ``jax.vjp`` of ``aggregation_math.group_advantages`` on the [B] rewards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_kernels.backends.pallas import group_kernels
from jaxrl_kernels.backends.pallas import ppo_kernels as kernels
from jaxrl_kernels.formulas import aggregation_math, ppo_math, segment_math


def declines(primitive: str, problem) -> str | None:
    return None


# -- the primitive -------------------------------------------------------------------------------


def _forward(tokens: dict, cfg, plan: kernels.PPOLaunch):
    sums = kernels.forward_sums(tokens, cfg, plan)
    loss, metrics = ppo_math.loss_and_metrics(
        ppo_math.sums_to_token_terms(sums, cfg), cfg, tokens["logp"].shape[1]
    )
    return loss, metrics, (ppo_math.sequence_terms(sums, cfg), sums["count"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ppo_loss(tokens, cfg, plan):
    loss, metrics, _ = _forward(tokens, cfg, plan)
    return loss, metrics


def _ppo_loss_fwd(tokens, cfg, plan):
    loss, metrics, residuals = _forward(tokens, cfg, plan)
    return (loss, metrics), (tokens, residuals)


def _ppo_loss_bwd(cfg, plan, res, cot):
    tokens, (seq, counts) = res
    seq_len = tokens["logp"].shape[1]
    coef = cot[0] * aggregation_math.aggregation_weights(
        counts, cfg.loss_agg_mode, seq_len, cfg.max_len
    )
    grads = dict(zip(("logp", "entropy"), kernels.token_grads(tokens, seq, coef, cfg, plan)))
    return ({n: grads.get(n) for n in tokens},)


_ppo_loss.defvjp(_ppo_loss_fwd, _ppo_loss_bwd)


def _as_tokens(ppo_inputs: ppo_math.PPOInputs, config: ppo_math.PPOConfig) -> dict:
    """The kernels' float32 [B, T] inputs, by name (the absent ones left out)."""
    fields = ppo_inputs._asdict()
    if config.tis_cap is None:
        fields["rollout_logp"] = None  # unused without a cap, as in ppo_math
    return {n: jnp.asarray(v, jnp.float32) for n, v in fields.items() if v is not None}


def ppo_loss(
    ppo_inputs: ppo_math.PPOInputs,
    config: ppo_math.PPOConfig,
    *,
    plan: kernels.PPOLaunch | None = None,
):
    """Primitive ``ppo_loss``: ``(loss, metrics)`` as ``ppo_math.ppo_loss`` defines them."""
    tokens = _as_tokens(ppo_inputs, config)
    batch, seq_len = tokens["logp"].shape
    if batch * seq_len == 0:  # no token: no kernel to launch; ppo_math defines the empty values
        return ppo_math.ppo_loss(ppo_inputs, config)
    loss, metrics = _ppo_loss(tokens, config, plan)  # plan None: the heuristic per device
    return loss, {k: lax.stop_gradient(v) for k, v in metrics.items()}


# -- the primitive on packed rows --------------------------------------------------------------


def _segment_forward(tokens: dict, packing: segment_math.Packing, cfg, plan):
    summands = kernels.token_summands(tokens, cfg, plan)
    sums = segment_math.segment_sums(summands, packing)  # [S] each
    loss, metrics = ppo_math.loss_and_metrics(
        ppo_math.sums_to_token_terms(sums, cfg), cfg, cfg.max_len
    )
    return loss, metrics, (ppo_math.sequence_terms(sums, cfg), sums["count"])


# The ids are an (integer) operand, without a cotangent; S is static, as the shapes are.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _segment_ppo_loss(tokens, ids, count, cfg, plan):
    loss, metrics, _ = _segment_forward(tokens, segment_math.Packing(ids, count), cfg, plan)
    return loss, metrics


def _segment_ppo_loss_fwd(tokens, ids, count, cfg, plan):
    loss, metrics, residuals = _segment_forward(tokens, segment_math.Packing(ids, count), cfg, plan)
    return (loss, metrics), (tokens, ids, residuals)


def _segment_ppo_loss_bwd(count, cfg, plan, res, cot):
    tokens, ids, (seq, counts) = res
    packing = segment_math.Packing(ids, count)
    like = tokens["logp"]
    coef = cot[0] * aggregation_math.aggregation_weights(
        counts, cfg.loss_agg_mode, cfg.max_len, cfg.max_len
    )
    on_tokens = lambda v: None if v is None else segment_math.spread(v, packing, like)
    seq = ppo_math.SequenceTerms(*(on_tokens(v) for v in seq))
    grads = kernels.token_grads(tokens, seq, on_tokens(coef), cfg, plan)
    grads = dict(zip(("logp", "entropy"), grads))
    return {n: grads.get(n) for n in tokens}, None


_segment_ppo_loss.defvjp(_segment_ppo_loss_fwd, _segment_ppo_loss_bwd)


def segment_ppo_loss(
    ppo_inputs: ppo_math.PPOInputs,
    config: ppo_math.PPOConfig,
    packing: segment_math.Packing,
    *,
    plan: kernels.PPOLaunch | None = None,
):
    """Primitive ``segment_ppo_loss``: ``(loss, metrics)`` as ``segment_math.ppo_loss``
    defines them (sequences = segments; the mask already 0 off every segment)."""
    tokens = _as_tokens(ppo_inputs, config)
    batch, seq_len = tokens["logp"].shape
    if batch * seq_len == 0 or packing.count == 0:  # nothing to launch on: the reference's
        return segment_math.ppo_loss(ppo_inputs, config, packing)
    ids = jnp.asarray(packing.ids, jnp.int32)
    loss, metrics = _segment_ppo_loss(tokens, ids, int(packing.count), config, plan)
    return loss, {k: lax.stop_gradient(v) for k, v in metrics.items()}


# -- group_advantages -----------------------------------------------------------------------

GROUP_BLOCK = 1024
"""Rewards scanned per step by a group's program."""


def _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    block = min(pl.next_power_of_2(rewards.shape[0]), GROUP_BLOCK)
    return group_kernels.group_advantages_call(
        rewards, segment_ids, num_groups, normalize_std, std_ddof, eps, block
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _group_advantages(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    return _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps)


def _group_fwd(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    adv = _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps)
    return adv, (rewards, segment_ids)


def _group_bwd(num_groups, normalize_std, std_ddof, eps, res, g):
    rewards, segment_ids = res
    _, pull = jax.vjp(
        lambda r: aggregation_math.group_advantages(
            r, segment_ids, num_groups, normalize_std=normalize_std, std_ddof=std_ddof, eps=eps
        ),
        rewards,
    )
    return pull(g)[0], None


_group_advantages.defvjp(_group_fwd, _group_bwd)


def group_advantages(rewards, segment_ids, num_groups, *, normalize_std=True, std_ddof=0, eps=1e-6):
    """Primitive ``group_advantages``: adv[B] (segment ids in ``[0, num_groups)``)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape[0] == 0 or num_groups == 0:
        return jnp.zeros(rewards.shape, jnp.float32)
    return _group_advantages(
        rewards,
        jnp.asarray(segment_ids, jnp.int32),
        int(num_groups),
        bool(normalize_std),
        int(std_ddof),
        float(eps),
    )


OPS = {
    "ppo_loss": ppo_loss,
    "segment_ppo_loss": segment_ppo_loss,
    "group_advantages": group_advantages,
}
