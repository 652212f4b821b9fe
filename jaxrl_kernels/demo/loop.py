"""The demo's training loop for the RL algorithms: warm start, RL, evaluation, report.

1. Supervised warm start: ``warmup_steps`` steps of teacher-forced NLL on correct
   answers (deliberately short, so the policy is right only part of the time).
2. RL up to ``steps`` steps in total of the chosen algorithm (:mod:`algos`, :mod:`rl_losses`)
   on prompts drawn from the training pool; each step's prompts and sampling
   key are a pure function of ``(seed, step)``, so a run resumed from a
   checkpoint takes the same steps as an uninterrupted one.
3. Held-out evaluation (greedy decoding on prompts training never sees) before
   RL, every ``eval_every`` steps and at the end; a final table; with ``out``,
   a JSON log, a PNG plot and a checkpoint holding the state, the
   configuration and the log, which :func:`run` continues when given a
   configuration from :func:`~jaxrl_kernels.demo.config.resume_config` (a
   resumed run skips the warm start and extends the log).

The configuration (:class:`Config`) is :mod:`jaxrl_kernels.demo.config`'s, the jitted steps
:mod:`jaxrl_kernels.demo.rl_step`'s, and the table, the plot and the files under ``out``
:mod:`jaxrl_kernels.demo.report`'s.
:func:`jaxrl_kernels.demo.train.run` calls :func:`run` for the RL algorithms;
:mod:`jaxrl_kernels.demo.distill` uses it to train its teacher and this module's
``Demo`` for its student.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.demo import algos, checkpoint, packed_step, report, rl_step, sampling
from jaxrl_kernels.demo.config import Config, _check_resumable
from jaxrl_kernels.demo.model import CausalLM
from jaxrl_kernels.demo.progress import Progress
from jaxrl_kernels.demo.task import EOS, VOCAB, AdditionTask


@functools.lru_cache(maxsize=32)
def _model(max_len: int, d_model: int, layers: int, heads: int, tie: bool) -> CausalLM:
    return CausalLM(
        vocab=VOCAB,
        max_len=max_len,
        d_model=d_model,
        layers=layers,
        heads=heads,
        tie_embeddings=tie,
    )


@functools.lru_cache(maxsize=32)
def _init_program(model_key: tuple):
    return jax.jit(_model(*model_key).init)


@functools.lru_cache(maxsize=32)
def _sft_program(model_key: tuple, lr: float, backend: str | None):
    optimizer = rl_step.make_optimizer(lr)
    return optimizer, rl_step.make_sft_step(_model(*model_key), optimizer, backend=backend)


@functools.lru_cache(maxsize=32)
def _rl_program(
    model_key: tuple, task: AdditionTask, lr: float, warmup_updates: int, rl_cfg: algos.RLConfig
):
    optimizer = rl_step.make_optimizer(lr, warmup=warmup_updates)
    return optimizer, rl_step.make_rl_step(_model(*model_key), task, optimizer, rl_cfg)


@functools.lru_cache(maxsize=32)
def _packed_program(
    model_key: tuple,
    task: AdditionTask,
    lr: float,
    warmup_updates: int,
    rl_cfg: algos.RLConfig,
    pack_len: int,
):
    optimizer = rl_step.make_optimizer(lr, warmup=warmup_updates)
    return optimizer, packed_step.PackedStep(_model(*model_key), task, optimizer, rl_cfg, pack_len)


def make_evaluate(lm, task: AdditionTask, *, temperature: float = 1.0) -> Callable:
    """Jitted held-out evaluation: greedy accuracy and reward, and a sampled reward."""

    @jax.jit
    def evaluate(params, prompts, sums, key):
        n = prompts.shape[0]
        greedy = jnp.arange(2 * n) < n  # one decode: greedy rows, then sampled rows
        tokens, _, _ = sampling.generate(
            lm,
            params,
            jnp.concatenate([prompts, prompts]),
            key,
            max_new=task.max_new,
            temperature=temperature,
            greedy=greedy,
        )
        g = task.score(tokens[:n], sums)
        s = task.score(tokens[n:], sums)
        return {
            "accuracy": jnp.mean(g["correct"]),
            "reward": jnp.mean(g["reward"]),
            "well_formed": jnp.mean(g["well_formed"]),
            "sampled_accuracy": jnp.mean(s["correct"]),
            "sampled_reward": jnp.mean(s["reward"]),
        }

    return evaluate


@functools.lru_cache(maxsize=32)
def _eval_program(model_key: tuple, task: AdditionTask, temperature: float):
    return make_evaluate(_model(*model_key), task, temperature=temperature)


class Demo:
    """Everything a run needs: task, model, jitted steps, held-out set."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.task = AdditionTask(digits=cfg.digits, held_out=cfg.held_out)
        model_key = (self.task.seq_len - 1, cfg.d_model, cfg.layers, cfg.heads, cfg.tie_embeddings)
        self.lm = _model(*model_key)
        self.init_fn = _init_program(model_key)
        self.sft_optimizer, self.sft_step = _sft_program(model_key, cfg.warmup_lr, cfg.backend)
        updates_per_step = (
            cfg.ppo_epochs * cfg.ppo_minibatches if cfg.algo in algos.PPO_STYLE else 1
        )
        program = (
            functools.partial(_packed_program, pack_len=cfg.pack_len) if cfg.pack else _rl_program
        )
        self.rl_optimizer, self.rl_step = program(
            model_key, self.task, cfg.lr, cfg.lr_warmup * updates_per_step, cfg.rl_config()
        )
        self.evaluate_fn = _eval_program(model_key, self.task, cfg.temperature)
        self.held_prompts, self.held_sums = self.task.held_out_set()
        self.eval_key = jax.random.fold_in(jax.random.key(cfg.seed), 2**31 - 1)

    def init_params(self):
        dummy = jnp.zeros((1, self.task.seq_len - 1), jnp.int32)
        return self.init_fn(jax.random.key(self.cfg.seed), dummy)

    def init_state(self, params) -> algos.State:
        return {
            "params": params,
            "opt_state": self.rl_optimizer.init(params),
            "ref_params": params,
            "step": jnp.zeros((), jnp.int32),
        }

    def evaluate(self, params, prompts=None, sums=None) -> dict[str, float]:
        """Metrics on the held-out set (or on the given prompts), with a fixed sampling key."""
        if prompts is None:
            prompts, sums = self.held_prompts, self.held_sums
        out = self.evaluate_fn(params, prompts, sums, self.eval_key)
        return {k: float(v) for k, v in out.items()}

    def sft_batch(self, step: int):
        prompts, sums = self.task.train_batch(self.cfg.seed, step, self.cfg.warmup_batch, phase=1)
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
    """Run an RL algorithm's demo end to end; returns the log (also written under ``cfg.out``).

    With ``cfg.resume`` (build such a config with
    :func:`jaxrl_kernels.demo.config.resume_config`) the run continues the checkpoint's: its
    state, and its log, which the new steps extend.
    """
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
        # With --pack, the padding fraction of the padded layout and of the packed one.
        pad = (
            {"pad": f"{metrics['pad_padded']:.2f}->{metrics['pad_packed']:.2f}"} if cfg.pack else {}
        )
        bar.update(
            step + 1 - first,
            reward=metrics["reward"],
            acc=metrics["accuracy"],
            held_out=last["accuracy"],
            **pad,
        )
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
    if cfg.pack:
        summary.update(_pack_summary(demo, state, log["rl"][first:]))
    log["summary"] = _round(summary)
    print(report.format_table(summary, cfg), file=stream)

    report.write_outputs(cfg.out, log, state, report.plot, stream)
    log["state"] = state
    return log


PACK_TIMING_RUNS = 10
"""Timed calls of each layout's update in a ``--pack`` run's summary (the median is reported)."""


def _pack_summary(demo: Demo, state: algos.State, steps: list[dict]) -> dict[str, Any]:
    """A ``--pack`` run's layouts: the mean padding fraction of each over this run's steps,
    the mean number of packed rows, and each layout's update timed on one more rollout."""
    mean = lambda k: float(np.mean([r[k] for r in steps]))
    timing = demo.rl_step.time_updates(
        state, *demo.rl_inputs(demo.cfg.steps), runs=PACK_TIMING_RUNS
    )
    return {
        "pack_len": demo.cfg.pack_len,
        "padding_fraction_padded": mean("pad_padded"),
        "padding_fraction_packed": mean("pad_packed"),
        "rows_padded": demo.cfg.batch_size * demo.cfg.group_size,
        "row_len_padded": demo.task.seq_len,
        "pack_timing_runs": PACK_TIMING_RUNS,
        "rows_packed_mean": mean("rows"),
        **timing,
    }


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
