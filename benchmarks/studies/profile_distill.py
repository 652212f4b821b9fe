"""Where the time of one ``linear_distill_loss`` forward+backward goes, kernel by kernel.

Runs ``jax.jit(jax.grad(loss, (h, W)))`` of a ``bench_distill`` variant under the profiler
(``common.traced``) and sums the device kernels of its last call by name, largest first, with
their share of the call's kernel time.

    PYTHONPATH=$PWD python3 -m benchmarks.studies.profile_distill --variant "ours (chunked)" \
        --divergence reverse_kl [--small] [--top 25]
"""

from __future__ import annotations

import argparse
import collections


def main():
    from benchmarks import bench_distill as bd
    from benchmarks import common

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="ours (chunked)")
    ap.add_argument("--divergence", default="reverse_kl", choices=bd.DIVERGENCES)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    import jax

    size = bd.SIZES["small" if args.small else "full"]
    operands = bd.inputs(size)
    step = jax.jit(jax.grad(bd.variant_loss(args.variant, args.divergence), (0, 1)))
    jax.block_until_ready(step(*operands))  # compiled and warm before the trace
    spans, kernels, host = common.call_spans(step, operands, calls=2)
    last = [m for m in host if m["name"] == "call1"][0]
    mine = [k for k in kernels if last["ts"] <= k["ts"] < last["ts"] + last["dur"]]
    total, count = collections.Counter(), collections.Counter()
    for k in mine:
        total[k["name"]] += k["dur"]
        count[k["name"]] += 1
    busy = sum(total.values())
    if not mine:
        print("no device kernels in the trace (a GPU's CUPTI events are what it reads)")
        return
    lead, span, _, tail, _ = spans[-1]
    print(
        f"{args.variant} {args.divergence} {size}: {len(mine)} kernels; host call start to "
        f"first kernel {lead:.2f} ms, first kernel start to last kernel end {span:.2f} ms, "
        f"to the host's return {tail:.2f} ms; kernels busy {busy / 1e3:.2f} ms"
    )
    for name, us in total.most_common(args.top):
        print(
            f"{us / 1e3:9.3f} ms {100 * us / max(busy, 1):5.1f} % {count[name]:6d}x  {name[:110]}"
        )


if __name__ == "__main__":
    main()
