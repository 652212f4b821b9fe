"""The losses computed from logits ``[B, T, V]``: ``ratio_kl`` and ``grpo_loss``.

Both take the policy's and the reference's log-probs of the sampled tokens in one pass over
the two logits streams (the ``paired_logprobs`` primitive), then the math of
:mod:`jaxrl_kernels.ops.losses` (``grpo_loss``'s options in :class:`jaxrl_kernels.config.PolicyLoss`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_kernels import dispatch
from jaxrl_kernels import validation as check
from jaxrl_kernels.config.policy import (
    GRPO_GROUPS,
    GRPO_KEYWORDS,
    Groups,
    PolicyLoss,
    policy_options,
)
from jaxrl_kernels.dispatch.contract import Problem, dtype_name
from jaxrl_kernels.engine import logprob_core
from jaxrl_kernels.engine.linear_head import AxisName
from jaxrl_kernels.formulas import kl_math
from jaxrl_kernels.ops import segments
from jaxrl_kernels.ops.policy_terms import (
    grpo_from_logprobs,
    kernel_config,
    packed_grpo_advantages,
)
from jaxrl_kernels.sharding.entry import global_vocab

_sg = jax.lax.stop_gradient


# -- GRPO and the fused-from-logits ops ----------------------------------------------------


def _logits_inputs(
    policy_logits, ref_logits, actions, old_logp, mask, vocab_axis=None, packing=lambda shape: None
):
    policy_logits = check.floating("policy_logits", policy_logits)
    check.rank("policy_logits", policy_logits, 3, "[B, T, V]")
    ref_logits = check.floating("ref_logits", ref_logits)
    check.shape("ref_logits", ref_logits, policy_logits.shape, "policy_logits.shape")
    shape = policy_logits.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    old_logp = check.per_token("old_logp", old_logp, shape).astype(jnp.float32)
    pack = packing(shape)
    mask = segments.mask(check.token_mask(mask, shape), pack)
    if policy_logits.shape[-1] == 0:
        raise ValueError("policy_logits: expected a non-empty vocabulary axis, got V = 0")
    vocab = global_vocab(policy_logits.shape[-1], vocab_axis)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    return policy_logits, ref_logits, actions, _sg(old_logp), mask, pack


def _paired_logprobs(
    op, policy_logits, ref_logits, actions, mask, temperature, backend, vocab_axis
):
    batch, steps, vocab = policy_logits.shape
    problem = Problem(n_rows=batch * steps, vocab=vocab, dtype=dtype_name(policy_logits))
    choice = dispatch.resolve(op, problem, backend)
    logp, ref_logp = logprob_core.paired_from_parts(
        choice.impl,
        policy_logits,
        ref_logits,
        actions.astype(jnp.int32),
        mask != 0,
        temperature=float(temperature),
        vocab_axis=vocab_axis,
    )
    return logp, _sg(ref_logp)


def ratio_kl(
    policy_logits: ArrayLike,
    ref_logits: ArrayLike,
    actions: ArrayLike,
    old_logp: ArrayLike,
    mask: ArrayLike,
    *,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
) -> tuple[jax.Array, jax.Array]:
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
    policy_logits, ref_logits, actions, old_logp, mask, _ = _logits_inputs(
        policy_logits, ref_logits, actions, old_logp, mask, vocab_axis
    )
    check.option("kl_estimator", kl_estimator, kl_math.KL_ESTIMATORS)
    check.positive("temperature", temperature)
    logp, ref_logp = _paired_logprobs(
        "ratio_kl", policy_logits, ref_logits, actions, mask, temperature, backend, vocab_axis
    )
    valid = mask != 0
    ratio = jnp.where(valid, jnp.exp(logp - old_logp), 1.0)
    kl = jnp.where(valid, kl_math.kl_penalty(logp, ref_logp, kl_estimator), 0.0)
    return ratio, kl


def grpo_loss(
    policy_logits: ArrayLike,
    ref_logits: ArrayLike,
    actions: ArrayLike,
    old_logp: ArrayLike,
    rewards: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    groups: Groups | None = None,
    advantages: ArrayLike | None = None,
    rollout_logp: ArrayLike | None = None,
    config: PolicyLoss | None = None,
    temperature: float = 1.0,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GRPO from policy and reference logits ``[B, T, V]`` and one reward per sequence.

    ``A = group_advantages(rewards, groups=groups)`` (unless ``advantages`` ``[B]`` is given),
    broadcast over ``T``; per token ``pg`` as in ``ppo_loss`` (every variant, and rollout
    correction with ``rollout_logp`` / ``config.tis_cap``), ``kl = kl_penalty(logp,
    logp_ref)``; ``loss = aggregate(pg + β·kl)`` with ``β = config.kl_coef``. The gradient
    reaches ``policy_logits`` only.

    Args:
      policy_logits, ref_logits: ``[B, T, V]`` float.
      actions: ``[B, T]`` integer token ids; never read where ``mask == 0``.
      old_logp: ``[B, T]``, log-probs under the sampling policy (no gradient).
      rewards: ``[B]`` (``[S]`` with ``segment_ids``, indexed by segment id).
      mask: ``[B, T]``, 1 on response tokens.
      segment_ids: ``[B, T]`` packed rows' segment ids, as in ``aggregate``, or ``None``;
        groups are then runs of consecutive segment ids.
      num_segments: S (static), optional: ``rewards`` gives it.
      groups: a ``jk.Groups``: how sequences form groups, as in ``group_advantages``.
      advantages: ``[B]`` (``[S]``) to use instead of group advantages.
      rollout_logp: as in ``ppo_loss``.
      config: a ``jk.PolicyLoss`` (``kl_coef`` is GRPO's β; its ``entropy_coef`` must be 0).
      temperature: the log-probs are of ``softmax(logits / temperature)``.
      backend: ``None`` (automatic) or a backend name.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the vocabulary.
      **deprecated: the ``PolicyLoss`` options as keywords (``beta`` for ``kl_coef``) and
        ``group_size``, ``group_boundaries``, ``normalize_std``, ``eps`` (use ``config=``,
        ``groups=``), until 0.3.

    Returns:
      ``(loss, policy_loss, kl)``: float32 scalars, the last two aggregated like the loss.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits, actions = jnp.zeros((4, 3, 10)), jnp.zeros((4, 3), int)
      >>> old_logp = jk.token_logprobs(logits, actions)
      >>> loss, pg, kl = jk.grpo_loss(logits, logits, actions, old_logp, jnp.array([1., 0, 1, 1]),
      ...                             jnp.ones((4, 3)), groups=jk.Groups(size=2),
      ...                             config=jk.PolicyLoss(kl_coef=0.04))
      >>> round(float(loss), 4), float(kl)
      (0.0, 0.0)
    """
    values = policy_options(
        "grpo_loss",
        config,
        deprecated,
        keywords=GRPO_KEYWORDS,
        unused=("entropy_coef",),
        given={"groups": groups},
        extra=(GRPO_GROUPS,),
    )
    options, groups = values["config"], values["groups"]
    sized = {"rewards": rewards, "advantages": advantages}
    policy_logits, ref_logits, actions, old_logp, mask, pack = _logits_inputs(
        policy_logits,
        ref_logits,
        actions,
        old_logp,
        mask,
        vocab_axis,
        lambda shape: segments.packing(segment_ids, num_segments, shape, sized),
    )
    cfg = kernel_config(options, has_rollout=rollout_logp is not None)
    segments.max_len(cfg.loss_agg_mode, cfg.max_len, pack)
    check.positive("temperature", temperature)
    rollout_logp = _sg(check.optional_per_token("rollout_logp", rollout_logp, mask.shape))
    adv = packed_grpo_advantages(
        rewards,
        advantages=advantages,
        groups=groups,
        backend=backend,
        pack=pack,
        batch=policy_logits.shape[0],
    )
    logp, ref_logp = _paired_logprobs(
        "grpo_loss", policy_logits, ref_logits, actions, mask, temperature, backend, vocab_axis
    )
    return grpo_from_logprobs(
        logp,
        cfg,
        ref_logp=ref_logp,
        old_logp=old_logp,
        advantages=adv,
        mask=mask,
        rollout_logp=rollout_logp,
        packing=pack,
    )
