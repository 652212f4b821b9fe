"""What a run of an RL algorithm reports: the table it prints, its plot, and its files.

:func:`format_table` is the table printed at the end of a run, :func:`plot` the figure of its
log (both of the RL algorithms' run, :func:`jaxrl_kernels.demo.loop.run`); :func:`save_figure`
and :func:`write_outputs` (``log.json``, ``curves.png`` and the checkpoint under ``out``) are
shared with ``--algo distill``, whose table and plot are
:mod:`jaxrl_kernels.demo.distill_report`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxrl_kernels.demo import checkpoint
from jaxrl_kernels.demo.config import Config


def format_table(s: dict[str, Any], cfg: Config) -> str:
    def pct(x):
        return f"{100 * x:6.1f} %"

    rows = [
        (
            "held-out accuracy (greedy)",
            pct(s["held_out_accuracy_before"]),
            pct(s["held_out_accuracy_after"]),
            f"{100 * (s['held_out_accuracy_after'] - s['held_out_accuracy_before']):+.1f} pts",
        ),
        (
            "held-out reward (greedy)",
            f"{s['held_out_reward_before']:8.3f}",
            f"{s['held_out_reward_after']:8.3f}",
            f"{s['held_out_reward_after'] - s['held_out_reward_before']:+.3f}",
        ),
        (
            f"held-out reward (T={cfg.temperature:g})",
            f"{s['sampled_reward_before']:8.3f}",
            f"{s['sampled_reward_after']:8.3f}",
            f"{s['sampled_reward_after'] - s['sampled_reward_before']:+.3f}",
        ),
        (
            "train reward (first / last 10 steps)",
            f"{s['train_reward_first']:8.3f}",
            f"{s['train_reward_last10']:8.3f}",
            "",
        ),
    ]
    lines = [
        f"jaxrl_kernels demo: {cfg.algo} on {cfg.digits}-digit addition | model d={cfg.d_model} "
        f"L={cfg.layers} H={cfg.heads} | device {s['device']} | ops backend {s['backend']}",
        f"{'':38s}{'warm start':>12s}{'after RL':>12s}{'change':>12s}",
    ]
    lines += [f"{a:38s}{b:>12s}{c:>12s}{d:>12s}" for a, b, c, d in rows]
    if s["tokens_per_second"] is None:
        throughput = (
            f"one step this run, {s['rl_first_step_seconds']:.1f} s including "
            "compilation (no steady-state rate)"
        )
    else:
        throughput = (
            f"{s['tokens_per_second']:,.0f} sampled tokens/s ({s['rl_step_ms']:.1f} "
            f"ms/step; first step incl. compile {s['rl_first_step_seconds']:.1f} s)"
        )
    if s["resumed_from_step"] is None:
        phases = f"warm start {s['warm_start_seconds']:.1f} s"
    else:
        n = s["rl_steps_this_run"]
        phases = f"resumed at RL step {s['resumed_from_step']}, {n} step{'s' * (n != 1)} this run"
    lines += [f"{'RL throughput':38s}{throughput}"]
    if "padding_fraction_packed" in s:  # --pack: the two layouts of the same completions
        lines += [
            f"{'padding, padded -> packed':38s}{pct(s['padding_fraction_padded']).strip()} of "
            f"{s['rows_padded']} rows x {s['row_len_padded']} tokens -> "
            f"{pct(s['padding_fraction_packed']).strip()} of "
            f"{s['rows_packed_mean']:.1f} rows x {s['pack_len']} tokens (mean per step)",
            f"{'update, padded -> packed':38s}{s['update_ms_padded']:.2f} ms -> "
            f"{s['update_ms_packed']:.2f} ms (median of {s['pack_timing_runs']}, one rollout)",
        ]
    lines += [
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
    ax0.set(xlabel="warm-start step", ylabel="NLL per answer token", title="supervised warm start")
    steps = [r["step"] for r in log["rl"]]
    rewards = [r["reward"] for r in log["rl"]]
    ax1.plot(steps, rewards, lw=0.8, alpha=0.5, label="train (sampled)")
    if len(steps) >= 10:
        smooth = np.convolve(rewards, np.ones(10) / 10, mode="valid")
        ax1.plot(steps[9:], smooth, lw=1.6, label="train, 10-step mean")
    ev = log["evals"]
    ax1.plot(
        [e["step"] for e in ev],
        [e["sampled_reward"] for e in ev],
        "o-",
        ms=3,
        label="held-out (sampled)",
    )
    ax1.set(xlabel="RL step", ylabel="mean reward", title="reward")
    ax2.plot([e["step"] for e in ev], [100 * e["accuracy"] for e in ev], "o-", ms=3)
    ax2.set(
        xlabel="RL step (0 = after the warm start)",
        ylabel="accuracy (%)",
        title="held-out accuracy (greedy)",
    )
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


def write_outputs(out: str | None, log: dict[str, Any], state: Any, plot_fn, stream) -> None:
    """``out``/log.json, ``out``/curves.png (``plot_fn(log, path)``) and the checkpoint of
    ``state``; nothing without ``out``."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    plot_fn(log, os.path.join(out, "curves.png"))
    checkpoint.save(
        os.path.join(out, checkpoint.FILENAME), state, config=log["config"], history=log
    )
    print(f"wrote {out}/log.json, {out}/curves.png, {out}/{checkpoint.FILENAME}", file=stream)
