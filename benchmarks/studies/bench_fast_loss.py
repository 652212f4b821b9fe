"""``linear_grpo_loss(memory="fast")`` against the plain jnp code and the lean default.

Question: what does a GRPO step's loss cost with the fast mode, next to what a JAX user writes
without this library (``einsum`` to bf16 logits, float32 ``log_softmax``, gather, the same
loss through ``jk.token_logprobs`` (reference backend) and ``jk.ppo_loss``) and the lean default? Each row:
``jax.jit(jax.value_and_grad(loss, (hidden, weight)))``, bf16, groups of 2, XLA's temp size,
the median of synchronised calls by the host clock. The inputs and losses are
``benchmarks.bench_tokens``' (``inputs``, ``losses``).

    PYTHONPATH=$PWD python3 -m benchmarks.studies.bench_fast_loss          # GPU
    PYTHONPATH=$PWD python3 -m benchmarks.studies.bench_fast_loss --small  # any device, seconds

Run it from another checkout's package (``PYTHONPATH=<that tree>:$PWD``) to compare commits
in one sitting; ``--tag`` names the rows; ``--one-pass`` adds the fast mode with the logits'
gradient written in one pass, not a loop over blocks of rows (:func:`one_pass`);
``--batch realistic --padding 0.35`` the RL batch of ``bench_tokens``, ``--impls`` some of
the rows. Results: ``bench_fast_loss.{json,md}`` (``--out``, ``--update-results``:
benchmarks/README.md).

    python3 -m benchmarks.studies.bench_fast_loss --batch realistic --padding 0.35 \
        --impls "jnp bf16,ours fast" --tag new       # and from the older tree, --tag old
"""

from __future__ import annotations

import argparse

from benchmarks import output
from benchmarks.bench_tokens import SIZES as TOKEN_SIZES
from benchmarks.bench_tokens import inputs, losses, traced_under

COLUMNS = ["impl", "tag", "N", "D", "V", "fwdbwd_ms", "temp_mib", "loss"]
SIZES = {
    "full": [(4096, 2048, 131072), (8192, 4096, 131072)],
    "realistic_pair": TOKEN_SIZES["realistic_pair"],
    "small": [(64, 32, 1000)],
}


def one_pass(fn):
    """``fn`` run (and so traced) with the fused losses' logits' gradient written over the
    logits in one pass instead of a loop over blocks of rows (``fused_loss.ROW_BLOCK_BYTES``
    beyond any buffer): does XLA still write it in place (the temp size), and at what speed?"""
    from unittest import mock

    def in_one_block():
        from jaxrl_kernels.engine import fused_loss

        return mock.patch.object(fused_loss, "ROW_BLOCK_BYTES", 2**62)

    return traced_under(fn, in_one_block)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--tag", default="", help="a name for this tree's rows")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sizes", default="full", choices=sorted(SIZES))
    parser.add_argument("--batch", default="random", choices=("random", "realistic"))
    parser.add_argument("--padding", type=float, default=0.0, help="positions masked (tails)")
    parser.add_argument("--impls", default="", help="the rows to run, separated by ','")
    parser.add_argument(
        "--one-pass",
        action="store_true",
        help="add the fast mode with its logits' gradient in one pass",
    )
    args = parser.parse_args()

    import jax

    from benchmarks import common

    rows = []
    for n, d, v in SIZES["small" if args.small else args.sizes]:
        h, w, a, old, r, mask = inputs(n, d, v, batch=args.batch, padding=args.padding)
        impls = losses()
        if args.one_pass:
            impls["ours fast, gradient in one pass"] = one_pass(impls["ours fast"])
        if args.impls:
            impls = {name: impls[name] for name in args.impls.split(",")}
        for impl, loss in impls.items():
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            value = float(step(h, w, a, old, r, mask)[0])
            row = {
                "impl": impl,
                "tag": args.tag,
                "N": h.shape[0] * h.shape[1],
                "D": d,
                "V": v,
                "fwdbwd_ms": common.median_ms(step, h, w, a, old, r, mask, runs=args.runs),
                "temp_mib": common.temp_mib(step, h, w, a, old, r, mask),
                "loss": value,
            }
            print(row, flush=True)
            rows.append(row)
    print(
        common.write_results(
            "bench_fast_loss" + (f"_{args.tag}" if args.tag else ""), rows, COLUMNS
        )
    )


if __name__ == "__main__":
    main()
