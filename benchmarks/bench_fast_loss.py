"""``linear_grpo_loss(memory="fast")`` against the plain jnp code and the lean default.

Question: what does a GRPO step's loss cost with the fast mode, next to what a JAX user writes
without this library (``einsum`` to bf16 logits, float32 ``log_softmax``, gather, the same
loss through ``jk.token_logprobs`` (reference backend) and ``jk.ppo_loss``) and the lean default? Each row:
``jax.jit(jax.value_and_grad(loss, (hidden, weight)))``, bf16, group_size 2, XLA's temp size,
the median of synchronised calls by the host clock.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_fast_loss          # GPU
    PYTHONPATH=$PWD python3 -m benchmarks.bench_fast_loss --small  # any device, seconds

Run it from another checkout's package (``PYTHONPATH=<that tree>:$PWD``) to compare commits
in one sitting; ``--tag`` names the rows; ``--one-pass`` adds the fast mode with the logits'
gradient written in one pass, not a loop over blocks of rows (:func:`one_pass`). Results:
``bench_fast_loss.{json,md}`` (``--out``, ``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

import argparse

from benchmarks import output

COLUMNS = ["impl", "tag", "N", "D", "V", "fwdbwd_ms", "temp_mib", "loss"]
SIZES = {"full": [(4096, 2048, 131072), (8192, 4096, 131072)], "small": [(64, 32, 1000)]}


def inputs(n, d, v, seed=0):
    """bf16 hidden [B, T, D] (B = 2 sequences per 1024 tokens, at least 2), head [V, D],
    actions, old log-probs, rewards and mask: the inputs of every loss of :func:`losses`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    b = max(2, 2 * (n // 1024))
    t = n // b
    keys = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(keys[0], (b, t, d), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, d), jnp.float32) * (2.0 / np.sqrt(d))).astype(jnp.bfloat16)
    a = jax.random.randint(keys[2], (b, t), 0, v)
    old = jnp.full((b, t), -np.log(v), jnp.float32)
    r = jnp.arange(b, dtype=jnp.float32)
    mask = jnp.ones((b, t), jnp.float32)
    return h, w, a, old, r, mask


def losses():
    """``{impl: loss(hidden, weight, actions, old_logp, rewards, mask)}``."""
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    kw = dict(group_size=2, clip_low=0.2, clip_high=0.28)

    def plain(h, w, a, old, r, mask):
        logp = jk.token_logprobs(jnp.einsum("btd,vd->btv", h, w), a, backend="reference")
        adv = jk.group_advantages(r, group_size=kw["group_size"])
        return jk.ppo_loss(logp, old, adv, mask, clip_low=kw["clip_low"],
                           clip_high=kw["clip_high"])[0]

    def ours(memory):
        def loss(h, w, a, old, r, mask):
            return jk.linear_grpo_loss(h, w, a, old, r, mask, memory=memory, **kw)[0]
        return loss

    return {"jnp bf16": plain, "ours lean": ours("lean"), "ours fast": ours("fast"),
            "ours fast, XLA logits": xla_logits(ours("fast"))}


def _traced_under(fn, patch):
    """``fn`` run (and so traced) inside the context manager ``patch()``."""
    def traced(*args):
        with patch():
            return fn(*args)
    return traced


def xla_logits(fn):
    """``fn`` run (and so traced) with the ffi backend's ``kept_logits`` withheld:
    ``memory="fast"``'s logits and their statistics from XLA's GEMM and reductions (the
    reference backend's), as off Hopper, against the kernel that writes them and folds them at
    once."""
    from unittest import mock

    def withheld():
        from jaxrl_kernels.backends import ffi

        others = {name: op for name, op in ffi.OPS.items() if name != "kept_logits"}
        return mock.patch.dict(ffi.OPS, others, clear=True)
    return _traced_under(fn, withheld)


def one_pass(fn):
    """``fn`` run (and so traced) with the fused losses' logits' gradient written over the
    logits in one pass instead of a loop over blocks of rows (``fused_loss.ROW_BLOCK_BYTES``
    beyond any buffer): does XLA still write it in place (the temp size), and at what speed?"""
    from unittest import mock

    def in_one_block():
        from jaxrl_kernels.engine import fused_loss

        return mock.patch.object(fused_loss, "ROW_BLOCK_BYTES", 2**62)
    return _traced_under(fn, in_one_block)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--tag", default="", help="a name for this tree's rows")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--one-pass", action="store_true",
                        help="add the fast mode with its logits' gradient in one pass")
    args = parser.parse_args()

    import jax

    from benchmarks import common

    rows = []
    for n, d, v in SIZES["small" if args.small else "full"]:
        h, w, a, old, r, mask = inputs(n, d, v)
        impls = losses()
        if args.one_pass:
            impls["ours fast, gradient in one pass"] = one_pass(impls["ours fast"])
        for impl, loss in impls.items():
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            value = float(step(h, w, a, old, r, mask)[0])
            row = {"impl": impl, "tag": args.tag, "N": h.shape[0] * h.shape[1], "D": d, "V": v,
                   "fwdbwd_ms": common.median_ms(step, h, w, a, old, r, mask, runs=args.runs),
                   "temp_mib": common.temp_mib(step, h, w, a, old, r, mask), "loss": value}
            print(row, flush=True)
            rows.append(row)
    print(common.write_results("bench_fast_loss" + (f"_{args.tag}" if args.tag else ""), rows,
                               COLUMNS))


if __name__ == "__main__":
    main()
