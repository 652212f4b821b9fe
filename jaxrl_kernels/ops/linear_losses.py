"""The losses computed from a linear LM head's hidden states, never holding the logits:
``linear_ppo_loss``, ``linear_grpo_loss`` and ``linear_policy_gradient_loss``.

Each is the math of :mod:`jaxrl_kernels.ops.losses` (options in
:class:`policy_config.PolicyLoss`) on the log-probs (and entropies) of the sampled tokens:
with ``memory="lean"`` from the ``linear_logprobs`` primitive
(``logprobs.linear_logprobs_rows``, any backend); with ``memory="fast"`` through
:mod:`jaxrl_kernels.engine.fused_loss`, which takes the loss's gradient in the forward (3 GEMMs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_kernels import dispatch
from jaxrl_kernels.formulas import aggregation_math
from jaxrl_kernels.engine import fused_loss
from jaxrl_kernels.formulas import ppo_math
from jaxrl_kernels.formulas import sampler_math
from jaxrl_kernels import validation as check
from jaxrl_kernels.ops.logprobs import AxisName, global_vocab, head_choice, linear_logprobs_rows
from jaxrl_kernels.config.policy import (PG_UNUSED, PolicyLoss, from_arguments,
                                         grpo_advantages, grpo_from_logprobs, kernel_config,
                                         run_ppo)

_sg = jax.lax.stop_gradient


# -- fused from hidden states ------------------------------------------------------------

def _linear_inputs(hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis):
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = hidden.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    old_logp = _sg(check.per_token("old_logp", old_logp, shape).astype(jnp.float32))
    mask = check.token_mask(mask, shape)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    return hidden, weight, bias, actions, old_logp, mask


def _linear_loss(op, loss_fn, inputs, hidden, weight, bias, actions, mask, *, weight_layout,
                 temperature, with_entropy, backend, vocab_axis, memory, sampler=(None,) * 3,
                 counts_outside=True):
    """``loss_fn(logp, entropy | None, inputs)`` on the head's log-probs of ``actions``: lean,
    the log-probs from ``linear_logprobs_rows``; fast, the loss's gradient taken in the
    forward (``fused_loss``). ``sampler``: ``(top_k, top_p, min_p)``; with a truncation the
    log-probs are the processed distribution's (the fast mode keeps the logits,
    ``saved_logits``) and, where ``counts_outside``, the metrics count the response tokens
    whose action is outside its kept set (``outside_kept_set``)."""
    truncation = sampler_math.truncation(*sampler)
    choice = head_choice(op, memory, hidden, weight, bias, actions, weight_layout=weight_layout,
                         return_entropy=with_entropy, backend=backend, vocab_axis=vocab_axis,
                         loss=True)
    options = dict(weight_layout=weight_layout, temperature=float(temperature),
                   vocab_axis=vocab_axis)
    if choice.fast and truncation is None:
        return fused_loss.fused_linear_loss(
            choice.impl, loss_fn, hidden, weight, bias, actions.astype(jnp.int32), mask != 0,
            inputs, with_entropy=with_entropy, **options)
    logp, entropy, *kept = linear_logprobs_rows(
        hidden, weight, bias, actions, mask != 0, choice=choice, return_entropy=with_entropy,
        truncation=truncation, **options)
    out = loss_fn(logp, entropy, inputs)
    if truncation is None or not counts_outside:
        return out
    loss, metrics = out
    outside = jnp.sum(((mask != 0) & ~kept[0]).astype(jnp.float32))
    return loss, {**metrics, "outside_kept_set": _sg(outside)}


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
                    memory: str | int | None = None, config: PolicyLoss | None = None,
                    top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
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
      memory: ``"lean"`` (nothing ``[B, T, V]`` kept: 4 GEMMs), ``"fast"`` (the loss's
        gradient taken in the forward: 3 GEMMs and one ``[B, T, V]`` buffer in the head's
        dtype) or a byte budget (``"fast"`` when that buffer fits in it); ``None``: the mode
        of ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else ``"lean"``.
      config: a ``PolicyLoss`` instead of the options clip_low ... tis_mode, as in
        ``ppo_loss``.
      top_k, top_p, min_p: the rollout sampler's truncation, as in ``linear_logprobs``: the
        log-probs (and entropy) of the distribution it sampled from (with ``memory="fast"``
        the logits are kept for the backward); the metrics count the response tokens whose
        action is outside its kept set (``outside_kept_set``).

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
    options = from_arguments("linear_ppo_loss", config, locals())
    hidden, weight, bias, actions, old_logp, mask = _linear_inputs(
        hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis)
    shape = mask.shape
    check.positive("temperature", temperature)
    with_entropy = options.entropy_coef != 0
    cfg = kernel_config(options, has_rollout=rollout_logp is not None,
                        has_ref=ref_logp is not None, has_entropy=with_entropy)
    inputs = dict(
        old_logp=old_logp, advantages=check.token_advantages(advantages, shape), mask=mask,
        rollout_logp=_sg(check.optional_per_token("rollout_logp", rollout_logp, shape)),
        ref_logp=_sg(check.optional_per_token("ref_logp", ref_logp, shape)))

    def loss_fn(logp, entropy, inputs):
        return run_ppo("linear_ppo_loss", ppo_math.PPOInputs(logp=logp, entropy=entropy, **inputs),
                       cfg, backend=backend, strict=False)

    return _linear_loss("linear_ppo_loss", loss_fn, inputs, hidden, weight, bias, actions, mask,
                        weight_layout=weight_layout, temperature=temperature,
                        with_entropy=with_entropy, backend=backend, vocab_axis=vocab_axis,
                        memory=memory, sampler=(top_k, top_p, min_p))


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
                     memory: str | int | None = None, config: PolicyLoss | None = None,
                     top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
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
      memory: ``"lean"`` (nothing ``[B, T, V]`` kept: 4 GEMMs), ``"fast"`` (the loss's
        gradient taken in the forward: 3 GEMMs and one ``[B, T, V]`` buffer in the head's
        dtype) or a byte budget (``"fast"`` when that buffer fits in it); ``None``: the mode
        of ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else ``"lean"``.
      config: a ``PolicyLoss`` instead of the policy options, as in ``grpo_loss``.
      top_k, top_p, min_p: the rollout sampler's truncation, as in ``linear_ppo_loss``
        (``linear_logprobs(..., return_kept=True)`` counts the actions outside the kept set).

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
    options = from_arguments("linear_grpo_loss", config, locals(),
                             renamed={"beta": "kl_coef"}, unused=("entropy_coef",))
    hidden, weight, bias, actions, old_logp, mask = _linear_inputs(
        hidden, weight, bias, weight_layout, actions, old_logp, mask, vocab_axis)
    cfg = kernel_config(options, has_rollout=rollout_logp is not None,
                        has_ref=ref_logp is not None, kl_name="beta")
    check.positive("temperature", temperature)
    ref_logp = _sg(check.optional_per_token("ref_logp", ref_logp, mask.shape))
    rollout_logp = _sg(check.optional_per_token("rollout_logp", rollout_logp, mask.shape))
    adv = grpo_advantages(rewards, advantages=advantages, batch=hidden.shape[0],
                          group_size=group_size, group_boundaries=group_boundaries,
                          normalize_std=normalize_std, eps=eps, backend=backend)
    inputs = dict(ref_logp=ref_logp, old_logp=old_logp, advantages=adv, mask=mask,
                  rollout_logp=rollout_logp)

    def loss_fn(logp, entropy, inputs):
        return grpo_from_logprobs(logp, cfg, **inputs)

    return _linear_loss("linear_grpo_loss", loss_fn, inputs, hidden, weight, bias, actions,
                        mask, weight_layout=weight_layout, temperature=temperature,
                        with_entropy=False, backend=backend, vocab_axis=vocab_axis,
                        memory=memory, sampler=(top_k, top_p, min_p), counts_outside=False)


def linear_policy_gradient_loss(hidden: ArrayLike, weight: ArrayLike, actions: ArrayLike,
                                advantages: ArrayLike, mask: ArrayLike, *,
                                bias: ArrayLike | None = None, weight_layout: str = "vd",
                                temperature: float = 1.0, loss_agg_mode: str = "token_mean",
                                max_len: int | None = None, backend: str | None = None,
                                vocab_axis: AxisName | None = None,
                                memory: str | int | None = None,
                                config: PolicyLoss | None = None, top_k: int | None = None,
                                top_p: float | None = None, min_p: float | None = None
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
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      loss_agg_mode, max_len: as in ``aggregate``.
      backend: ``None`` (automatic) or a backend name, for the log-probs.
      vocab_axis: inside ``jax.shard_map``, the axis splitting the weight's vocabulary.
      memory: ``"lean"``, ``"fast"``, a byte budget or ``None``, as in ``linear_ppo_loss``.
      config: a ``PolicyLoss`` instead of ``loss_agg_mode`` and ``max_len``, as in
        ``policy_gradient_loss``.
      top_k, top_p, min_p: the rollout sampler's truncation, as in ``linear_logprobs``.

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
    options = from_arguments("linear_policy_gradient_loss", config, locals(), unused=PG_UNUSED)
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = hidden.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    mask = check.token_mask(mask, shape)
    advantages = check.token_advantages(advantages, shape)
    mode, max_len = check.agg_mode(options.loss_agg_mode), options.max_len
    check.positive("temperature", temperature)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    def loss_fn(logp, entropy, inputs):
        return aggregation_math.aggregate(-inputs["advantages"] * logp, inputs["mask"], mode, max_len)

    return _linear_loss("linear_policy_gradient_loss", loss_fn,
                        dict(advantages=advantages, mask=mask), hidden, weight, bias, actions,
                        mask, weight_layout=weight_layout, temperature=temperature,
                        with_entropy=False, backend=backend, vocab_axis=vocab_axis,
                        memory=memory, sampler=(top_k, top_p, min_p), counts_outside=False)
