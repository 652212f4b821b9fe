"""Each RL algorithm's loss on one rollout batch, and the log-probs the losses score.

Every loss takes its options as one ``jk.PolicyLoss``
(:meth:`~jaxrl_kernels.demo.algos.RLConfig.loss_config`). Log-probabilities always come from the
model's hidden states and LM-head weight through the ``jaxrl_kernels`` ops, so no [B, T, V]
logits tensor is built for the loss.

With rewards ``r`` of a batch of ``B = prompts * group_size`` answers:

* ``grpo``: ``linear_grpo_loss`` with group advantages
  ``(r - mean_g) / (std_g + eps)`` (``groups=jk.Groups(size=group_size)``), one
  update per rollout (ratio 1, so ``old_logp`` is the current policy's,
  recomputed), optional KL ``kl_coef * k3(pi, pi_ref)`` to the frozen
  warm-start policy.
* ``ppo``: ``linear_ppo_loss`` with the same group advantages (no critic),
  ``old_logp`` from the policy that sampled, ``ppo_epochs`` passes of
  ``ppo_minibatches`` minibatches, dual clip, and truncated importance
  sampling ``min(exp(old_logp - rollout_logp), tis_cap)`` against the
  sampler's own log-probs.
* ``gspo``: as ``ppo``, with one ratio per answer (``ratio_level="sequence"``:
  the exponentiated mean of its tokens' log-ratios), the small clip range of
  the GSPO paper and per-answer loss aggregation; no dual clip.
* ``cispo``: as ``ppo``, with ``policy_loss="cispo"``: every token keeps the
  gradient of ``-A * logp``, weighted by its clipped, stopped ratio; no dual
  clip.
* ``reinforce``: ``policy_gradient_loss`` with ``A = r - mean(r)``.
* ``best_of_n``: ``policy_gradient_loss`` with ``A = 1`` on the best answer of
  each group when it is correct and 0 elsewhere (the NLL of the chosen
  answers).
* ``reward_weighted``: ``policy_gradient_loss`` with ``A = r`` (NLL weighted by
  reward).

``rollout_correction`` weighs the policy-gradient term of ``grpo``, ``ppo``,
``gspo`` and ``cispo`` by the trainer's and the sampler's log-probs of the
sampled tokens, ``w = exp(old_logp - rollout_logp)`` per token or per answer,
truncated at ``tis_cap`` or zero above it (``jk.PolicyLoss``'s ``tis_level``
and ``tis_mode``). Here the sampler and the trainer hold the same parameters, so
the two differ only by rounding and ``w`` stays close to 1 (metric
``tis_weight_mean``); with a separate inference engine they differ more.

The sampler draws from ``softmax(logits / temperature)`` and every loss scores
that same distribution: ``linear_logprobs`` and ``linear_ppo_loss`` take
``temperature``; ``linear_grpo_loss`` gets the head weight divided by it,
which is the same thing since ``(h @ W^T) / t = h @ (W / t)^T``.

The step that samples the batch, computes the advantages and applies the updates is
:mod:`jaxrl_kernels.demo.rl_step`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxrl_kernels as jk
from jaxrl_kernels.demo import model as model_lib


def answer_hidden(
    lm: model_lib.CausalLM, params, prompts: jax.Array, answers: jax.Array
) -> jax.Array:
    """Hidden states [B, M, D] at the positions that predict ``answers[B, M]``."""
    tokens = jnp.concatenate([prompts, answers], axis=1)[:, :-1]
    return lm.apply(params, tokens)[:, prompts.shape[1] - 1 :]


def answer_logprobs(lm, params, prompts, answers, *, temperature=1.0, backend=None):
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)
    hidden = answer_hidden(lm, params, prompts, answers)
    return jk.linear_logprobs(
        hidden, weight, answers, weight_layout=layout, temperature=temperature, backend=backend
    )


def grpo_loss(lm, cfg, params, batch, ref_logp):
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)
    weight = weight / cfg.temperature
    hidden = answer_hidden(lm, params, batch["prompts"], batch["actions"])
    sg = jax.lax.stop_gradient
    old_logp = sg(
        jk.linear_logprobs(
            sg(hidden), sg(weight), batch["actions"], weight_layout=layout, backend=cfg.backend
        )
    )
    loss, policy_loss, kl = jk.linear_grpo_loss(
        hidden,
        weight,
        batch["actions"],
        old_logp,
        batch["rewards"],
        batch["mask"],
        weight_layout=layout,
        ref_logp=ref_logp,
        rollout_logp=_rollout_logp(cfg, batch),
        groups=jk.Groups(size=cfg.group_size),
        config=cfg.loss_config(),
        backend=cfg.backend,
    )
    return loss, {"policy_loss": policy_loss, "kl": kl}


def _rollout_logp(cfg, batch) -> jax.Array | None:
    """The sampler's log-probs, which the loss weighs by with a rollout correction."""
    return None if cfg.rollout_correction == "none" else batch["rollout_logp"]


def _pg_advantages(batch, cfg):
    r = batch["rewards"]
    if cfg.algo == "reinforce":
        return r - jnp.mean(r), batch["mask"]
    if cfg.algo == "reward_weighted":
        return r, batch["mask"]
    # best_of_n: the best answer of each group, kept only when it is correct.
    g = cfg.group_size
    best = jnp.argmax(r.reshape(-1, g), axis=1)
    keep = jnp.take_along_axis(batch["correct"].reshape(-1, g), best[:, None], axis=1)[:, 0]
    chosen = (jax.nn.one_hot(best, g) * keep[:, None]).reshape(-1)
    return chosen, batch["mask"] * chosen[:, None]


def pg_loss(lm, cfg, params, batch):
    adv, mask = _pg_advantages(batch, cfg)
    logp = answer_logprobs(
        lm,
        params,
        batch["prompts"],
        batch["actions"],
        temperature=cfg.temperature,
        backend=cfg.backend,
    )
    loss = jk.policy_gradient_loss(logp, adv, mask, config=cfg.loss_config())
    if cfg.algo == "best_of_n":
        return loss, {"selected": jnp.mean(adv)}  # fraction of answers fine-tuned on
    return loss, {}


def ppo_loss(lm, cfg, params, batch):
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)
    hidden = answer_hidden(lm, params, batch["prompts"], batch["actions"])
    return jk.linear_ppo_loss(
        hidden,
        weight,
        batch["actions"],
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        weight_layout=layout,
        temperature=cfg.temperature,
        ref_logp=batch.get("ref_logp"),
        rollout_logp=_rollout_logp(cfg, batch),
        config=cfg.loss_config(),
        backend=cfg.backend,
    )
