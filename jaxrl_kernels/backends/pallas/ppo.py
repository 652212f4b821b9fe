"""The Pallas ops ``ppo_loss`` over [B, T] and ``group_advantages`` (their kernels and launch
plan: ``ppo_kernels.py``).

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

``group_advantages``: ``ppo_kernels.group_advantages_call``, one program per group, scanning
the rewards :data:`GROUP_BLOCK` at a time. Its gradient (rarely wanted) is the reference's,
from ``jax.vjp`` of ``aggregation_math.group_advantages`` on the [B] rewards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_kernels.backends.pallas import ppo_kernels as kernels
from jaxrl_kernels.formulas import aggregation_math, ppo_math


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


def ppo_loss(
    ppo_inputs: ppo_math.PPOInputs,
    config: ppo_math.PPOConfig,
    *,
    plan: kernels.PPOLaunch | None = None,
):
    """Primitive ``ppo_loss``: ``(loss, metrics)`` as ``ppo_math.ppo_loss`` defines them."""
    fields = ppo_inputs._asdict()
    if config.tis_cap is None:
        fields["rollout_logp"] = None  # unused without a cap, as in ppo_math
    tokens = {n: jnp.asarray(v, jnp.float32) for n, v in fields.items() if v is not None}
    batch, seq_len = tokens["logp"].shape
    if batch * seq_len == 0:  # no token: no kernel to launch; ppo_math defines the empty values
        return ppo_math.ppo_loss(ppo_inputs, config)
    loss, metrics = _ppo_loss(tokens, config, plan)  # plan None: the heuristic per device
    return loss, {k: lax.stop_gradient(v) for k, v in metrics.items()}


# -- group_advantages -----------------------------------------------------------------------

GROUP_BLOCK = 1024
"""Rewards scanned per step by a group's program."""


def _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    block = min(pl.next_power_of_2(rewards.shape[0]), GROUP_BLOCK)
    return kernels.group_advantages_call(
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


OPS = {"ppo_loss": ppo_loss, "group_advantages": group_advantages}
