"""On-policy distillation of a smaller student from a grpo teacher (``--algo distill``): the run.

1. The teacher: the demo's default run (warm start, then ``grpo``) with the task, model and
   training fields of the configuration.
2. The student: a smaller model (``student_d_model``, ``student_layers``, ``student_heads``)
   with its own short supervised warm start on the same data (``student_warmup_steps``; 0
   starts from its random initialisation).
3. ``distill_steps`` steps of :func:`distill_step.make_distill_step`: the student samples
   answers, the frozen teacher scores them, and the student minimises
   ``linear_distill_loss`` (``config=cfg.distill_loss()``, over the whole vocabulary) or,
   with ``teacher_topk`` K > 0, a served teacher's ``linear_topk_distill_loss``
   (``config=cfg.topk_distill_loss()``, over its top-K ids). The divergence reported is the
   whole-vocabulary one to the teacher in both modes, so the two compare.
4. The same train step with the materialised jnp losses (``loss="materialised"``: both heads'
   logits, their log-softmaxes, ``lax.top_k`` for the served teacher) is timed against it on
   one batch (:func:`time_steps`); then the table, the log, the plot and a checkpoint.

What one step computes, the losses and the served teacher are
:mod:`jaxrl_kernels.demo.distill_step`'s; the table (:func:`~distill_report.format_table`) and
the plot (:func:`~distill_report.plot`) are :mod:`jaxrl_kernels.demo.distill_report`'s.

The loss runs on the ``chunked`` backend (the fused one) unless ``backend`` names another:
the automatic choice would pick ``reference``, the jnp oracle, for a vocabulary this small.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.demo import distill_report, loop, report, rl_step
from jaxrl_kernels.demo.config import Config
from jaxrl_kernels.demo.distill_step import LOSSES, make_distill_step
from jaxrl_kernels.demo.progress import Progress
from jaxrl_kernels.demo.task import AdditionTask

COMPARED = ("divergence", "topk_loss")  # the metrics the timed steps' two losses both compute
PHASE = 3  # the task's prompt stream for distillation (warm start 1, RL 0)


@functools.lru_cache(maxsize=16)
def _distill_program(
    student_key: tuple,
    teacher_key: tuple,
    task: AdditionTask,
    lr: float,
    warmup: int,
    options: tuple,
    loss: str,
):
    optimizer = rl_step.make_optimizer(lr, warmup=warmup)
    return optimizer, make_distill_step(
        loop._model(*student_key),
        loop._model(*teacher_key),
        task,
        optimizer,
        loss=loss,
        **dict(options),
    )


def distill_backend(cfg: Config) -> str:
    """The backend of the distillation ops in the demo (``linear_distill_loss``, and with a
    served teacher ``linear_topk_logprobs`` and ``linear_topk_distill_loss``): ``backend``,
    else ``chunked``."""
    return cfg.backend or "chunked"


def loss_op(cfg: Config) -> str:
    """The op the student minimises: ``linear_topk_distill_loss`` with a served teacher, else
    ``linear_distill_loss``."""
    return "linear_topk_distill_loss" if cfg.teacher_topk else "linear_distill_loss"


def student_config(cfg: Config) -> Config:
    """The student as a run of its own: the teacher's configuration with the student's sizes."""
    return dataclasses.replace(
        cfg.teacher_config(),
        d_model=cfg.student_d_model,
        layers=cfg.student_layers,
        heads=cfg.student_heads,
        warmup_steps=cfg.student_warmup_steps,
    )


def _size(cfg: Config, params) -> str:
    count = sum(x.size for x in jax.tree.leaves(params))
    return f"d={cfg.d_model} L={cfg.layers} H={cfg.heads}, {count / 1e3:,.0f}k params"


def time_steps(steps: dict[str, Callable], args: tuple, runs: int) -> dict[str, dict[str, float]]:
    """Each step function on the same ``args``: a first call (which compiles a function not yet
    compiled), a warm-up call, then ``runs`` calls interleaved between the functions, each
    synchronised with ``block_until_ready``; the median and the spread in milliseconds, and
    the metrics of :data:`COMPARED` that the steps compute."""
    out: dict[str, dict[str, float]] = {}
    for name, fn in steps.items():
        t0 = time.perf_counter()
        _, metrics = jax.block_until_ready(fn(*args))
        out[name] = {
            "first_call_s": time.perf_counter() - t0,
            **{k: float(metrics[k]) for k in COMPARED if k in metrics},
        }
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(1e3 * (time.perf_counter() - t0))
    for name, ms in times.items():
        out[name].update(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms))
    return out


def run(cfg: Config, *, progress: bool = True, stream: TextIO | None = None) -> dict[str, Any]:
    """Train the teacher, warm-start and distil the student, time both losses; returns the log
    (also written under ``cfg.out``)."""
    stream = stream if stream is not None else sys.stdout
    t_start = time.perf_counter()
    teacher_cfg = dataclasses.replace(cfg.teacher_config(), out=None)
    objective = distill_report.objective_text(cfg)
    print(
        f"teacher: {teacher_cfg.algo}, then on-policy distillation ({objective}) "
        "of a smaller student",
        file=stream,
    )
    log = loop.run(teacher_cfg, progress=progress, stream=stream)
    teacher_params = log.pop("state")["params"]
    teacher_summary = log.pop("summary")
    teacher_seconds = time.perf_counter() - t_start
    log["config"] = dataclasses.asdict(cfg)
    log["teacher_summary"] = teacher_summary

    # The student: its own warm start (same data as the teacher's), then distillation.
    student = loop.Demo(student_config(cfg))
    t0 = time.perf_counter()
    if cfg.student_warmup_steps:
        warm_log: dict[str, Any] = {"warm_start": []}
        params = loop._warm_start(student, warm_log, progress)[0]["params"]
        log["student_warm_start"] = warm_log["warm_start"]
    else:
        params = student.init_params()
        log["student_warm_start"] = []
    warm_seconds = time.perf_counter() - t0

    task, scfg = student.task, student.cfg
    student_key = (task.seq_len - 1, scfg.d_model, scfg.layers, scfg.heads, scfg.tie_embeddings)
    teacher_key = (task.seq_len - 1, cfg.d_model, cfg.layers, cfg.heads, cfg.tie_embeddings)
    options = (
        ("group_size", cfg.group_size),
        ("temperature", cfg.temperature),
        ("config", cfg.distill_loss()),
        ("backend", distill_backend(cfg)),
        ("teacher_topk", cfg.teacher_topk),
        ("topk_config", cfg.topk_distill_loss()),
    )
    programs = {
        loss: _distill_program(
            student_key, teacher_key, task, cfg.distill_lr, cfg.lr_warmup, options, loss
        )
        for loss in LOSSES
    }
    optimizer, step_fn = programs["jaxrl"]
    key = jax.random.fold_in(jax.random.key(cfg.seed), PHASE)

    def inputs(step):
        prompts, sums = task.train_batch(cfg.seed, step, cfg.batch_size, phase=PHASE)
        return prompts, sums, jax.random.fold_in(key, step)

    before = student.evaluate(params)
    log["student_evals"] = [{"step": 0, **loop._round(before)}]
    log["distill"] = []
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "step": jnp.zeros((), jnp.int32),
    }
    label = f"distill top-{cfg.teacher_topk}" if cfg.teacher_topk else "distill"
    bar = Progress(cfg.distill_steps, f"{label} {cfg.divergence}", enabled=progress)
    t0 = time.perf_counter()
    last = before
    for step in range(cfg.distill_steps):
        t1 = time.perf_counter()
        state, metrics = step_fn(state, teacher_params, *inputs(step))
        metrics = {k: float(v) for k, v in metrics.items()}
        if step == 0:
            first_step_seconds = time.perf_counter() - t1
        log["distill"].append({"step": step + 1, **loop._round(metrics)})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.distill_steps:
            last = student.evaluate(state["params"])
            log["student_evals"].append({"step": step + 1, **loop._round(last)})
        bar.update(
            step + 1,
            divergence=metrics["divergence"],
            acc=metrics["accuracy"],
            held_out=last["accuracy"],
        )
    bar.close()
    distill_seconds = time.perf_counter() - t0
    after = student.evaluate(state["params"])

    # Both train steps on the first distillation batch, from the distilled student's state.
    timing = time_steps(
        {loss: fn for loss, (_, fn) in programs.items()},
        (state, teacher_params, *inputs(0)),
        cfg.timing_runs,
    )

    divergences = [r["divergence"] for r in log["distill"]]
    peak, peak_kind = loop.peak_memory()
    summary = {
        "algo": cfg.algo,
        "divergence": cfg.divergence,
        "teacher_topk": cfg.teacher_topk,
        "topk_tail": cfg.topk_tail,
        "distill_loss_op": loss_op(cfg),
        "device": teacher_summary["device"],
        "jax_version": jax.__version__,
        "distill_loss_backend": distill_backend(cfg),
        "teacher": _size(cfg, teacher_params),
        "student": _size(scfg, params),
        "teacher_held_out_accuracy_warm_start": teacher_summary["held_out_accuracy_before"],
        "teacher_held_out_accuracy": teacher_summary["held_out_accuracy_after"],
        "teacher_held_out_reward": teacher_summary["held_out_reward_after"],
        "teacher_sampled_reward": teacher_summary["sampled_reward_after"],
        "student_held_out_accuracy_before": before["accuracy"],
        "student_held_out_accuracy_after": after["accuracy"],
        "student_held_out_reward_before": before["reward"],
        "student_held_out_reward_after": after["reward"],
        "student_sampled_reward_before": before["sampled_reward"],
        "student_sampled_reward_after": after["sampled_reward"],
        "divergence_first10": float(np.mean(divergences[:10])),
        "divergence_last10": float(np.mean(divergences[-10:])),
        "distill_step_ms_jaxrl": timing["jaxrl"]["median_ms"],
        "distill_step_ms_materialised": timing["materialised"]["median_ms"],
        "distill_step_timing": {loss: loop._round(t) for loss, t in timing.items()},
        "distill_step_timing_runs": cfg.timing_runs,
        "distill_first_step_seconds": first_step_seconds,
        **{
            f"distill_step_{k}_difference": abs(timing["jaxrl"][k] - timing["materialised"][k])
            for k in COMPARED
            if k in timing["jaxrl"]
        },
        **(served_summary(log["distill"]) if cfg.teacher_topk else {}),
        "teacher_seconds": teacher_seconds,
        "student_warm_start_seconds": warm_seconds,
        "distill_seconds": distill_seconds,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "wall_seconds": time.perf_counter() - t_start,
    }
    log["summary"] = loop._round(summary)
    print(distill_report.format_table(summary, cfg), file=stream)

    both = {"teacher": teacher_params, "student": state}
    report.write_outputs(cfg.out, log, both, distill_report.plot, stream)
    log["state"] = both
    return log


def served_summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """A served teacher's distillation: the top-K loss the student minimised (first and last 10
    steps) and the teacher's mean probability in its K ids."""
    loss = [r["topk_loss"] for r in steps]
    return {
        "topk_loss_first10": float(np.mean(loss[:10])),
        "topk_loss_last10": float(np.mean(loss[-10:])),
        "teacher_topk_mass": float(np.mean([r["teacher_topk_mass"] for r in steps])),
    }
