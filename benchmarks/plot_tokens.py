"""Draw ``bench_tokens.json`` with matplotlib: microseconds per token against the token count N.

One panel per (D, V) of the file; a line per implementation with times (every impl of the
file, the peers of ``--peers`` included; a row with an ``error`` and no times draws nothing);
the GEMM floor dashed (the three GEMMs of a forward+backward that keeps the logits, measured
in the same run) and the lean mode's own floor (4/3 of it: lean computes the logits twice)
dotted. The x axis is N on a log scale (base 2), the y axis each row's ``us_per_token``; the
y range stops at 4× the floor's smallest value, so that the floor stays readable. The footer
carries the file's device, date, jax version and commit. A file whose every (D, V) has one N (the
realistic batch's ``--sizes realistic_pair``) draws bars instead: a panel per size, a bar per
implementation with its time as × the plain jnp bf16 code of the same size (``x_jnp``), the
padded fraction in the title. The output's format follows its extension (``.svg``, ``.png``,
``.pdf``); an SVG keeps its text as text and no date, so the same file draws the same bytes.

    python -m benchmarks.plot_tokens benchmarks/results/bench_tokens_peers_eb186a5.json docs/tokens.svg
    python -m benchmarks.plot_tokens \
        benchmarks/results/bench_tokens_realistic_pad35_peers_45b9994.json docs/tokens_realistic.svg
"""

from __future__ import annotations

import json
import pathlib
import sys

STYLE = {  # impl: (colour, matplotlib line style)
    "ours lean": ("#1f77b4", "-"),
    "ours fast": ("#2ca02c", "-"),
    "ours fast, XLA logits": ("#98df8a", (0, (4, 3))),  # the same op, forward kernel withheld
    "ours fast, logits kept": ("#2ca02c", (0, (1, 2))),  # the same op, relative form withheld
    "jnp bf16": ("#d62728", "-"),
    "torch bf16": ("#ff7f0e", "-"),
    "QuACK chunked": ("#8c564b", "-"),  # the peers (bench_tokens --peers): cross-entropy
    "Liger": ("#e377c2", "-"),
    "ours default": ("#000000", "-"),
    "Liger, per-token": ("#e377c2", (0, (4, 3))),
    "CCE": ("#17becf", "-"),
    "CCE, no filtering": ("#17becf", (0, (4, 3))),
    "3 GEMMs": ("#555555", (0, (6, 4))),
    "lean floor (4 GEMMs)": ("#1f77b4", (0, (2, 3))),
}
OTHER = ("#9467bd", "-")
"""The style of an impl ``STYLE`` does not name."""
FLOOR, LEAN_FLOOR = "3 GEMMs", "lean floor (4 GEMMs)"


def series(rows):
    """``{impl: [(N, µs per token)]}`` of one panel's rows, in the rows' order, with the lean
    floor (4/3 of the three GEMMs) after them."""
    lines = {}
    for r in rows:
        lines.setdefault(r["impl"], []).append((r["N"], r["us_per_token"]))
    if FLOOR in lines:
        lines[LEAN_FLOOR] = [(n, us * 4 / 3) for n, us in lines[FLOOR]]
    return {impl: sorted(pts) for impl, pts in lines.items()}


def _with_footer(fig, meta):
    """``fig`` with the run's device, date, jax version and commit at its top right."""
    fig.suptitle(
        f"{meta['device']}, {meta['date']}, jax {meta['jax']}, commit {meta['commit']}",
        fontsize=8,
        x=0.99,
        ha="right",
    )
    return fig


def bars(data, rows, sizes):
    """One panel per (N, D, V): a horizontal bar per implementation, × jnp bf16."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * len(sizes), 4.8), layout="constrained")
    for ax, (n, d, v) in zip(fig.subplots(1, len(sizes), squeeze=False)[0], sizes):
        here = [r for r in rows if (r["N"], r["D"], r["V"]) == (n, d, v) and r.get("x_jnp")]
        here.sort(key=lambda r: r["x_jnp"], reverse=True)
        names = [r["impl"] for r in here]
        ax.barh(names, [r["x_jnp"] for r in here],
                color=[STYLE.get(name, OTHER)[0] for name in names])  # fmt: skip
        for i, r in enumerate(here):
            ax.text(r["x_jnp"], i, f" {r['x_jnp']:.2f}× ({r['fwdbwd_ms']:.1f} ms)", va="center",
                    fontsize=8)  # fmt: skip
        ax.axvline(1.0, color="#d62728", linewidth=1, linestyle=(0, (4, 3)))
        padded = next((r.get("padded") for r in here if r.get("padded") is not None), None)
        note = f", {padded:.0%} padded" if padded else ""
        ax.set_title(f"linear_grpo_loss, N={n}, D={d}, V={v}{note}", fontsize=10)
        ax.set_xlabel("time × plain jnp bf16 (fwd+bwd; shorter is faster)")
        ax.set_xlim(0, max(r["x_jnp"] for r in here) * 1.35)
        ax.grid(True, axis="x", alpha=0.3)
    return _with_footer(fig, data["meta"])


def figure(data):
    """The matplotlib figure of a bench_tokens result (``{"meta": ..., "rows": [...]}``)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = [r for r in data["rows"] if r.get("us_per_token")]
    shapes = sorted({(r["D"], r["V"]) for r in rows})
    sizes = sorted({(r["N"], r["D"], r["V"]) for r in rows})
    if len(sizes) == len(shapes):  # one N per panel: no line to draw
        return bars(data, rows, sizes)
    fig = Figure(figsize=(6.4 * max(len(shapes), 1), 4.8), layout="constrained")
    axes = fig.subplots(1, max(len(shapes), 1), squeeze=False)[0]
    for ax, (d, v) in zip(axes, shapes):
        lines = series([r for r in rows if (r["D"], r["V"]) == (d, v)])
        for impl, pts in lines.items():
            colour, style = STYLE.get(impl, OTHER)
            ax.plot(
                [n for n, _ in pts],
                [us for _, us in pts],
                color=colour,
                linestyle=style,
                linewidth=2,
                label=impl,
            )
        ns = sorted({n for pts in lines.values() for n, _ in pts})
        top = max(us for pts in lines.values() for _, us in pts)
        if FLOOR in lines:  # keep the floor readable
            top = min(top, 4 * min(us for _, us in lines[FLOOR]))
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ns))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlim(ns[0], ns[-1])
        ax.set_ylim(0, top * 1.05)
        ax.set_title(f"linear_grpo_loss, D={d}, V={v}", fontsize=11)
        ax.set_xlabel("tokens N (log scale)")
        ax.set_ylabel("µs per token, fwd+bwd")
        ax.grid(True, alpha=0.3)
    handles = {}
    for ax in axes:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncol=min(len(handles), 3),
        fontsize=9,
        frameon=False,
    )
    return _with_footer(fig, data["meta"])


def save(data, target):
    """Draw ``data`` to ``target``, in the format of its extension."""
    import matplotlib

    target = pathlib.Path(target)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "plot_tokens"}):
        figure(data).savefig(
            target, metadata={"Date": None} if target.suffix == ".svg" else None, dpi=150
        )


def main():
    source, target = sys.argv[1:3]
    with open(source) as f:
        save(json.load(f), target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
