"""The demo's configuration: every field of :class:`Config` with its flag, help text and checks,
and :func:`resume_config`, which rebuilds a run's configuration from its checkpoint."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jaxrl_kernels as jk
from jaxrl_kernels.demo import algos, checkpoint
from jaxrl_kernels.demo.algos import option, positive
from jaxrl_kernels.demo.model import check_dims as model_check_dims
from jaxrl_kernels.demo.task import VOCAB, AdditionTask

TASK, TRAINING, RUN = "task and model", "training", "run"
DISTILLATION = "distillation (--algo distill)"
RESUMABLE = ("steps", "eval_every", "out", "backend", "resume")
"""The fields a resumed run may change; every other one comes from the checkpoint."""
SERVED_DIVERGENCE = "forward_kl"
"""The divergence of a served teacher's loss, ``linear_topk_distill_loss``: the only one."""
# The library's options that the flags offer (docs/api.md, "linear_distill_loss" and
# "linear_topk_distill_loss"); the values are checked by building jk.DistillLoss and
# jk.TopKDistillLoss, and tests/demo/test_demo.py checks that the library takes exactly these.
DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
TOPK_TAILS = ("drop", "bucket")


def flag(name: str) -> str:
    """The command-line flag of field ``name``."""
    return "--" + name.replace("_", "-")


def flag_text(name: str, value: Any) -> str:
    """How the command line spells ``name=value``."""
    if name == "tie_embeddings":
        return "--untied-head" if value is False else ""
    return f"{flag(name)} {value}".strip()


def distill_option(name: str, help: str, kind: type, **meta: Any) -> Any:
    """A field of ``--algo distill`` only: None for the other algorithms, which reject a value."""
    return option(
        None, f"{help} [{algos.DISTILL_DEFAULTS[name]}]", type=kind, group=DISTILLATION, **meta
    )


def distill_default(name: str, served: bool) -> Any:
    """The default of distillation field ``name``: :data:`algos.DISTILL_DEFAULTS`', except
    that a served teacher (``served``) defaults to its only divergence, forward_kl, and the
    whole-vocabulary teacher has no ``topk_tail`` (None)."""
    if name == "divergence" and served:
        return SERVED_DIVERGENCE
    if name == "topk_tail" and not served:
        return None
    return algos.DISTILL_DEFAULTS[name]


@dataclasses.dataclass(frozen=True)
class Config(algos.RLConfig):
    """A whole run: the RL step's options (:class:`algos.RLConfig`) plus task, model, training.

    ``steps`` is the total number of RL steps, those of a resumed checkpoint included.
    Invalid values raise ``ValueError`` naming the field when the config is built.
    """

    digits: int = option(2, "digits per operand of the addition task", group=TASK)
    held_out: int = option(500, "operand pairs held out for evaluation", group=TASK)
    d_model: int = option(64, "model width", group=TASK)
    layers: int = option(2, "transformer layers", group=TASK)
    heads: int = option(4, "attention heads", group=TASK)
    tie_embeddings: bool = option(
        True,
        "LM head tied to the [V, D] token embedding (layout "
        "'vd'); else a separate [D, V] head (layout 'dv')",
        group=TASK,
    )
    warmup_steps: int = option(
        350, "supervised warm-start steps, kept short on purpose", group=TRAINING
    )
    warmup_batch: int = option(64, "warm-start batch size", group=TRAINING)
    warmup_lr: float = option(1e-3, "warm-start learning rate", group=TRAINING)
    steps: int = option(
        800, "RL steps in total, counting those a resumed checkpoint has done", group=TRAINING
    )
    batch_size: int = option(16, "prompts per RL step", group=TRAINING)
    lr: float = option(5e-4, "RL learning rate (adamw, global-norm clipping 1.0)", group=TRAINING)
    lr_warmup: int = option(
        20, "RL steps over which the learning rate ramps up from 0", group=TRAINING
    )
    seed: int = option(0, "random seed", group=TRAINING)
    pack: bool = option(
        False,
        "pack each step's completions (prompt + answer) into rows of --pack-len tokens, several "
        "per row, and train on those with segment ids (grpo only); reports both layouts' "
        "padding fraction and update time",
        group=TRAINING,
    )
    pack_len: int = option(
        90,
        "with --pack: the token budget of a packed row (90 holds nine 10-token or ten 9-token "
        "completions of 2-digit addition)",
        group=TRAINING,
    )
    eval_every: int = option(50, "held-out evaluation every this many RL steps", group=RUN)
    out: str | None = option(
        None,
        "write log.json, curves.png and checkpoint.msgpack to this "
        "directory; with --resume, the checkpoint's directory when "
        "not given",
        group=RUN,
        metavar="DIR",
    )
    resume: str | None = option(
        None,
        "continue a run: its --out directory or its "
        "checkpoint.msgpack; the configuration comes from the "
        "checkpoint, and only "
        + ", ".join(flag_text(n, "") for n in RESUMABLE[:-1])
        + " may differ (not for --algo distill)",
        group=RUN,
        metavar="PATH",
    )
    student_d_model: int | None = distill_option("student_d_model", "the student's width", int)
    student_layers: int | None = distill_option(
        "student_layers", "the student's transformer layers", int
    )
    student_heads: int | None = distill_option(
        "student_heads", "the student's attention heads", int
    )
    student_warmup_steps: int | None = distill_option(
        "student_warmup_steps",
        "the student's supervised warm-start steps (0: distil from scratch)",
        int,
    )
    distill_steps: int | None = distill_option("distill_steps", "on-policy distillation steps", int)
    distill_lr: float | None = distill_option(
        "distill_lr", "distillation learning rate (adamw, global-norm clipping 1.0)", float
    )
    divergence: str | None = distill_option(
        "divergence",
        "the per-token divergence from the teacher that the student minimises "
        "(linear_distill_loss; a served teacher, --teacher-topk K, takes only forward_kl and "
        "defaults to it)",
        str,
        choices=DIVERGENCES,
    )
    timing_runs: int | None = distill_option(
        "timing_runs",
        "timed runs of the distillation step with our loss (linear_distill_loss, "
        "or linear_topk_distill_loss) and with the materialised jnp loss, after a warm-up (the "
        "median is reported)",
        int,
    )
    teacher_topk: int | None = distill_option(
        "teacher_topk",
        "a served teacher: per answer token it returns only its K most likely "
        "ids and their log-probs (linear_topk_logprobs), and the student minimises the forward "
        "KL over them (linear_topk_distill_loss); 0: the whole-vocabulary teacher "
        "(linear_distill_loss)",
        int,
        metavar="K",
    )
    topk_tail: str | None = distill_option(
        "topk_tail",
        "with --teacher-topk: the forward KL over the K ids only (drop), or with "
        "the mass outside them as one more outcome (bucket)",
        str,
        choices=TOPK_TAILS,
    )

    def __post_init__(self):
        super().__post_init__()
        self._distill_fields()
        AdditionTask(digits=self.digits, held_out=self.held_out)  # raises on a bad task
        model_check_dims(self.d_model, self.layers, self.heads)
        for name, low in (
            ("warmup_steps", 0),
            ("warmup_batch", 1),
            ("steps", 1),
            ("batch_size", 1),
            ("lr_warmup", 0),
            ("seed", 0),
            ("eval_every", 1),
        ):
            algos.at_least(name, getattr(self, name), low)
        self._pack_fields()
        positive("warmup_lr", self.warmup_lr)
        positive("lr", self.lr)
        rollouts = self.batch_size * self.group_size
        if self.algo in algos.PPO_STYLE and rollouts % self.ppo_minibatches:
            raise ValueError(
                f"ppo_minibatches: expected a divisor of the rollout batch "
                f"batch_size * group_size = {rollouts}, got {self.ppo_minibatches}"
            )

    def _pack_fields(self) -> None:
        """``pack``: a bool, grpo only; ``pack_len``: room for the longest completion."""
        if not isinstance(self.pack, bool):
            raise ValueError(f"pack: expected True or False, got {self.pack!r}")
        longest = AdditionTask(digits=self.digits, held_out=self.held_out).seq_len
        algos.at_least("pack_len", self.pack_len, longest, "the longest prompt + answer")
        if self.pack and self.algo != "grpo":
            raise ValueError(f"pack: only --algo grpo packs its rollouts, got --algo {self.algo}")

    def _distill_fields(self) -> None:
        """Fill the distillation fields for ``--algo distill``; reject them for the others."""
        served = bool(self.teacher_topk)
        for name in algos.DISTILL_DEFAULTS:
            value = getattr(self, name)
            if self.algo != algos.DISTILL:
                if value is not None:
                    raise ValueError(
                        f"{name}: only --algo distill uses it, got {value!r} with "
                        f"--algo {self.algo}"
                    )
            elif value is None:  # frozen: set only while being built
                object.__setattr__(self, name, distill_default(name, served))
        if self.algo != algos.DISTILL:
            return
        try:
            model_check_dims(self.student_d_model, self.student_layers, self.student_heads)
        except ValueError as err:
            raise ValueError(f"student_{err}") from None
        for name, low in (
            ("student_warmup_steps", 0),
            ("distill_steps", 1),
            ("timing_runs", 1),
            ("teacher_topk", 0),
        ):
            algos.at_least(name, getattr(self, name), low)
        positive("distill_lr", self.distill_lr)
        self.distill_loss()  # raises on an unknown divergence
        self._served_teacher_fields()
        if self.resume is not None:
            raise ValueError(
                "resume: a distill run cannot be resumed (its checkpoint holds the "
                "teacher and the distilled student for inspection); run it again"
            )

    def _served_teacher_fields(self) -> None:
        """A served teacher (``teacher_topk`` K > 0): K at most the vocabulary, a tail, the
        forward KL; the whole-vocabulary teacher (K = 0): no tail."""
        if not self.teacher_topk:
            if self.topk_tail is not None:
                raise ValueError(
                    f"topk_tail: only a served teacher (--teacher-topk K > 0) uses "
                    f"it, got {self.topk_tail!r} with teacher_topk=0"
                )
            return
        if self.teacher_topk > VOCAB:
            raise ValueError(
                f"teacher_topk: expected at most the vocabulary's {VOCAB} tokens, "
                f"got {self.teacher_topk}"
            )
        try:
            self.topk_distill_loss()
        except ValueError as err:  # "tail: ..." (loss_agg_mode is checked already)
            raise ValueError(f"topk_{err}") from None
        if self.divergence != SERVED_DIVERGENCE:
            raise ValueError(
                f"divergence: a served teacher's loss (linear_topk_distill_loss) is "
                f"the forward KL over its top-K ids; expected "
                f"{SERVED_DIVERGENCE!r} with --teacher-topk, got "
                f"{self.divergence!r}"
            )

    def distill_loss(self) -> jk.DistillLoss:
        """The options of the whole-vocabulary loss, ``linear_distill_loss``'s ``config=``."""
        return jk.DistillLoss(divergence=self.divergence, loss_agg_mode=self.loss_agg_mode)

    def topk_distill_loss(self) -> jk.TopKDistillLoss | None:
        """The options of a served teacher's loss, ``linear_topk_distill_loss``'s ``config=``;
        None for the whole-vocabulary teacher (``teacher_topk`` 0)."""
        if not self.teacher_topk:
            return None
        return jk.TopKDistillLoss(tail=self.topk_tail, loss_agg_mode=self.loss_agg_mode)

    def teacher_config(self) -> Config:
        """The run that trains the teacher: this one with ``--algo grpo``, no distillation."""
        return dataclasses.replace(
            self, algo="grpo", **{name: None for name in algos.DISTILL_DEFAULTS}
        )

    def rl_config(self) -> algos.RLConfig:
        """The RL step's part: what the jitted RL program depends on."""
        return algos.RLConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(algos.RLConfig)}
        )


def resume_config(path: str, **changes: Any) -> Config:
    """The configuration to continue the run saved at ``path`` (its directory or checkpoint).

    ``changes`` are fields given for the resumed run: those in :data:`RESUMABLE` replace
    the saved ones (``out`` defaults to the checkpoint's directory); any other must equal
    the saved value, else ``ValueError`` names each conflict.
    """
    saved = checkpoint.load(path)
    base = _saved_config(saved)
    conflicts = [
        f"{flag_text(k, v)} (the checkpoint has {k}={getattr(base, k)})"
        for k, v in changes.items()
        if k not in RESUMABLE and v != getattr(base, k)
    ]
    if conflicts:
        raise ValueError(
            f"resume: a resumed run keeps the checkpoint's configuration; drop "
            f"{'; '.join(conflicts)}"
        )
    kept = {k: v for k, v in changes.items() if k in RESUMABLE}
    kept.setdefault("out", os.path.dirname(saved.path) or ".")
    cfg = dataclasses.replace(base, **kept, resume=saved.path)
    _check_resumable(cfg, saved)
    return cfg


def _saved_config(saved: checkpoint.Saved) -> Config:
    known = {f.name for f in dataclasses.fields(Config)}
    # Checkpoints written before --algo distill existed lack its fields, which are None there.
    saved_config = {**{name: None for name in algos.DISTILL_DEFAULTS}, **saved.config}
    # ... and checkpoints written before --pack lack its fields: they did not pack.
    saved_config = {"pack": False, "pack_len": Config.pack_len, **saved_config}
    if set(saved_config) != known:
        raise checkpoint.CheckpointError(
            f"{saved.path}: written by another version of the demo (its configuration has "
            f"fields {sorted(set(saved_config) ^ known)} that this version "
            "does not share)"
        )
    config = saved_config
    if config["algo"] not in algos.DUAL_CLIP_ALGOS:
        config["dual_clip"] = None  # earlier versions logged an unused 3.0 here
    return Config(**config)


def _check_resumable(cfg: Config, saved: checkpoint.Saved) -> None:
    """``cfg`` may continue ``saved``: same fixed fields, and steps left to take."""
    base = _saved_config(saved)
    differ = [
        f.name
        for f in dataclasses.fields(Config)
        if f.name not in RESUMABLE and getattr(cfg, f.name) != getattr(base, f.name)
    ]
    if differ:
        raise ValueError(
            f"resume: {', '.join(differ)} differ from the checkpoint's "
            "configuration; build the config with resume_config()"
        )
    if cfg.steps <= saved.step:
        raise ValueError(
            f"steps: the checkpoint has done {saved.step} RL steps and steps is the "
            f"total, so expected more than {saved.step}, got {cfg.steps}"
        )


# The jitted programs are cached by what they depend on, so building a second Demo
# with the same model and options (a resumed run, a notebook re-run, the tests) reuses
# the compiled programs instead of compiling them again.
