"""The RL algorithms' options: which algorithms there are and what each one takes.

:data:`ALGOS` and the families that share code (:data:`GROUP_ALGOS`, :data:`PPO_STYLE`,
:data:`DUAL_CLIP_ALGOS`), the flags' choices, the per-algorithm defaults (:data:`ALGO_DEFAULTS`,
and :data:`DISTILL_DEFAULTS` for ``--algo distill``), :class:`RLConfig` (what an RL step
computes; :meth:`RLConfig.loss_config` is the ``jk.PolicyLoss`` every loss takes) and the checks
of a field's value (:func:`one_of`, :func:`positive`, :func:`at_least`).

What each algorithm's loss computes is :mod:`jaxrl_kernels.demo.rl_losses`'s; the jitted steps
(the supervised warm start, and the RL step's rollout, advantages and updates) are
:mod:`jaxrl_kernels.demo.rl_step`'s.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jaxrl_kernels as jk
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
