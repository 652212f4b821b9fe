"""Draw ``bench_tokens.json`` as an SVG: microseconds per token against the token count N.

One panel per (D, V) of the file; a line per implementation with times (every impl of the
file, the peers of ``--peers`` included; a row with an ``error`` and no times draws nothing);
the GEMM floor dashed (the three GEMMs of a forward+backward that keeps the logits, measured
in the same run) and the lean mode's own floor (4/3 of it: lean computes the logits twice)
dotted. The x axis is log2 N; the title carries the file's device, date, jax version and
commit. Plain SVG, no plotting library.

    python -m benchmarks.plot_tokens benchmarks/results/bench_tokens.json docs/tokens.svg
"""

from __future__ import annotations

import json
import math
import sys
from xml.sax.saxutils import escape

STYLE = {  # impl: (colour, dash pattern)
    "ours lean": ("#1f77b4", ""),
    "ours fast": ("#2ca02c", ""),
    "ours fast, XLA logits": ("#98df8a", "4,3"),  # the same op with the forward kernel withheld
    "jnp bf16": ("#d62728", ""),
    "torch bf16": ("#ff7f0e", ""),
    "QuACK chunked": ("#8c564b", ""),  # the peers (bench_tokens --peers): cross-entropy
    "Liger": ("#e377c2", ""),
    "3 GEMMs": ("#555555", "6,4"),
    "lean floor (4 GEMMs)": ("#1f77b4", "2,3"),
}
WIDTH, HEIGHT, PAD = 460, 300, 48


def panel(rows, title, x0):
    """The SVG elements of one panel at horizontal offset x0."""
    lines = {}
    for r in rows:
        lines.setdefault(r["impl"], []).append((r["N"], r["us_per_token"]))
        if r["impl"] == "3 GEMMs":
            lines.setdefault("lean floor (4 GEMMs)", []).append((r["N"], r["us_per_token"] * 4 / 3))
    ns = sorted({n for pts in lines.values() for n, _ in pts})
    top = max(y for pts in lines.values() for _, y in pts)
    top = min(top, 4 * min(y for _, y in lines["3 GEMMs"])) * 1.05  # keep the floor readable

    def xy(n, y):
        lo, hi = math.log2(ns[0]), math.log2(ns[-1])
        fx = (math.log2(n) - lo) / max(hi - lo, 1)
        return (x0 + PAD + fx * (WIDTH - 2 * PAD),
                HEIGHT - PAD - min(y, top) / top * (HEIGHT - 2 * PAD))

    out = [f'<text x="{x0 + WIDTH / 2}" y="20" text-anchor="middle" font-size="13">'
           f'{escape(title)}</text>']
    x_a, y_a = xy(ns[0], 0)
    x_b, _ = xy(ns[-1], 0)
    out.append(f'<line x1="{x_a}" y1="{y_a}" x2="{x_b}" y2="{y_a}" stroke="black"/>')
    out.append(f'<line x1="{x_a}" y1="{y_a}" x2="{x_a}" y2="{PAD}" stroke="black"/>')
    for n in ns:
        x, y = xy(n, 0)
        out.append(f'<text x="{x}" y="{y + 14}" text-anchor="middle" font-size="10">{n}</text>')
    for k in range(5):
        value = top * k / 4
        x, y = xy(ns[0], value)
        out.append(f'<text x="{x - 4}" y="{y + 3}" text-anchor="end" font-size="10">'
                   f'{value:.1f}</text>')
    out.append(f'<text x="{x0 + WIDTH / 2}" y="{HEIGHT - 12}" text-anchor="middle" '
               'font-size="11">tokens N (log scale)</text>')
    out.append(f'<text x="{x0 + 12}" y="{HEIGHT / 2}" font-size="11" transform="rotate(-90 '
               f'{x0 + 12} {HEIGHT / 2})" text-anchor="middle">µs per token, fwd+bwd</text>')
    for impl, pts in lines.items():
        colour, dash = STYLE.get(impl, ("#9467bd", ""))
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(n, v) for n, v in sorted(pts)))
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')
    return out


def render(data):
    """The SVG text of a bench_tokens result (``{"meta": ..., "rows": [...]}``)."""
    rows = [r for r in data["rows"] if r.get("us_per_token")]
    shapes = sorted({(r["D"], r["V"]) for r in rows})
    width = WIDTH * len(shapes)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT + 60}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>']
    for i, (d, v) in enumerate(shapes):
        out += panel([r for r in rows if (r["D"], r["V"]) == (d, v)],
                     f"linear_grpo_loss, D={d}, V={v}", i * WIDTH)
    impls = list(dict.fromkeys(r["impl"] for r in rows)) + ["lean floor (4 GEMMs)"]
    x, y = 10, HEIGHT + 6
    for impl in impls:
        colour, dash = STYLE.get(impl, ("#9467bd", ""))
        if x + 40 + 7 * len(impl) > width:  # the next row
            x, y = 10, y + 16
        out.append(f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" '
                   f'stroke="{colour}" stroke-width="2" stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{x + 28}" y="{y + 4}" font-size="11">{escape(impl)}</text>')
        x += 40 + 7 * len(impl)
    meta = data["meta"]
    out.append(f'<text x="{width - 8}" y="{y + 22}" text-anchor="end" font-size="10">'
               f'{escape(meta["device"])}, {escape(meta["date"])}, jax {escape(meta["jax"])}, '
               f'commit {escape(meta["commit"])}</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main():
    source, target = sys.argv[1:3]
    with open(source) as f:
        svg = render(json.load(f))
    with open(target, "w") as f:
        f.write(svg)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
