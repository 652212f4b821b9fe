"""The demo's training loop: warm start, RL, evaluation, report.

1. Supervised warm start: ``warmup_steps`` steps of teacher-forced NLL on correct
   answers (deliberately short, so the policy is right only part of the time).
2. RL up to ``steps`` steps in total of the chosen algorithm (see :mod:`algos`)
   on prompts drawn from the training pool; each step's prompts and sampling
   key are a pure function of ``(seed, step)``, so a run resumed from a
   checkpoint takes the same steps as an uninterrupted one.
3. Held-out evaluation (greedy decoding on prompts training never sees) before
   RL, every ``eval_every`` steps and at the end; a final table; with ``out``,
   a JSON log, a PNG plot and a checkpoint holding the state, the
   configuration and the log, which :func:`resume_config` and :func:`run`
   continue (a resumed run skips the warm start and extends the log).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import resource
import sys
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import validation as check
from jaxrl_kernels.demo import algos, checkpoint
from jaxrl_kernels.demo.algos import option
from jaxrl_kernels.demo.model import CausalLM
from jaxrl_kernels.demo.model import check_dims as model_check_dims
from jaxrl_kernels.demo.progress import Progress
from jaxrl_kernels.demo.task import EOS, VOCAB, AdditionTask
from jaxrl_kernels.divergence_math import DIVERGENCES


TASK, TRAINING, RUN = "task and model", "training", "run"
DISTILLATION = "distillation (--algo distill)"
RESUMABLE = ("steps", "eval_every", "out", "backend", "resume")
"""The fields a resumed run may change; every other one comes from the checkpoint."""


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
    return option(None, f"{help} [{algos.DISTILL_DEFAULTS[name]}]", type=kind,
                  group=DISTILLATION, **meta)


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
    tie_embeddings: bool = option(True, "LM head tied to the [V, D] token embedding (layout "
                                        "'vd'); else a separate [D, V] head (layout 'dv')",
                                  group=TASK)
    warmup_steps: int = option(350, "supervised warm-start steps, kept short on purpose",
                               group=TRAINING)
    warmup_batch: int = option(64, "warm-start batch size", group=TRAINING)
    warmup_lr: float = option(1e-3, "warm-start learning rate", group=TRAINING)
    steps: int = option(800, "RL steps in total, counting those a resumed checkpoint has done",
                        group=TRAINING)
    batch_size: int = option(16, "prompts per RL step", group=TRAINING)
    lr: float = option(5e-4, "RL learning rate (adamw, global-norm clipping 1.0)",
                       group=TRAINING)
    lr_warmup: int = option(20, "RL steps over which the learning rate ramps up from 0",
                            group=TRAINING)
    seed: int = option(0, "random seed", group=TRAINING)
    eval_every: int = option(50, "held-out evaluation every this many RL steps", group=RUN)
    out: str | None = option(None, "write log.json, curves.png and checkpoint.msgpack to this "
                                   "directory; with --resume, the checkpoint's directory when "
                                   "not given", group=RUN, metavar="DIR")
    resume: str | None = option(None, "continue a run: its --out directory or its "
                                      "checkpoint.msgpack; the configuration comes from the "
                                      "checkpoint, and only " + ", ".join(
                                          flag_text(n, "") for n in RESUMABLE[:-1])
                                      + " may differ (not for --algo distill)", group=RUN,
                                      metavar="PATH")
    student_d_model: int | None = distill_option("student_d_model", "the student's width",
                                                 int)
    student_layers: int | None = distill_option("student_layers", "the student's transformer "
                                                "layers", int)
    student_heads: int | None = distill_option("student_heads", "the student's attention "
                                               "heads", int)
    student_warmup_steps: int | None = distill_option(
        "student_warmup_steps", "the student's supervised warm-start steps (0: distil from "
        "scratch)", int)
    distill_steps: int | None = distill_option("distill_steps", "on-policy distillation steps",
                                               int)
    distill_lr: float | None = distill_option("distill_lr", "distillation learning rate "
                                              "(adamw, global-norm clipping 1.0)", float)
    divergence: str | None = distill_option(
        "divergence", "the per-token divergence from the teacher that the student minimises "
        "(linear_distill_loss)", str, choices=DIVERGENCES)
    timing_runs: int | None = distill_option(
        "timing_runs", "timed runs of the distillation step with linear_distill_loss and with "
        "the materialised jnp loss, after a warm-up (the median is reported)", int)

    def __post_init__(self):
        super().__post_init__()
        self._distill_fields()
        AdditionTask(digits=self.digits, held_out=self.held_out)  # raises on a bad task
        model_check_dims(self.d_model, self.layers, self.heads)
        for name, low in (("warmup_steps", 0), ("warmup_batch", 1), ("steps", 1),
                          ("batch_size", 1), ("lr_warmup", 0), ("seed", 0), ("eval_every", 1)):
            algos.at_least(name, getattr(self, name), low)
        check.positive("warmup_lr", self.warmup_lr)
        check.positive("lr", self.lr)
        rollouts = self.batch_size * self.group_size
        if self.algo in algos.PPO_STYLE and rollouts % self.ppo_minibatches:
            raise ValueError(f"ppo_minibatches: expected a divisor of the rollout batch "
                             f"batch_size * group_size = {rollouts}, got {self.ppo_minibatches}")

    def _distill_fields(self) -> None:
        """Fill the distillation fields for ``--algo distill``; reject them for the others."""
        for name, default in algos.DISTILL_DEFAULTS.items():
            value = getattr(self, name)
            if self.algo != algos.DISTILL:
                if value is not None:
                    raise ValueError(f"{name}: only --algo distill uses it, got {value!r} with "
                                     f"--algo {self.algo}")
            elif value is None:
                object.__setattr__(self, name, default)  # frozen: only while being built
        if self.algo != algos.DISTILL:
            return
        try:
            model_check_dims(self.student_d_model, self.student_layers, self.student_heads)
        except ValueError as err:
            raise ValueError(f"student_{err}") from None
        for name, low in (("student_warmup_steps", 0), ("distill_steps", 1),
                          ("timing_runs", 1)):
            algos.at_least(name, getattr(self, name), low)
        check.positive("distill_lr", self.distill_lr)
        check.option("divergence", self.divergence, DIVERGENCES)
        if self.resume is not None:
            raise ValueError("resume: a distill run cannot be resumed (its checkpoint holds the "
                             "teacher and the distilled student for inspection); run it again")

    def teacher_config(self) -> Config:
        """The run that trains the teacher: this one with ``--algo grpo``, no distillation."""
        return dataclasses.replace(self, algo="grpo",
                                   **{name: None for name in algos.DISTILL_DEFAULTS})

    def rl_config(self) -> algos.RLConfig:
        """The RL step's part: what the jitted RL program depends on."""
        return algos.RLConfig(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(algos.RLConfig)})


def resume_config(path: str, **changes: Any) -> Config:
    """The configuration to continue the run saved at ``path`` (its directory or checkpoint).

    ``changes`` are fields given for the resumed run: those in :data:`RESUMABLE` replace
    the saved ones (``out`` defaults to the checkpoint's directory); any other must equal
    the saved value, else ``ValueError`` names each conflict.
    """
    saved = checkpoint.load(path)
    base = _saved_config(saved)
    conflicts = [f"{flag_text(k, v)} (the checkpoint has {k}={getattr(base, k)})"
                 for k, v in changes.items() if k not in RESUMABLE and v != getattr(base, k)]
    if conflicts:
        raise ValueError(f"resume: a resumed run keeps the checkpoint's configuration; drop "
                         f"{'; '.join(conflicts)}")
    kept = {k: v for k, v in changes.items() if k in RESUMABLE}
    kept.setdefault("out", os.path.dirname(saved.path) or ".")
    cfg = dataclasses.replace(base, **kept, resume=saved.path)
    _check_resumable(cfg, saved)
    return cfg


def _saved_config(saved: checkpoint.Saved) -> Config:
    known = {f.name for f in dataclasses.fields(Config)}
    # Checkpoints written before --algo distill existed lack its fields, which are None there.
    saved_config = {**{name: None for name in algos.DISTILL_DEFAULTS}, **saved.config}
    if set(saved_config) != known:
        raise checkpoint.CheckpointError(
            f"{saved.path}: written by another version of the demo (its configuration has "
            f"fields {sorted(set(saved_config) ^ known)} that this version "
            "does not share)")
    config = saved_config
    if config["algo"] not in algos.DUAL_CLIP_ALGOS:
        config["dual_clip"] = None  # earlier versions logged an unused 3.0 here
    return Config(**config)


def _check_resumable(cfg: Config, saved: checkpoint.Saved) -> None:
    """``cfg`` may continue ``saved``: same fixed fields, and steps left to take."""
    base = _saved_config(saved)
    differ = [f.name for f in dataclasses.fields(Config)
              if f.name not in RESUMABLE and getattr(cfg, f.name) != getattr(base, f.name)]
    if differ:
        raise ValueError(f"resume: {', '.join(differ)} differ from the checkpoint's "
                         "configuration; build the config with resume_config()")
    if cfg.steps <= saved.step:
        raise ValueError(f"steps: the checkpoint has done {saved.step} RL steps and steps is the "
                         f"total, so expected more than {saved.step}, got {cfg.steps}")


# The jitted programs are cached by what they depend on, so building a second Demo
# with the same model and options (a resumed run, a notebook re-run, the tests) reuses
# the compiled programs instead of compiling them again.
@functools.lru_cache(maxsize=32)
def _model(max_len: int, d_model: int, layers: int, heads: int, tie: bool) -> CausalLM:
    return CausalLM(vocab=VOCAB, max_len=max_len, d_model=d_model, layers=layers, heads=heads,
                    tie_embeddings=tie)


@functools.lru_cache(maxsize=32)
def _init_program(model_key: tuple):
    return jax.jit(_model(*model_key).init)


@functools.lru_cache(maxsize=32)
def _sft_program(model_key: tuple, lr: float, backend: str | None):
    optimizer = algos.make_optimizer(lr)
    return optimizer, algos.make_sft_step(_model(*model_key), optimizer, backend=backend)


@functools.lru_cache(maxsize=32)
def _rl_program(model_key: tuple, task: AdditionTask, lr: float, warmup_updates: int,
                rl_cfg: algos.RLConfig):
    optimizer = algos.make_optimizer(lr, warmup=warmup_updates)
    return optimizer, algos.make_rl_step(_model(*model_key), task, optimizer, rl_cfg)


@functools.lru_cache(maxsize=32)
def _eval_program(model_key: tuple, task: AdditionTask, temperature: float):
    return algos.make_evaluate(_model(*model_key), task, temperature=temperature)


class Demo:
    """Everything a run needs: task, model, jitted steps, held-out set."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.task = AdditionTask(digits=cfg.digits, held_out=cfg.held_out)
        model_key = (self.task.seq_len - 1, cfg.d_model, cfg.layers, cfg.heads,
                     cfg.tie_embeddings)
        self.lm = _model(*model_key)
        self.init_fn = _init_program(model_key)
        self.sft_optimizer, self.sft_step = _sft_program(model_key, cfg.warmup_lr, cfg.backend)
        updates_per_step = (cfg.ppo_epochs * cfg.ppo_minibatches if cfg.algo in algos.PPO_STYLE
                            else 1)
        self.rl_optimizer, self.rl_step = _rl_program(
            model_key, self.task, cfg.lr, cfg.lr_warmup * updates_per_step, cfg.rl_config())
        self.evaluate_fn = _eval_program(model_key, self.task, cfg.temperature)
        self.held_prompts, self.held_sums = self.task.held_out_set()
        self.eval_key = jax.random.fold_in(jax.random.key(cfg.seed), 2**31 - 1)

    def init_params(self):
        dummy = jnp.zeros((1, self.task.seq_len - 1), jnp.int32)
        return self.init_fn(jax.random.key(self.cfg.seed), dummy)

    def init_state(self, params) -> algos.State:
        return {"params": params, "opt_state": self.rl_optimizer.init(params),
                "ref_params": params, "step": jnp.zeros((), jnp.int32)}

    def evaluate(self, params, prompts=None, sums=None) -> dict[str, float]:
        """Metrics on the held-out set (or on the given prompts), with a fixed sampling key."""
        if prompts is None:
            prompts, sums = self.held_prompts, self.held_sums
        out = self.evaluate_fn(params, prompts, sums, self.eval_key)
        return {k: float(v) for k, v in out.items()}

    def sft_batch(self, step: int):
        prompts, sums = self.task.train_batch(self.cfg.seed, step, self.cfg.warmup_batch,
                                              phase=1)
        answers = self.task.answer_tokens(sums)
        ends = np.argmax(answers == EOS, axis=1)
        mask = (np.arange(answers.shape[1])[None, :] <= ends[:, None]).astype(np.float32)
        return prompts, answers, mask

    def rl_inputs(self, step: int):
        prompts, sums = self.task.train_batch(self.cfg.seed, step, self.cfg.batch_size)
        return prompts, sums, jax.random.fold_in(jax.random.key(self.cfg.seed), step)

    def step(self, state: algos.State, step: int):
        """RL step number ``step`` (0-based) from ``state``."""
        return self.rl_step(state, *self.rl_inputs(step))


def peak_memory() -> tuple[float, str]:
    """Peak memory in bytes and what was measured."""
    stats = None
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # some backends do not implement memory_stats
        stats = None
    if stats and "peak_bytes_in_use" in stats:
        kind = f"{jax.default_backend()} device memory_stats peak_bytes_in_use"
        return float(stats["peak_bytes_in_use"]), kind
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return float(rss * scale), "process max RSS (getrusage; no device memory_stats)"


def _round(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


def run(cfg: Config, *, progress: bool = True, stream: TextIO | None = None) -> dict[str, Any]:
    """Run the demo end to end; returns the log (also written under ``cfg.out``).

    With ``cfg.resume`` (build such a config with :func:`resume_config`) the run continues
    the checkpoint's: its state, and its log, which the new steps extend. ``--algo distill``
    runs :func:`jaxrl_kernels.demo.distill.run`.
    """
    if cfg.algo == algos.DISTILL:
        from jaxrl_kernels.demo import distill
        return distill.run(cfg, progress=progress, stream=stream)
    stream = stream if stream is not None else sys.stdout
    t_start = time.perf_counter()
    demo = Demo(cfg)
    if cfg.resume:
        saved = checkpoint.load(cfg.resume)
        _check_resumable(cfg, saved)
        state = checkpoint.restore(saved, demo.init_state(demo.init_params()))
        log = saved.history
        log["resumed_at"] = log.get("resumed_at", []) + [saved.step]
        warm_seconds = None
    else:
        log = {"warm_start": [], "rl": [], "evals": [], "resumed_at": []}
        state, warm_seconds = _warm_start(demo, log, progress)
    log["config"] = dataclasses.asdict(cfg)
    first = int(state["step"])

    before = demo.evaluate(state["ref_params"])
    if not cfg.resume:
        log["evals"].append({"step": 0, **_round(before)})
    last = log["evals"][-1]
    bar = Progress(cfg.steps - first, f"RL {cfg.algo}", enabled=progress)
    step_seconds, compile_seconds, tokens = 0.0, 0.0, 0.0
    for step in range(first, cfg.steps):
        t0 = time.perf_counter()
        state, metrics = demo.step(state, step)
        metrics = {k: float(v) for k, v in metrics.items()}
        dt = time.perf_counter() - t0
        if step == first:
            compile_seconds = dt
        else:
            step_seconds += dt
            tokens += metrics["tokens"]
        log["rl"].append({"step": step + 1, **_round(metrics)})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            last = demo.evaluate(state["params"])
            log["evals"].append({"step": step + 1, **_round(last)})
        bar.update(step + 1 - first, reward=metrics["reward"], acc=metrics["accuracy"],
                   held_out=last["accuracy"])
    bar.close()
    after = demo.evaluate(state["params"])

    peak, peak_kind = peak_memory()
    summary = {
        "algo": cfg.algo,
        "device": f"{jax.default_backend()} ({jax.local_devices()[0].device_kind})",
        "jax_version": jax.__version__,
        "backend": cfg.backend or "automatic",
        "python": platform.python_version(),
        "held_out_accuracy_before": before["accuracy"],
        "held_out_accuracy_after": after["accuracy"],
        "held_out_reward_before": before["reward"],
        "held_out_reward_after": after["reward"],
        "sampled_reward_before": before["sampled_reward"],
        "sampled_reward_after": after["sampled_reward"],
        "train_reward_first": log["rl"][0]["reward"],
        "train_reward_last10": float(np.mean([r["reward"] for r in log["rl"][-10:]])),
        "rl_steps_this_run": cfg.steps - first,
        "resumed_from_step": first if cfg.resume else None,
        "tokens_per_second": tokens / step_seconds if step_seconds > 0 else None,
        "rl_step_ms": 1e3 * step_seconds / (cfg.steps - first - 1) if step_seconds > 0 else None,
        "rl_first_step_seconds": compile_seconds,
        "warm_start_seconds": warm_seconds,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "wall_seconds": time.perf_counter() - t_start,
    }
    log["summary"] = _round(summary)
    print(format_table(summary, cfg), file=stream)

    write_outputs(cfg.out, log, state, plot, stream)
    log["state"] = state
    return log


def write_outputs(out: str | None, log: dict[str, Any], state: Any, plot_fn, stream) -> None:
    """``out``/log.json, ``out``/curves.png (``plot_fn(log, path)``) and the checkpoint of
    ``state``; nothing without ``out``."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    plot_fn(log, os.path.join(out, "curves.png"))
    checkpoint.save(os.path.join(out, checkpoint.FILENAME), state, config=log["config"],
                    history=log)
    print(f"wrote {out}/log.json, {out}/curves.png, {out}/{checkpoint.FILENAME}", file=stream)


def _warm_start(demo: Demo, log: dict[str, Any], progress: bool) -> tuple[algos.State, float]:
    """The supervised warm start; returns the initial RL state and its duration in seconds."""
    cfg = demo.cfg
    params = demo.init_params()
    opt_state = demo.sft_optimizer.init(params)
    bar = Progress(cfg.warmup_steps, "warm start", enabled=progress)
    t0 = time.perf_counter()
    for i in range(cfg.warmup_steps):
        params, opt_state, loss = demo.sft_step(params, opt_state, *demo.sft_batch(i))
        if (i + 1) % 10 == 0 or i + 1 == cfg.warmup_steps:
            loss = float(loss)
            log["warm_start"].append({"step": i + 1, "nll": loss})
            bar.update(i + 1, nll=loss)
    bar.close()
    jax.block_until_ready(params)
    return demo.init_state(params), time.perf_counter() - t0


def format_table(s: dict[str, Any], cfg: Config) -> str:
    def pct(x):
        return f"{100 * x:6.1f} %"

    rows = [
        ("held-out accuracy (greedy)", pct(s["held_out_accuracy_before"]),
         pct(s["held_out_accuracy_after"]),
         f"{100 * (s['held_out_accuracy_after'] - s['held_out_accuracy_before']):+.1f} pts"),
        ("held-out reward (greedy)", f"{s['held_out_reward_before']:8.3f}",
         f"{s['held_out_reward_after']:8.3f}",
         f"{s['held_out_reward_after'] - s['held_out_reward_before']:+.3f}"),
        (f"held-out reward (T={cfg.temperature:g})", f"{s['sampled_reward_before']:8.3f}",
         f"{s['sampled_reward_after']:8.3f}",
         f"{s['sampled_reward_after'] - s['sampled_reward_before']:+.3f}"),
        ("train reward (first / last 10 steps)", f"{s['train_reward_first']:8.3f}",
         f"{s['train_reward_last10']:8.3f}", ""),
    ]
    lines = [
        f"jaxrl_kernels demo: {cfg.algo} on {cfg.digits}-digit addition | model d={cfg.d_model} "
        f"L={cfg.layers} H={cfg.heads} | device {s['device']} | ops backend {s['backend']}",
        f"{'':38s}{'warm start':>12s}{'after RL':>12s}{'change':>12s}",
    ]
    lines += [f"{a:38s}{b:>12s}{c:>12s}{d:>12s}" for a, b, c, d in rows]
    if s["tokens_per_second"] is None:
        throughput = (f"one step this run, {s['rl_first_step_seconds']:.1f} s including "
                      "compilation (no steady-state rate)")
    else:
        throughput = (f"{s['tokens_per_second']:,.0f} sampled tokens/s ({s['rl_step_ms']:.1f} "
                      f"ms/step; first step incl. compile {s['rl_first_step_seconds']:.1f} s)")
    if s["resumed_from_step"] is None:
        phases = f"warm start {s['warm_start_seconds']:.1f} s"
    else:
        n = s["rl_steps_this_run"]
        phases = f"resumed at RL step {s['resumed_from_step']}, {n} step{'s' * (n != 1)} this run"
    lines += [
        f"{'RL throughput':38s}{throughput}",
        f"{'peak memory':38s}{s['peak_memory_bytes'] / 2**20:,.0f} MiB ({s['peak_memory_kind']})",
        f"{'wall time':38s}{s['wall_seconds']:.1f} s ({phases})",
    ]
    return "\n".join(lines)


def plot(log: dict[str, Any], path: str) -> None:
    """Three panels: the warm start's NLL, the RL reward, held-out accuracy; resumes marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(14, 3.8))
    warm = log["warm_start"]
    ax0.plot([w["step"] for w in warm], [w["nll"] for w in warm], "o-", ms=2)
    ax0.set(xlabel="warm-start step", ylabel="NLL per answer token",
            title="supervised warm start")
    steps = [r["step"] for r in log["rl"]]
    rewards = [r["reward"] for r in log["rl"]]
    ax1.plot(steps, rewards, lw=0.8, alpha=0.5, label="train (sampled)")
    if len(steps) >= 10:
        smooth = np.convolve(rewards, np.ones(10) / 10, mode="valid")
        ax1.plot(steps[9:], smooth, lw=1.6, label="train, 10-step mean")
    ev = log["evals"]
    ax1.plot([e["step"] for e in ev], [e["sampled_reward"] for e in ev], "o-", ms=3,
             label="held-out (sampled)")
    ax1.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax2.plot([e["step"] for e in ev], [100 * e["accuracy"] for e in ev], "o-", ms=3)
    ax2.set(xlabel="RL step (0 = after the warm start)", ylabel="accuracy (%)",
            title="held-out accuracy (greedy)")
    for ax in (ax1, ax2):
        for i, step in enumerate(log.get("resumed_at", [])):
            ax.axvline(step, color="gray", ls=":", lw=1, label="resumed" if i == 0 else None)
    ax1.legend(fontsize=8)
    cfg = log["config"]
    save_figure(fig, path, f"jaxrl_kernels demo: {cfg['algo']}, seed {cfg['seed']}")


def save_figure(fig, path: str, title: str) -> None:
    """A demo figure titled, laid out, written at 110 dpi and closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
