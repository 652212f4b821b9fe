"""Training steps: the supervised warm start and seven RL algorithms.

Every step is one jitted function ``(state, prompts, sums, key) -> (state,
metrics)``; an RL step samples ``group_size`` answers per prompt with
:func:`sampling.generate`, scores them with the task's reward and updates the
policy with ``optax``. Every loss takes its options as one ``jk.PolicyLoss``
(:meth:`RLConfig.loss_config`). Log-probabilities always come from the model's hidden
states and LM-head weight through the ``jaxrl_kernels`` ops, so no [B, T, V]
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
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxrl_kernels as jk
from jaxrl_kernels.demo import model as model_lib
from jaxrl_kernels.demo import sampling
from jaxrl_kernels.demo.task import AdditionTask
from jaxrl_kernels.dispatch import BACKENDS

ALGOS = ("grpo", "ppo", "gspo", "cispo", "reinforce", "best_of_n", "reward_weighted")
GROUP_ALGOS = ("grpo", "ppo", "gspo", "cispo", "best_of_n")  # compare answers within a group
PPO_STYLE = ("ppo", "gspo", "cispo")  # several updates per rollout through linear_ppo_loss
DUAL_CLIP_ALGOS = ("ppo", "gspo")  # the algorithms whose loss takes --dual-clip
DISTILL = "distill"  # not an RL algorithm: a grpo teacher, then on-policy distillation (distill.py)
CHOICES = ALGOS + (DISTILL,)  # what --algo takes
ROLLOUT_CORRECTIONS = ("none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")
# The library's options (docs/api.md, "kl_penalty", "aggregate") as the flags' choices; checked by
# building a jk.PolicyLoss; tests/demo/test_demo.py checks that the library takes exactly these.
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
LOSS_AGG_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

# The defaults of the fields declared with ``default=None`` below: the first value that applies.
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {"rollout_correction": "token-truncate", "dual_clip": 3.0},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "loss_agg_mode": "seq_mean_token_mean"},
    # No lower bound on the weight, as in the CISPO paper; one pass over each rollout, since
    # every token keeps a gradient (two passes at lr 5e-4 collapse on the default task).
    "cispo": {"clip_low": 0.99, "ppo_epochs": 1},
    "*": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": None,
        "loss_agg_mode": "token_mean",
        "rollout_correction": "none",
        "ppo_epochs": 2,
    },
}

# The defaults of the distillation fields (``--algo distill`` only; None for the others).
DISTILL_DEFAULTS: dict[str, Any] = {
    "student_d_model": 32,
    "student_layers": 2,
    "student_heads": 4,
    "student_warmup_steps": 350,
    "distill_steps": 600,
    "distill_lr": 2e-3,
    "divergence": "reverse_kl",
    "timing_runs": 20,
    "teacher_topk": 0,
    "topk_tail": "drop",
}

State = dict[str, Any]  # {"params", "opt_state", "ref_params", "step"}


def option(default: Any, help: str, **meta: Any) -> Any:
    """A config field whose ``help`` becomes its command-line help (see ``demo.__main__``)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def per_algo(name: str, help: str, kind: type, **meta: Any) -> Any:
    """A field whose default depends on ``algo`` (:data:`ALGO_DEFAULTS`); None asks for it."""
    common = ALGO_DEFAULTS["*"][name]
    shown = lambda v: "off" if v is None else v
    special = "".join(
        f"; {algo}: {shown(d[name])}"
        for algo, d in ALGO_DEFAULTS.items()
        if algo != "*" and name in d
    )
    return option(None, f"{help} [{shown(common)}{special}]", type=kind, **meta)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """What an RL step computes: the algorithm and its loss options.

    Invalid values raise ``ValueError`` naming the field when the config is built.
    """

    algo: str = option(
        "grpo",
        "RL algorithm; distill: train a teacher with grpo, then distil a "
        "smaller student from it on the student's own samples",
        choices=CHOICES,
    )
    group_size: int = option(8, "answers sampled per prompt")
    temperature: float = option(
        1.0, "sampling temperature; the losses score the same tempered policy"
    )
    kl_coef: float = option(
        0.0, "KL coefficient to the frozen warm-start policy (grpo, ppo, gspo, cispo)"
    )
    kl_estimator: str = option("k3", "KL estimator", choices=KL_ESTIMATORS)
    clip_low: float | None = per_algo(
        "clip_low", "ratio clip below 1 (grpo, ppo, gspo, cispo)", float
    )
    clip_high: float | None = per_algo(
        "clip_high", "ratio clip above 1 (grpo, ppo, gspo, cispo)", float
    )
    dual_clip: float | None = per_algo(
        "dual_clip", f"dual clip constant, > 1 ({', '.join(DUAL_CLIP_ALGOS)})", float
    )
    rollout_correction: str | None = per_algo(
        "rollout_correction",
        "weigh the policy gradient by exp(trainer - sampler log-probs) "
        "per token or per answer, truncated at --tis-cap or masked above it (grpo, ppo, gspo, "
        "cispo)",
        str,
        choices=ROLLOUT_CORRECTIONS,
    )
    tis_cap: float = option(2.0, "the cap of --rollout-correction")
    ppo_epochs: int | None = per_algo(
        "ppo_epochs", "passes over each rollout batch (ppo, gspo, cispo)", int
    )
    ppo_minibatches: int = option(2, "minibatches per pass (ppo, gspo, cispo)")
    entropy_coef: float = option(0.0, "entropy bonus coefficient (ppo, gspo, cispo)")
    loss_agg_mode: str | None = per_algo(
        "loss_agg_mode", "loss aggregation", str, choices=LOSS_AGG_MODES
    )
    backend: str | None = option(
        None,
        "jaxrl_kernels backend for every op; automatic choice when not given",
        choices=BACKENDS,
    )

    def __post_init__(self):
        one_of("algo", self.algo, CHOICES)
        defaults = {**ALGO_DEFAULTS["*"], **ALGO_DEFAULTS.get(self.algo, {})}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: only while being built
        grouped = self.algo in GROUP_ALGOS + (DISTILL,)
        at_least(
            "group_size",
            self.group_size,
            2 if grouped else 1,
            "distill's teacher is trained with grpo, which compares answers within a group"
            if self.algo == DISTILL
            else f"{self.algo} compares answers within a group"
            if grouped
            else "",
        )
        positive("temperature", self.temperature)
        # The loss options' ranges as the library checks them (each message names the field).
        jk.PolicyLoss(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
            kl_estimator=self.kl_estimator,
            loss_agg_mode=self.loss_agg_mode,
        )
        at_least("ppo_epochs", self.ppo_epochs, 1)
        at_least("ppo_minibatches", self.ppo_minibatches, 1)
        one_of("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction != "none" and self.algo not in ("grpo", DISTILL) + PPO_STYLE:
            raise ValueError(
                f"rollout_correction: expected 'none' for {self.algo} (its loss, "
                f"policy_gradient_loss, has no importance weight), got "
                f"{self.rollout_correction!r}"
            )
        if self.dual_clip is not None and self.algo not in DUAL_CLIP_ALGOS:
            raise ValueError(
                f"dual_clip: {self.algo} has no dual clip (only "
                f"{', '.join(DUAL_CLIP_ALGOS)}), got {self.dual_clip}"
            )
        if self.backend is not None:
            one_of("backend", self.backend, BACKENDS)

    def loss_config(self) -> jk.PolicyLoss:
        """The ``config=`` of ``algo``'s loss: a ``jk.PolicyLoss`` of the options it has a term
        for (``policy_gradient_loss``: the aggregation only)."""
        if self.algo not in ("grpo", DISTILL) + PPO_STYLE:
            return jk.PolicyLoss(loss_agg_mode=self.loss_agg_mode)
        options = dict(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            loss_agg_mode=self.loss_agg_mode,
        )
        if self.rollout_correction != "none":
            level, mode = self.rollout_correction.split("-")
            options.update(tis_cap=self.tis_cap, tis_level=level, tis_mode=mode)
        if self.algo in PPO_STYLE:
            options.update(
                entropy_coef=self.entropy_coef,
                ratio_level="sequence" if self.algo == "gspo" else "token",
                policy_loss="cispo" if self.algo == "cispo" else "ppo",
            )
        return jk.PolicyLoss(**options)


def one_of(name: str, value: Any, valid: tuple[str, ...]) -> None:
    """``value`` must be one of ``valid``."""
    if value not in valid:
        raise ValueError(f"{name}: unknown option {value!r}; valid: {', '.join(valid)}")


def positive(name: str, value: Any) -> None:
    """``value`` must be a real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name}: expected a value > 0, got {value!r}")


def at_least(name: str, value: Any, low: int, why: str = "") -> None:
    """``value`` must be an int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected an int >= {low}{because}, got {value!r}")


def make_optimizer(
    lr: float, *, warmup: int = 0, clip_norm: float = 1.0, weight_decay: float = 0.0
) -> optax.GradientTransformation:
    """adamw with global-norm clipping; the rate ramps up linearly over ``warmup`` updates."""
    schedule = optax.linear_schedule(0.0, lr, warmup) if warmup > 0 else lr
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay),
    )


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


def _apply(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


# -- supervised warm start ------------------------------------------------------------------


def make_sft_step(lm, optimizer, *, backend=None) -> Callable:
    """Jitted teacher-forced NLL step on correct answers ``[B, M]`` (PAD after EOS)."""

    def loss_fn(params, prompts, answers, mask):
        logp = answer_logprobs(lm, params, prompts, answers, backend=backend)
        return -jk.aggregate(logp, mask)

    @jax.jit
    def step(params, opt_state, prompts, answers, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, prompts, answers, mask)
        params, opt_state = _apply(optimizer, params, opt_state, grads)
        return params, opt_state, loss

    return step


# -- RL -------------------------------------------------------------------------------------


def _ref_logp(lm, state, batch, cfg):
    if cfg.kl_coef == 0.0:
        return None
    return jax.lax.stop_gradient(
        answer_logprobs(
            lm,
            state["ref_params"],
            batch["prompts"],
            batch["actions"],
            temperature=cfg.temperature,
            backend=cfg.backend,
        )
    )


def _group_advantages(batch, cfg):
    return jk.group_advantages(batch["rewards"], groups=jk.Groups(size=cfg.group_size))


def _grpo_loss(lm, cfg, params, batch, ref_logp):
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


def _pg_loss(lm, cfg, params, batch):
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


def _ppo_loss(lm, cfg, params, batch):
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


def _ppo_update(lm, cfg, optimizer, state, batch, key):
    """``ppo_epochs`` passes over shuffled minibatches of one rollout batch."""
    params, opt_state = state["params"], state["opt_state"]
    batch = dict(batch)
    batch["old_logp"] = jax.lax.stop_gradient(
        answer_logprobs(
            lm,
            params,
            batch["prompts"],
            batch["actions"],
            temperature=cfg.temperature,
            backend=cfg.backend,
        )
    )
    batch["advantages"] = _group_advantages(batch, cfg)
    ref_logp = _ref_logp(lm, state, batch, cfg)
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
            lambda p: _ppo_loss(lm, cfg, p, sub), has_aux=True
        )(params)
        params, opt_state = _apply(optimizer, params, opt_state, grads)
        return (params, opt_state), (loss, metrics)

    def epoch(carry, k):
        order = jax.random.permutation(k, n).reshape(cfg.ppo_minibatches, -1)
        return jax.lax.scan(minibatch, carry, order)

    (params, opt_state), (loss, metrics) = jax.lax.scan(
        epoch, (params, opt_state), jax.random.split(key, cfg.ppo_epochs)
    )
    metrics = jax.tree.map(jnp.mean, metrics)
    return params, opt_state, jnp.mean(loss), metrics


def make_rl_step(lm, task: AdditionTask, optimizer, cfg: RLConfig) -> Callable:
    """The jitted RL step ``(state, prompts[n, P], sums[n], key) -> (state, metrics)``."""

    def rl_step(state: State, prompts, sums, key):
        prompts = jnp.repeat(prompts, cfg.group_size, axis=0)
        sums = jnp.repeat(sums, cfg.group_size, axis=0)
        sample_key, update_key = jax.random.split(key)
        actions, rollout_logp, mask = sampling.generate(
            lm,
            state["params"],
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
        if cfg.algo in PPO_STYLE:
            params, opt_state, loss, extra = _ppo_update(
                lm, cfg, optimizer, state, batch, update_key
            )
        else:
            if cfg.algo == "grpo":
                ref_logp = _ref_logp(lm, state, batch, cfg)
                loss_fn = lambda p: _grpo_loss(lm, cfg, p, batch, ref_logp)
            else:
                loss_fn = lambda p: _pg_loss(lm, cfg, p, batch)
            (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
            params, opt_state = _apply(optimizer, state["params"], state["opt_state"], grads)
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
