"""What an ``--algo distill`` run reports: the table it prints and its plot.

:func:`objective_text` (what the student minimises, in words; also the run's first line),
:func:`format_table` (the teacher against the student before and after distillation, and the
timed distillation steps) and :func:`plot` (four panels of the run's log). The run and its
summary are :mod:`jaxrl_kernels.demo.distill`'s; the files under ``out`` are written by
:func:`jaxrl_kernels.demo.report.write_outputs`.
"""

from __future__ import annotations

from typing import Any

from jaxrl_kernels.demo import report
from jaxrl_kernels.demo.config import Config


def objective_text(cfg: Config) -> str:
    """What the student minimises, in words: ``reverse_kl``, or ``forward_kl over the served
    teacher's top-4 ids, tail drop``."""
    if not cfg.teacher_topk:
        return cfg.divergence
    return (
        f"{cfg.divergence} over the served teacher's top-{cfg.teacher_topk} ids, "
        f"tail {cfg.topk_tail}"
    )


def format_table(s: dict[str, Any], cfg: Config) -> str:
    def pct(x):
        return f"{100 * x:6.1f} %"

    w = 16
    gain = s["student_held_out_accuracy_after"] - s["student_held_out_accuracy_before"]
    rows = [
        (
            "held-out accuracy (greedy)",
            pct(s["teacher_held_out_accuracy"]),
            pct(s["student_held_out_accuracy_before"]),
            pct(s["student_held_out_accuracy_after"]),
            f"{100 * gain:+.1f} pts",
        ),
        (
            "held-out reward (greedy)",
            f"{s['teacher_held_out_reward']:.3f}",
            f"{s['student_held_out_reward_before']:.3f}",
            f"{s['student_held_out_reward_after']:.3f}",
            f"{s['student_held_out_reward_after'] - s['student_held_out_reward_before']:+.3f}",
        ),
        (
            f"held-out reward (T={cfg.temperature:g})",
            f"{s['teacher_sampled_reward']:.3f}",
            f"{s['student_sampled_reward_before']:.3f}",
            f"{s['student_sampled_reward_after']:.3f}",
            f"{s['student_sampled_reward_after'] - s['student_sampled_reward_before']:+.3f}",
        ),
        (
            f"{cfg.divergence} to the teacher (first / last 10 steps)",
            "",
            f"{s['divergence_first10']:.4f}",
            f"{s['divergence_last10']:.4f}",
            "",
        ),
    ]
    if cfg.teacher_topk:
        rows.append(
            (
                f"top-{cfg.teacher_topk} {cfg.divergence}, {cfg.topk_tail} (first / last 10 steps)",
                "",
                f"{s['topk_loss_first10']:.4f}",
                f"{s['topk_loss_last10']:.4f}",
                "",
            )
        )
    t = s["distill_step_timing"]
    ratio = s["distill_step_ms_materialised"] / s["distill_step_ms_jaxrl"]
    lines = [
        f"jaxrl_kernels demo: distill ({objective_text(cfg)}) on {cfg.digits}-digit addition | "
        f"teacher {s['teacher']} (grpo) -> student {s['student']} | device {s['device']} | "
        f"distillation loss backend {s['distill_loss_backend']}",
        f"{'':52s}{'teacher':>{w}s}{'student before':>{w}s}{'student after':>{w}s}{'change':>{w}s}",
    ]
    lines += [f"{a:52s}{b:>{w}s}{c:>{w}s}{d:>{w}s}{e:>{w}s}" for a, b, c, d, e in rows]
    if cfg.teacher_topk:
        lines.append(
            f"{'served teacher (linear_topk_logprobs)':52s}top-{cfg.teacher_topk} ids "
            f"and log-probs per token, {100 * s['teacher_topk_mass']:.1f} % of its "
            "probability (mean)"
        )
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
    ax0.set(xlabel="warm-start step", ylabel="NLL per answer token", title="supervised warm starts")
    ax0.legend(fontsize=8)
    rl = log["rl"]
    ax1.plot([r["step"] for r in rl], [r["reward"] for r in rl], lw=0.8)
    ax1.set(xlabel="grpo step", ylabel="mean sampled reward", title="the teacher's grpo")
    dist, cfg = log["distill"], log["config"]
    ax2.plot(
        [r["step"] for r in dist], [r["divergence"] for r in dist], lw=0.8, label="whole vocabulary"
    )
    if cfg["teacher_topk"]:
        ax2.plot(
            [r["step"] for r in dist],
            [r["topk_loss"] for r in dist],
            lw=0.8,
            label=f"served top-{cfg['teacher_topk']}, tail {cfg['topk_tail']} (minimised)",
        )
        ax2.legend(fontsize=8)
    ax2.set(
        xlabel="distillation step",
        ylabel="mean per token",
        title=f"student's {cfg['divergence']} to the teacher (on-policy)",
    )
    ev = log["student_evals"]
    ax3.plot(
        [e["step"] for e in ev], [100 * e["accuracy"] for e in ev], "o-", ms=3, label="student"
    )
    ax3.axhline(
        100 * log["teacher_summary"]["held_out_accuracy_after"],
        color="gray",
        ls="--",
        label="teacher",
    )
    ax3.set(
        xlabel="distillation step (0 = after the student's warm start)",
        ylabel="accuracy (%)",
        title="held-out accuracy (greedy)",
    )
    ax3.legend(fontsize=8)
    served = f", served top-{cfg['teacher_topk']}" if cfg["teacher_topk"] else ""
    report.save_figure(
        fig, path, f"jaxrl_kernels demo: distill ({cfg['divergence']}{served}), seed {cfg['seed']}"
    )
