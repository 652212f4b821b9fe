"""The losses computed from a linear LM head's hidden states, never holding the logits:
``linear_ppo_loss``, ``linear_grpo_loss`` and ``linear_policy_gradient_loss``.

Each is the math of :mod:`jaxrl_kernels.ops.losses` (options in
:class:`jaxrl_kernels.config.PolicyLoss`) on the log-probs (and entropies) of the sampled
tokens, through the one linear-head entry (:func:`jaxrl_kernels.engine.head_entry.loss_rows`):
with ``memory="lean"`` from the ``linear_logprobs`` primitive (any backend); with
``memory="fast"`` the loss's gradient taken in the forward (3 GEMMs).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_kernels import validation as check
from jaxrl_kernels.config.policy import (
    GRPO_GROUPS,
    GRPO_KEYWORDS,
    PG_UNUSED,
    Groups,
    PolicyLoss,
    policy_options,
)
from jaxrl_kernels.config.sampler import LEGACY as SAMPLER_LEGACY
from jaxrl_kernels.config.sampler import Sampler, truncation_of
from jaxrl_kernels.engine.linear_head import AxisName, HeadCall
from jaxrl_kernels.formulas import ppo_math, segment_math
from jaxrl_kernels.ops import segments
from jaxrl_kernels.ops.policy_terms import (
    grpo_from_logprobs,
    kernel_config,
    linear_inputs,
    linear_loss,
    packed_grpo_advantages,
    run_ppo,
    segment_inputs,
    with_segment_ids,
)

_sg = jax.lax.stop_gradient


def linear_ppo_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    actions: ArrayLike,
    old_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    rollout_logp: ArrayLike | None = None,
    ref_logp: ArrayLike | None = None,
    config: PolicyLoss | None = None,
    sampler: Sampler | None = None,
    temperature: float = 1.0,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``ppo_loss`` on the log-probs of a linear LM head, never holding ``[B, T, V]`` logits.

    The log-probs are ``linear_logprobs(hidden, weight, actions, bias, ...)``; the entropy
    comes from the same pass when ``config.entropy_coef != 0``. Gradients reach ``hidden``,
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
      segment_ids, num_segments: packed rows, as in ``ppo_loss``.
      bias: ``[V]`` or ``None``.
      weight_layout: ``"vd"`` or ``"dv"``.
      rollout_logp, ref_logp: as in ``ppo_loss``.
      config: a ``jk.PolicyLoss`` (``None``: its defaults), as in ``ppo_loss``.
      sampler: a ``jk.Sampler``: the rollout sampler's truncation, as in ``linear_logprobs``:
        the log-probs (and entropy) of the distribution it sampled from (with
        ``memory="fast"`` the logits are kept for the backward); the metrics count the
        response tokens whose action is outside its kept set (``outside_kept_set``).
      temperature: the log-probs are of ``softmax(logits / temperature)``.
      memory: ``"lean"`` (nothing ``[B, T, V]`` kept: 4 GEMMs), ``"fast"`` (the loss's
        gradient taken in the forward: 3 GEMMs and one ``[B, T, V]`` buffer in the head's
        dtype) or a byte budget (``"fast"`` when that buffer fits in it); ``None``: the mode
        of ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else ``"auto"``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      **deprecated: the ``PolicyLoss`` options as keywords and ``top_k``, ``top_p``,
        ``min_p`` (use ``config=``, ``sampler=``), until 0.3.

    Returns:
      ``(loss, metrics)`` as in ``ppo_loss`` (``entropy`` among the metrics when
      ``config.entropy_coef != 0``).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden, embed = jnp.ones((2, 3, 8)), jnp.zeros((50, 8))   # tied embedding [V, D]
      >>> actions = jnp.zeros((2, 3), int)
      >>> old_logp = jk.linear_logprobs(hidden, embed, actions)
      >>> loss, metrics = jk.linear_ppo_loss(hidden, embed, actions, old_logp,
      ...                                    jnp.array([1.0, -1.0]), jnp.ones((2, 3)),
      ...                                    config=jk.PolicyLoss(clip_high=0.28))
      >>> float(loss), float(metrics["clip_fraction"])
      (0.0, 0.0)
    """
    values = policy_options(
        "linear_ppo_loss", config, deprecated, given={"sampler": sampler}, extra=(SAMPLER_LEGACY,)
    )
    options = values["config"]
    hidden, weight, bias, actions, mask, pack = linear_inputs(
        *(hidden, weight, bias, weight_layout, actions, mask, vocab_axis),
        *(segment_ids, num_segments, {"advantages": advantages}),
    )
    shape = mask.shape
    old_logp = _sg(check.per_token("old_logp", old_logp, shape).astype(jnp.float32))
    check.positive("temperature", temperature)
    with_entropy = options.entropy_coef != 0
    cfg = kernel_config(
        options,
        has_rollout=rollout_logp is not None,
        has_ref=ref_logp is not None,
        has_entropy=with_entropy,
    )
    segments.max_len(cfg.loss_agg_mode, cfg.max_len, pack)
    inputs = dict(
        old_logp=old_logp,
        advantages=segments.token_advantages(advantages, shape, pack),
        mask=mask,
        rollout_logp=_sg(check.optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(check.optional_per_token("ref_logp", ref_logp, shape)),
    )
    count = with_segment_ids(inputs, pack)

    def loss_fn(logp, entropy, inputs):
        inputs, packing = segment_inputs(inputs, count)
        return run_ppo(
            "linear_ppo_loss",
            ppo_math.PPOInputs(logp=logp, entropy=entropy, **inputs),
            cfg,
            backend=backend,
            strict=False,
            packing=packing,
        )

    call = HeadCall(
        weight_layout=weight_layout,
        temperature=float(temperature),
        return_entropy=with_entropy,
        vocab_axis=vocab_axis,
        truncation=truncation_of(values["sampler"]),
    )
    return linear_loss(
        "linear_ppo_loss",
        loss_fn,
        inputs,
        hidden,
        weight,
        bias,
        actions,
        mask,
        call,
        memory=memory,
        backend=backend,
        counts_outside=True,
    )


def linear_grpo_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    actions: ArrayLike,
    old_logp: ArrayLike,
    rewards: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    ref_logp: ArrayLike | None = None,
    rollout_logp: ArrayLike | None = None,
    advantages: ArrayLike | None = None,
    groups: Groups | None = None,
    config: PolicyLoss | None = None,
    sampler: Sampler | None = None,
    temperature: float = 1.0,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``grpo_loss`` on the log-probs of a linear LM head, never holding ``[B, T, V]`` logits.

    The reference policy comes as precomputed log-probs ``ref_logp`` ``[B, T]`` (no
    gradient); ``ref_logp=None`` means no KL term, and then ``config.kl_coef`` must be 0.
    Gradients reach ``hidden``, ``weight`` and ``bias``.

    Args:
      hidden: ``[B, T, D]``: the hidden state at position t predicts ``actions[:, t]``.
      weight: ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), as in ``linear_logprobs``.
      actions: ``[B, T]`` integer token ids; never read where ``mask == 0``.
      old_logp: ``[B, T]``, log-probs under the sampling policy (no gradient).
      rewards: ``[B]``, one per sequence.
      mask: ``[B, T]``, 1 on response tokens.
      segment_ids, num_segments: packed rows, as in ``grpo_loss`` (``rewards`` is ``[S]``).
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      ref_logp: ``[B, T]`` reference log-probs, or ``None``.
      rollout_logp, advantages, groups, config: as in ``grpo_loss``.
      sampler: a ``jk.Sampler``, as in ``linear_ppo_loss``
        (``linear_logprobs(..., return_kept=True)`` counts the actions outside the kept set).
      memory: ``"lean"``, ``"fast"``, ``"auto"``, a byte budget or ``None``, as in ``linear_ppo_loss``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      **deprecated: the ``PolicyLoss`` options as keywords (``beta`` for ``kl_coef``),
        ``group_size``, ``group_boundaries``, ``normalize_std``, ``eps``, ``top_k``,
        ``top_p``, ``min_p`` (use ``config=``, ``groups=``, ``sampler=``), until 0.3.

    Returns:
      ``(loss, policy_loss, kl)``: float32 scalars.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden, head = jnp.ones((4, 3, 8)), jnp.zeros((8, 50))    # nnx.Linear kernel [D, V]
      >>> actions, mask = jnp.zeros((4, 3), int), jnp.ones((4, 3))
      >>> old_logp = jk.linear_logprobs(hidden, head, actions, weight_layout="dv")
      >>> loss_fn = lambda h, w: jk.linear_grpo_loss(h, w, actions, old_logp, jnp.array(
      ...     [1.0, 0.0, 0.0, 1.0]), mask, weight_layout="dv", groups=jk.Groups(size=2))[0]
      >>> d_hidden, d_head = jax.grad(loss_fn, argnums=(0, 1))(hidden, head)
      >>> d_hidden.shape, d_head.shape
      ((4, 3, 8), (8, 50))
    """
    values = policy_options(
        "linear_grpo_loss",
        config,
        deprecated,
        keywords=GRPO_KEYWORDS,
        unused=("entropy_coef",),
        given={"groups": groups, "sampler": sampler},
        extra=(GRPO_GROUPS, SAMPLER_LEGACY),
    )
    hidden, weight, bias, actions, mask, pack = linear_inputs(
        *(hidden, weight, bias, weight_layout, actions, mask, vocab_axis),
        *(segment_ids, num_segments, {"rewards": rewards, "advantages": advantages}),
    )
    old_logp = _sg(check.per_token("old_logp", old_logp, mask.shape).astype(jnp.float32))
    cfg = kernel_config(
        values["config"], has_rollout=rollout_logp is not None, has_ref=ref_logp is not None
    )
    segments.max_len(cfg.loss_agg_mode, cfg.max_len, pack)
    check.positive("temperature", temperature)
    ref_logp = _sg(check.optional_per_token("ref_logp", ref_logp, mask.shape))
    rollout_logp = _sg(check.optional_per_token("rollout_logp", rollout_logp, mask.shape))
    adv = packed_grpo_advantages(
        rewards,
        advantages=advantages,
        groups=values["groups"],
        backend=backend,
        pack=pack,
        batch=hidden.shape[0],
    )
    inputs = dict(
        ref_logp=ref_logp, old_logp=old_logp, advantages=adv, mask=mask, rollout_logp=rollout_logp
    )
    count = with_segment_ids(inputs, pack)

    def loss_fn(logp, entropy, inputs):
        inputs, packing = segment_inputs(inputs, count)
        return grpo_from_logprobs(logp, cfg, packing=packing, **inputs)

    call = HeadCall(
        weight_layout=weight_layout,
        temperature=float(temperature),
        vocab_axis=vocab_axis,
        truncation=truncation_of(values["sampler"]),
    )
    return linear_loss(
        "linear_grpo_loss",
        loss_fn,
        inputs,
        hidden,
        weight,
        bias,
        actions,
        mask,
        call,
        memory=memory,
        backend=backend,
    )


def linear_policy_gradient_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    actions: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    config: PolicyLoss | None = None,
    sampler: Sampler | None = None,
    temperature: float = 1.0,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> jax.Array:
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
      segment_ids, num_segments: packed rows, as in ``policy_gradient_loss``.
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      config: a ``jk.PolicyLoss`` whose ``loss_agg_mode`` and ``max_len`` apply, as in
        ``policy_gradient_loss``.
      sampler: a ``jk.Sampler``, as in ``linear_logprobs``.
      memory: ``"lean"``, ``"fast"``, ``"auto"``, a byte budget or ``None``, as in ``linear_ppo_loss``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      **deprecated: ``loss_agg_mode``, ``max_len``, ``top_k``, ``top_p``, ``min_p`` (use
        ``config=``, ``sampler=``), until 0.3.

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
    values = policy_options(
        "linear_policy_gradient_loss",
        config,
        deprecated,
        unused=PG_UNUSED,
        given={"sampler": sampler},
        extra=(SAMPLER_LEGACY,),
    )
    options = values["config"]
    hidden, weight, bias, actions, mask, pack = linear_inputs(
        *(hidden, weight, bias, weight_layout, actions, mask, vocab_axis),
        *(segment_ids, num_segments, {"advantages": advantages}),
    )
    advantages = segments.token_advantages(advantages, mask.shape, pack)
    mode = check.agg_mode(options.loss_agg_mode)
    max_len = segments.max_len(mode, options.max_len, pack)
    check.positive("temperature", temperature)
    inputs = dict(advantages=advantages, mask=mask)
    count = with_segment_ids(inputs, pack)

    def loss_fn(logp, entropy, inputs):
        inputs, packing = segment_inputs(inputs, count)
        per_token = -inputs["advantages"] * logp
        return segment_math.aggregate(per_token, inputs["mask"], packing, mode, max_len)

    call = HeadCall(
        weight_layout=weight_layout,
        temperature=float(temperature),
        vocab_axis=vocab_axis,
        truncation=truncation_of(values["sampler"]),
    )
    return linear_loss(
        "linear_policy_gradient_loss",
        loss_fn,
        inputs,
        hidden,
        weight,
        bias,
        actions,
        mask,
        call,
        memory=memory,
        backend=backend,
    )
