"""The jitted training steps: the supervised warm start's, and the RL step.

Every RL step is one jitted function ``(state, prompts, sums, key) -> (state, metrics)``
(:func:`make_rl_step`): it samples ``group_size`` answers per prompt with
:func:`sampling.generate` (the rollout), scores them with the task's reward and updates the
policy with ``optax``: one update through the algorithm's loss
(:mod:`jaxrl_kernels.demo.rl_losses`), or for the PPO family (:data:`algos.PPO_STYLE`)
``ppo_epochs`` passes of ``ppo_minibatches`` minibatches with the group advantages and the
old policy's log-probs computed once per rollout. The warm start's step
(:func:`make_sft_step`) is teacher-forced NLL on correct answers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import jaxrl_kernels as jk
from jaxrl_kernels.demo import algos, rl_losses, sampling
from jaxrl_kernels.demo.task import AdditionTask


def make_optimizer(
    lr: float, *, warmup: int = 0, clip_norm: float = 1.0, weight_decay: float = 0.0
) -> optax.GradientTransformation:
    """adamw with global-norm clipping; the rate ramps up linearly over ``warmup`` updates."""
    schedule = optax.linear_schedule(0.0, lr, warmup) if warmup > 0 else lr
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay),
    )


def apply_updates(optimizer, params, opt_state, grads):
    """``params`` and ``opt_state`` after one ``optimizer`` update by ``grads``."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# -- supervised warm start ------------------------------------------------------------------


def make_sft_step(lm, optimizer, *, backend=None) -> Callable:
    """Jitted teacher-forced NLL step on correct answers ``[B, M]`` (PAD after EOS)."""

    def loss_fn(params, prompts, answers, mask):
        logp = rl_losses.answer_logprobs(lm, params, prompts, answers, backend=backend)
        return -jk.aggregate(logp, mask)

    @jax.jit
    def step(params, opt_state, prompts, answers, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, prompts, answers, mask)
        params, opt_state = apply_updates(optimizer, params, opt_state, grads)
        return params, opt_state, loss

    return step


# -- RL -------------------------------------------------------------------------------------


def reference_logp(lm, ref_params, batch, cfg):
    """The reference policy's log-probs of the batch's answers (no gradient), or None where
    the loss has no KL term."""
    if cfg.kl_coef == 0.0:
        return None
    return jax.lax.stop_gradient(
        rl_losses.answer_logprobs(
            lm,
            ref_params,
            batch["prompts"],
            batch["actions"],
            temperature=cfg.temperature,
            backend=cfg.backend,
        )
    )


def _group_advantages(batch, cfg):
    return jk.group_advantages(batch["rewards"], groups=jk.Groups(size=cfg.group_size))


def _ppo_update(lm, cfg, optimizer, state, batch, key):
    """``ppo_epochs`` passes over shuffled minibatches of one rollout batch."""
    params, opt_state = state["params"], state["opt_state"]
    batch = dict(batch)
    batch["old_logp"] = jax.lax.stop_gradient(
        rl_losses.answer_logprobs(
            lm,
            params,
            batch["prompts"],
            batch["actions"],
            temperature=cfg.temperature,
            backend=cfg.backend,
        )
    )
    batch["advantages"] = _group_advantages(batch, cfg)
    ref_logp = reference_logp(lm, state["ref_params"], batch, cfg)
    if ref_logp is not None:
        batch["ref_logp"] = ref_logp
    n = batch["rewards"].shape[0]
    if n % cfg.ppo_minibatches:
        raise ValueError(
            f"ppo_minibatches: expected a divisor of the rollout batch {n}, "
            f"got {cfg.ppo_minibatches}"
        )
    data = {
        k: batch[k]
        for k in (
            "prompts",
            "actions",
            "mask",
            "old_logp",
            "rollout_logp",
            "advantages",
            "ref_logp",
        )
        if k in batch
    }

    def minibatch(carry, idx):
        params, opt_state = carry
        sub = jax.tree.map(lambda x: x[idx], data)
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: rl_losses.ppo_loss(lm, cfg, p, sub), has_aux=True
        )(params)
        params, opt_state = apply_updates(optimizer, params, opt_state, grads)
        return (params, opt_state), (loss, metrics)

    def epoch(carry, k):
        order = jax.random.permutation(k, n).reshape(cfg.ppo_minibatches, -1)
        return jax.lax.scan(minibatch, carry, order)

    (params, opt_state), (loss, metrics) = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(key, cfg.ppo_epochs)
    )
    metrics = jax.tree.map(jnp.mean, metrics)
    return params, opt_state, jnp.mean(loss), metrics


def rollout(lm, task: AdditionTask, cfg: algos.RLConfig, params, prompts, sums, key):
    """``group_size`` sampled answers per prompt, scored: ``(batch, scores, update_key)``.

    ``batch`` holds ``prompts``, ``actions``, ``mask``, ``rollout_logp`` ``[B, ...]`` with
    ``B = n * group_size`` (a prompt's answers consecutive), ``rewards`` and ``correct`` [B];
    ``update_key`` is the rest of ``key`` for the update.
    """
    prompts = jnp.repeat(prompts, cfg.group_size, axis=0)
    sums = jnp.repeat(sums, cfg.group_size, axis=0)
    sample_key, update_key = jax.random.split(key)
    actions, rollout_logp, mask = sampling.generate(
        lm,
        params,
        prompts,
        sample_key,
        max_new=task.max_new,
        temperature=cfg.temperature,
    )
    scores = task.score(actions, sums)
    batch = {
        "prompts": prompts,
        "actions": actions,
        "mask": mask,
        "rollout_logp": rollout_logp,
        "rewards": scores["reward"],
        "correct": scores["correct"],
    }
    return batch, scores, update_key


def make_rl_step(lm, task: AdditionTask, optimizer, cfg: algos.RLConfig) -> Callable:
    """The jitted RL step ``(state, prompts[n, P], sums[n], key) -> (state, metrics)``."""

    def rl_step(state: algos.State, prompts, sums, key):
        batch, scores, update_key = rollout(lm, task, cfg, state["params"], prompts, sums, key)
        mask = batch["mask"]
        if cfg.algo in algos.PPO_STYLE:
            params, opt_state, loss, extra = _ppo_update(
                lm, cfg, optimizer, state, batch, update_key
            )
        else:
            if cfg.algo == "grpo":
                ref_logp = reference_logp(lm, state["ref_params"], batch, cfg)
                loss_fn = lambda p: rl_losses.grpo_loss(lm, cfg, p, batch, ref_logp)
            else:
                loss_fn = lambda p: rl_losses.pg_loss(lm, cfg, p, batch)
            (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
            params, opt_state = apply_updates(optimizer, state["params"], state["opt_state"], grads)
        metrics = {
            "reward": jnp.mean(scores["reward"]),
            "accuracy": jnp.mean(scores["correct"]),
            "well_formed": jnp.mean(scores["well_formed"]),
            "tokens": jnp.sum(mask),
            "loss": loss,
            **extra,
        }
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        return new_state, metrics

    return jax.jit(rl_step)
