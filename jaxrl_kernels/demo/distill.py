"""On-policy distillation of a smaller student from a grpo teacher (``--algo distill``).

1. The teacher: the demo's default run (warm start, then ``grpo``) with the task, model and
   training fields of the configuration.
2. The student: a smaller model (``student_d_model``, ``student_layers``, ``student_heads``)
   with its own short supervised warm start on the same data (``student_warmup_steps``; 0
   starts from its random initialisation).
3. ``distill_steps`` steps, each one jitted function: the student samples ``group_size``
   answers to each of ``batch_size`` training prompts with :func:`sampling.generate`, the
   frozen teacher runs forward on those answers (``stop_gradient``), and the student takes an
   adamw step on ``linear_distill_loss(student_hidden, student_head, teacher_hidden,
   teacher_head, mask, divergence=...)``: the teacher scores every token over the whole
   vocabulary, and neither model's ``[B, T, V]`` logits are built.
4. The same train step with :func:`materialised_distill_loss` (both heads' logits, their
   log-softmaxes, the same divergence, in plain jnp) is timed against it on one batch.

With ``teacher_topk`` K > 0 the teacher is served, as when it runs in an inference server:
per answer token it returns only its K most likely ids and their log-probs
(:func:`served_teacher`: ``linear_topk_logprobs`` on its hidden states and head, without
gradient), and the student minimises the forward KL over those ids,
``linear_topk_distill_loss(student_hidden, student_head, ids, logp, mask, tail=...)``. The
divergence reported is still the whole-vocabulary one to the teacher, measured on the same
tokens, so the two modes compare; the timed jnp step materialises both heads' logits, takes
the teacher's top-K with ``lax.top_k`` and the loss with :func:`materialised_topk_distill_loss`.

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

import jaxrl_kernels as jrk
from jaxrl_kernels.demo import algos, loop, sampling
from jaxrl_kernels.demo import model as model_lib
from jaxrl_kernels.demo.config import Config
from jaxrl_kernels.demo.progress import Progress
from jaxrl_kernels.demo.task import AdditionTask

LOSSES = ("jaxrl", "materialised")
COMPARED = ("divergence", "topk_loss")  # the metrics the timed steps' two losses both compute
PHASE = 3  # the task's prompt stream for distillation (warm start 1, RL 0)
_LOG_TINY = float(np.log(np.finfo(np.float32).tiny))


def materialised_log_probs(hidden, weight, layout, temperature):
    """``log_softmax(hidden·Wᵀ / temperature)``: the ``[B, T, V]`` logits in the inputs' dtype,
    the log-softmax in float32."""
    z = jnp.einsum("btd,vd->btv" if layout == "vd" else "btd,dv->btv", hidden, weight)
    return jax.nn.log_softmax(z.astype(jnp.float32) / temperature, axis=-1)


def materialised_distill_loss(hidden, weight, teacher_hidden, teacher_weight, mask, *,
                              divergence="reverse_kl", jsd_beta=0.5, temperature=1.0,
                              weight_layout="vd", teacher_weight_layout="vd",
                              loss_agg_mode="token_mean"):
    """``linear_distill_loss`` in plain jnp: both heads' ``[B, T, V]`` logits (in the inputs'
    dtype, bf16 or float32), float32 log-softmaxes, the divergence per token."""
    ls = materialised_log_probs(hidden, weight, weight_layout, temperature)
    lt = materialised_log_probs(teacher_hidden, teacher_weight, teacher_weight_layout,
                                temperature)
    ps, pt = jnp.exp(ls), jnp.exp(lt)
    if divergence == "reverse_kl":
        d = jnp.sum(ps * (ls - lt), axis=-1)
    elif divergence == "forward_kl":
        d = jnp.sum(pt * (lt - ls), axis=-1)
    else:
        lm = jnp.logaddexp(jnp.log(jsd_beta) + lt, jnp.log1p(-jsd_beta) + ls)
        d = jnp.sum(jsd_beta * pt * (lt - lm) + (1 - jsd_beta) * ps * (ls - lm), axis=-1)
    d = jnp.where(mask != 0, d, 0.0)
    return jrk.aggregate(d, mask, loss_agg_mode), d


def materialised_topk_distill_loss(hidden, weight, teacher_ids, teacher_logp, mask, *,
                                   tail="drop", temperature=1.0, weight_layout="vd",
                                   loss_agg_mode="token_mean"):
    """``linear_topk_distill_loss`` in plain jnp: the student's ``[B, T, V]`` log-softmax
    gathered at the teacher's ids, per token ``Σ_k p_t,k (log p_t,k − log p_s,k)`` over the
    valid ids (``>= 0``), plus with ``tail="bucket"`` ``r_t (log r_t − log r_s)`` with
    ``r = 1 − Σ_k p,k`` (0 where ``r_t <= 0``; ``log r_s`` at least log of float32's smallest
    normal)."""
    valid = (teacher_ids >= 0) & (mask != 0)[..., None]
    ls = jnp.take_along_axis(materialised_log_probs(hidden, weight, weight_layout, temperature),
                             jnp.maximum(teacher_ids, 0), axis=-1)
    pt = jnp.where(valid, jnp.exp(teacher_logp.astype(jnp.float32)), 0.0)
    lt = jnp.where(pt > 0, teacher_logp.astype(jnp.float32), 0.0)
    d = jnp.sum(pt * (lt - ls), axis=-1)
    if tail == "bucket":
        r_t = 1.0 - jnp.sum(pt, axis=-1)
        r_s = 1.0 - jnp.sum(jnp.where(valid, jnp.exp(ls), 0.0), axis=-1)
        normal = r_s > np.exp(_LOG_TINY)
        log_r_s = jnp.where(normal, jnp.log(jnp.where(normal, r_s, 1.0)), _LOG_TINY)
        some = r_t > 0
        d = d + jnp.where(some, r_t * (jnp.log(jnp.where(some, r_t, 1.0)) - log_r_s), 0.0)
    d = jnp.where(mask != 0, d, 0.0)
    return jrk.aggregate(d, mask, loss_agg_mode), d


def served_teacher(hidden, weight, k: int, *, weight_layout: str, temperature: float,
                   backend: str | None, loss: str = "jaxrl") -> tuple[jax.Array, jax.Array]:
    """A served teacher's reply: per position its ``k`` most likely ids and their log-probs
    ``log softmax(hidden·Wᵀ / temperature)`` at those ids, ``([B, T, k] float32, [B, T, k]
    int32)``, without gradient; through ``linear_topk_logprobs`` (``loss="jaxrl"``, no logits
    built) or ``lax.top_k`` of the materialised log-softmax."""
    if loss == "jaxrl":
        logp, ids, _ = jrk.linear_topk_logprobs(hidden, weight, k, weight_layout=weight_layout,
                                                temperature=temperature, backend=backend)
    else:
        logp, ids = jax.lax.top_k(materialised_log_probs(hidden, weight, weight_layout,
                                                         temperature), k)
    return jax.lax.stop_gradient(logp), ids.astype(jnp.int32)


def _losses(loss: str, backend: str | None, *, divergence: str, tail: str | None,
            temperature: float, loss_agg_mode: str) -> tuple[Callable, Callable]:
    """``(whole_vocabulary, top_k)``: ``linear_distill_loss`` and ``linear_topk_distill_loss``
    (``loss="jaxrl"``) or their materialised jnp versions, with the run's options."""
    common = dict(temperature=temperature, loss_agg_mode=loss_agg_mode)
    if loss == "jaxrl":
        whole = functools.partial(jrk.linear_distill_loss, backend=backend)
        topk = functools.partial(jrk.linear_topk_distill_loss, backend=backend)
    else:
        whole, topk = materialised_distill_loss, materialised_topk_distill_loss
    return (functools.partial(whole, divergence=divergence, **common),
            functools.partial(topk, tail=tail, **common))


def make_distill_step(student: model_lib.CausalLM, teacher: model_lib.CausalLM,
                      task: AdditionTask, optimizer, *, group_size: int, temperature: float,
                      divergence: str, loss_agg_mode: str, backend: str | None,
                      teacher_topk: int = 0, topk_tail: str | None = None,
                      loss: str = "jaxrl") -> Callable:
    """The jitted step ``(state, teacher_params, prompts[n, P], sums[n], key) -> (state,
    metrics)``; ``state`` is the student's ``{"params", "opt_state", "step"}``.

    With ``teacher_topk`` K = 0 the student minimises ``divergence`` to the teacher over the
    whole vocabulary. With K > 0 the teacher is served (:func:`served_teacher`) and the
    student minimises the forward KL over its top-K ids, ``topk_loss`` in the metrics (with
    ``teacher_topk_mass``, the teacher's probability in those ids, mean per answer token).
    ``divergence`` in the metrics is the whole-vocabulary one in both modes, on the step's
    tokens before the update."""
    whole, topk = _losses(loss, backend, divergence=divergence, tail=topk_tail,
                          temperature=temperature, loss_agg_mode=loss_agg_mode)

    def step(state, teacher_params, prompts, sums, key):
        prompts = jnp.repeat(prompts, group_size, axis=0)
        sums = jnp.repeat(sums, group_size, axis=0)
        actions, _, mask = sampling.generate(student, state["params"], prompts, key,
                                             max_new=task.max_new, temperature=temperature)
        sg = jax.lax.stop_gradient
        teacher_hidden = sg(algos.answer_hidden(teacher, teacher_params, prompts, actions))
        teacher_weight, teacher_layout = model_lib.head_weight(teacher_params,
                                                               teacher.tie_embeddings)
        teacher_weight = sg(teacher_weight)

        def whole_vocabulary(hidden, weight, layout):
            return whole(hidden, weight, teacher_hidden, teacher_weight, mask,
                         weight_layout=layout, teacher_weight_layout=teacher_layout)

        if teacher_topk:
            logp_t, ids_t = served_teacher(teacher_hidden, teacher_weight, teacher_topk,
                                           weight_layout=teacher_layout,
                                           temperature=temperature, backend=backend, loss=loss)
            trained = lambda hidden, weight, layout: topk(hidden, weight, ids_t, logp_t, mask,
                                                          weight_layout=layout)
        else:
            trained = whole_vocabulary

        def objective(params):
            weight, layout = model_lib.head_weight(params, student.tie_embeddings)
            hidden = algos.answer_hidden(student, params, prompts, actions)
            value, per_token = trained(hidden, weight, layout)
            return value, (per_token, hidden)

        (value, (per_token, hidden)), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"])
        if teacher_topk:
            weight, layout = model_lib.head_weight(state["params"], student.tie_embeddings)
            whole_value, whole_per_token = whole_vocabulary(sg(hidden), weight, layout)
            metrics = {"divergence": whole_value, "divergence_max": jnp.max(whole_per_token),
                       "topk_loss": value, "topk_loss_max": jnp.max(per_token),
                       "teacher_topk_mass": jrk.aggregate(jnp.sum(jnp.exp(logp_t), axis=-1),
                                                          mask, "token_mean")}
        else:
            metrics = {"divergence": value, "divergence_max": jnp.max(per_token)}
        params, opt_state = algos._apply(optimizer, state["params"], state["opt_state"], grads)
        scores = task.score(actions, sums)
        metrics.update(reward=jnp.mean(scores["reward"]), accuracy=jnp.mean(scores["correct"]),
                       tokens=jnp.sum(mask))
        return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), metrics

    return jax.jit(step)


@functools.lru_cache(maxsize=16)
def _distill_program(student_key: tuple, teacher_key: tuple, task: AdditionTask, lr: float,
                     warmup: int, options: tuple, loss: str):
    optimizer = algos.make_optimizer(lr, warmup=warmup)
    return optimizer, make_distill_step(loop._model(*student_key), loop._model(*teacher_key),
                                        task, optimizer, loss=loss, **dict(options))


def distill_backend(cfg: Config) -> str:
    """The backend of the distillation ops in the demo (``linear_distill_loss``, and with a
    served teacher ``linear_topk_logprobs`` and ``linear_topk_distill_loss``): ``backend``,
    else ``chunked``."""
    return cfg.backend or "chunked"


def loss_op(cfg: Config) -> str:
    """The op the student minimises: ``linear_topk_distill_loss`` with a served teacher, else
    ``linear_distill_loss``."""
    return "linear_topk_distill_loss" if cfg.teacher_topk else "linear_distill_loss"


def objective_text(cfg: Config) -> str:
    """What the student minimises, in words: ``reverse_kl``, or ``forward_kl over the served
    teacher's top-4 ids, tail drop``."""
    if not cfg.teacher_topk:
        return cfg.divergence
    return (f"{cfg.divergence} over the served teacher's top-{cfg.teacher_topk} ids, "
            f"tail {cfg.topk_tail}")


def student_config(cfg: Config) -> Config:
    """The student as a run of its own: the teacher's configuration with the student's sizes."""
    return dataclasses.replace(cfg.teacher_config(), d_model=cfg.student_d_model,
                               layers=cfg.student_layers, heads=cfg.student_heads,
                               warmup_steps=cfg.student_warmup_steps)


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
        out[name] = {"first_call_s": time.perf_counter() - t0,
                     **{k: float(metrics[k]) for k in COMPARED if k in metrics}}
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


def run(cfg: Config, *, progress: bool = True, stream: TextIO | None = None
        ) -> dict[str, Any]:
    """Train the teacher, warm-start and distil the student, time both losses; returns the log
    (also written under ``cfg.out``)."""
    stream = stream if stream is not None else sys.stdout
    t_start = time.perf_counter()
    teacher_cfg = dataclasses.replace(cfg.teacher_config(), out=None)
    print(f"teacher: {teacher_cfg.algo}, then on-policy distillation ({objective_text(cfg)}) "
          "of a smaller student", file=stream)
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
    options = (("group_size", cfg.group_size), ("temperature", cfg.temperature),
               ("divergence", cfg.divergence), ("loss_agg_mode", cfg.loss_agg_mode),
               ("backend", distill_backend(cfg)), ("teacher_topk", cfg.teacher_topk),
               ("topk_tail", cfg.topk_tail))
    programs = {loss: _distill_program(student_key, teacher_key, task, cfg.distill_lr,
                                       cfg.lr_warmup, options, loss) for loss in LOSSES}
    optimizer, step_fn = programs["jaxrl"]
    key = jax.random.fold_in(jax.random.key(cfg.seed), PHASE)

    def inputs(step):
        prompts, sums = task.train_batch(cfg.seed, step, cfg.batch_size, phase=PHASE)
        return prompts, sums, jax.random.fold_in(key, step)

    before = student.evaluate(params)
    log["student_evals"] = [{"step": 0, **loop._round(before)}]
    log["distill"] = []
    state = {"params": params, "opt_state": optimizer.init(params),
             "step": jnp.zeros((), jnp.int32)}
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
        bar.update(step + 1, divergence=metrics["divergence"], acc=metrics["accuracy"],
                   held_out=last["accuracy"])
    bar.close()
    distill_seconds = time.perf_counter() - t0
    after = student.evaluate(state["params"])

    # Both train steps on the first distillation batch, from the distilled student's state.
    timing = time_steps({loss: fn for loss, (_, fn) in programs.items()},
                        (state, teacher_params, *inputs(0)), cfg.timing_runs)

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
        **{f"distill_step_{k}_difference": abs(timing["jaxrl"][k] - timing["materialised"][k])
           for k in COMPARED if k in timing["jaxrl"]},
        **(served_summary(log["distill"]) if cfg.teacher_topk else {}),
        "teacher_seconds": teacher_seconds,
        "student_warm_start_seconds": warm_seconds,
        "distill_seconds": distill_seconds,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "wall_seconds": time.perf_counter() - t_start,
    }
    log["summary"] = loop._round(summary)
    print(format_table(summary, cfg), file=stream)

    both = {"teacher": teacher_params, "student": state}
    loop.write_outputs(cfg.out, log, both, plot, stream)
    log["state"] = both
    return log


def served_summary(steps: list[dict[str, float]]) -> dict[str, float]:
    """A served teacher's distillation: the top-K loss the student minimised (first and last 10
    steps) and the teacher's mean probability in its K ids."""
    loss = [r["topk_loss"] for r in steps]
    return {"topk_loss_first10": float(np.mean(loss[:10])),
            "topk_loss_last10": float(np.mean(loss[-10:])),
            "teacher_topk_mass": float(np.mean([r["teacher_topk_mass"] for r in steps]))}


def format_table(s: dict[str, Any], cfg: Config) -> str:
    def pct(x):
        return f"{100 * x:6.1f} %"

    w = 16
    gain = s["student_held_out_accuracy_after"] - s["student_held_out_accuracy_before"]
    rows = [
        ("held-out accuracy (greedy)", pct(s["teacher_held_out_accuracy"]),
         pct(s["student_held_out_accuracy_before"]), pct(s["student_held_out_accuracy_after"]),
         f"{100 * gain:+.1f} pts"),
        ("held-out reward (greedy)", f"{s['teacher_held_out_reward']:.3f}",
         f"{s['student_held_out_reward_before']:.3f}", f"{s['student_held_out_reward_after']:.3f}",
         f"{s['student_held_out_reward_after'] - s['student_held_out_reward_before']:+.3f}"),
        (f"held-out reward (T={cfg.temperature:g})", f"{s['teacher_sampled_reward']:.3f}",
         f"{s['student_sampled_reward_before']:.3f}", f"{s['student_sampled_reward_after']:.3f}",
         f"{s['student_sampled_reward_after'] - s['student_sampled_reward_before']:+.3f}"),
        (f"{cfg.divergence} to the teacher (first / last 10 steps)", "",
         f"{s['divergence_first10']:.4f}", f"{s['divergence_last10']:.4f}", ""),
    ]
    if cfg.teacher_topk:
        rows.append((f"top-{cfg.teacher_topk} {cfg.divergence}, {cfg.topk_tail} "
                     "(first / last 10 steps)", "", f"{s['topk_loss_first10']:.4f}",
                     f"{s['topk_loss_last10']:.4f}", ""))
    t = s["distill_step_timing"]
    ratio = s["distill_step_ms_materialised"] / s["distill_step_ms_jaxrl"]
    lines = [
        f"jaxrl_kernels demo: distill ({objective_text(cfg)}) on {cfg.digits}-digit addition | "
        f"teacher {s['teacher']} (grpo) -> student {s['student']} | device {s['device']} | "
        f"distillation loss backend {s['distill_loss_backend']}",
        f"{'':52s}{'teacher':>{w}s}{'student before':>{w}s}{'student after':>{w}s}"
        f"{'change':>{w}s}",
    ]
    lines += [f"{a:52s}{b:>{w}s}{c:>{w}s}{d:>{w}s}{e:>{w}s}" for a, b, c, d, e in rows]
    if cfg.teacher_topk:
        lines.append(f"{'served teacher (linear_topk_logprobs)':52s}top-{cfg.teacher_topk} ids "
                     f"and log-probs per token, {100 * s['teacher_topk_mass']:.1f} % of its "
                     "probability (mean)")
    runs = f"median of {cfg.timing_runs} runs after a warm-up"
    lines += [
        f"{'distillation step, ' + s['distill_loss_op']:52s}{t['jaxrl']['median_ms']:.2f} ms "
        f"({runs}; first training step incl. compile {s['distill_first_step_seconds']:.1f} s)",
        f"{'distillation step, materialised jnp loss':52s}"
        f"{t['materialised']['median_ms']:.2f} ms ({ratio:.2f}x ours; first call incl. "
        f"compile {t['materialised']['first_call_s']:.1f} s)",
        f"{'peak memory':52s}{s['peak_memory_bytes'] / 2**20:,.0f} MiB ({s['peak_memory_kind']})",
        f"{'wall time':52s}{s['wall_seconds']:.1f} s (teacher {s['teacher_seconds']:.1f} s, "
        f"student warm start {s['student_warm_start_seconds']:.1f} s, distillation "
        f"{s['distill_seconds']:.1f} s)",
    ]
    return "\n".join(lines)


def plot(log: dict[str, Any], path: str) -> None:
    """Four panels: both warm starts' NLL, the teacher's grpo reward, the divergence per
    distillation step (with a served teacher, also the top-K loss minimised), held-out
    accuracy of the teacher and the student."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax0, ax1), (ax2, ax3)) = plt.subplots(2, 2, figsize=(11, 7))
    for name, warm in (("teacher", log["warm_start"]), ("student", log["student_warm_start"])):
        ax0.plot([w["step"] for w in warm], [w["nll"] for w in warm], "o-", ms=2, label=name)
    ax0.set(xlabel="warm-start step", ylabel="NLL per answer token",
            title="supervised warm starts")
    ax0.legend(fontsize=8)
    rl = log["rl"]
    ax1.plot([r["step"] for r in rl], [r["reward"] for r in rl], lw=0.8)
    ax1.set(xlabel="grpo step", ylabel="mean sampled reward", title="the teacher's grpo")
    dist, cfg = log["distill"], log["config"]
    ax2.plot([r["step"] for r in dist], [r["divergence"] for r in dist], lw=0.8,
             label="whole vocabulary")
    if cfg["teacher_topk"]:
        ax2.plot([r["step"] for r in dist], [r["topk_loss"] for r in dist], lw=0.8,
                 label=f"served top-{cfg['teacher_topk']}, tail {cfg['topk_tail']} (minimised)")
        ax2.legend(fontsize=8)
    ax2.set(xlabel="distillation step", ylabel="mean per token",
            title=f"student's {cfg['divergence']} to the teacher (on-policy)")
    ev = log["student_evals"]
    ax3.plot([e["step"] for e in ev], [100 * e["accuracy"] for e in ev], "o-", ms=3,
             label="student")
    ax3.axhline(100 * log["teacher_summary"]["held_out_accuracy_after"], color="gray", ls="--",
                label="teacher")
    ax3.set(xlabel="distillation step (0 = after the student's warm start)",
            ylabel="accuracy (%)", title="held-out accuracy (greedy)")
    ax3.legend(fontsize=8)
    served = f", served top-{cfg['teacher_topk']}" if cfg["teacher_topk"] else ""
    loop.save_figure(fig, path, f"jaxrl_kernels demo: distill ({cfg['divergence']}{served}), "
                                 f"seed {cfg['seed']}")
