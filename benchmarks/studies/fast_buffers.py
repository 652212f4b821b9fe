"""Which buffers hold the fast mode's temp memory, with row skipping and without.

Question: ``linear_grpo_loss(memory="fast")``'s value and gradient hold one ``[N, V]`` buffer
(the logits, then their gradient) where every row runs; what more do they hold when masked rows
are skipped (``engine.row_skip``), and which HLO instruction makes each large buffer? The
program is compiled (not run) with XLA's dumps on; from the buffer assignment this prints
``temp_size_in_bytes`` as a multiple of the logits' bytes and every value of at least a
quarter of them, with its shape, offset and defining instruction.

Cases: padding 5 % (the last branch, ``S = N``) and 70 %, skipped; padding 5 % with every row
run (``bench_packed.every_row_runs`` for the trace). bf16, one row of N tokens, random head.
``--leading opaque`` takes each branch's leading rows (``row_skip._leading``) as a dynamic
slice whose start XLA cannot fold (a zero through an optimization barrier), to see whether
XLA then hands the backward's GEMMs the rows in place rather than a copy.

    python -m benchmarks.studies.fast_buffers                     # GPU: 8192 × 1024 × 32768
    python -m benchmarks.studies.fast_buffers --shape 64,32,512   # toy size, any device

Prints only (the dumps go to a temporary directory).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile

VALUE = re.compile(r"value: <\d+ (\S+) @\S+> \(size=(\d+),offset=(\d+)\): (\S+)")
CASES = ((0.05, False), (0.05, True), (0.7, False))


def compiled_loss(n, d, v, padding, every_row, dump_dir):
    """The compiled value-and-gradient of the fast GRPO loss at ``padding`` (masked tails).
    The batch (actions, old log-probs, advantages, mask) is traced, as in a training step: a
    mask XLA sees as a constant lets it fold the branch choice and drop the other branches."""
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk
    from benchmarks.bench_packed import every_row_runs

    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (1, n, d), jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, d), jnp.float32) / d**0.5).astype(jnp.bfloat16)
    actions = jax.random.randint(k[2], (1, n), 0, v)
    mask = (jnp.arange(n) < n * (1 - padding)).astype(jnp.float32)[None]
    old, adv = jnp.zeros((1, n), jnp.float32), jnp.ones((1,), jnp.float32)
    config = jk.PolicyLoss(clip_high=0.28)

    def loss(h, w, actions, old, adv, mask):
        return jk.linear_grpo_loss(
            h, w, actions, old, adv, mask, advantages=adv, config=config, memory="fast"
        )[0]

    with every_row_runs(every_row):
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
            h, w, actions, old, adv, mask
        )
    return lowered.compile({"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True})


def opaque_leading(x, size):
    """The first ``size`` rows of ``x`` as a dynamic slice at a start XLA cannot fold."""
    import jax
    import jax.numpy as jnp

    zero = jax.lax.optimization_barrier(jnp.int32(0))
    return jax.lax.dynamic_slice_in_dim(x, zero, size, axis=0)


def large_values(dump_dir, least):
    """``(name, bytes, offset, shape, defining HLO line)`` of the buffer assignment's values
    of at least ``least`` bytes."""
    assignments = glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt"))
    modules = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not assignments:
        return []
    text = open(max(assignments, key=os.path.getsize)).read()
    hlo = open(max(modules, key=os.path.getsize)).read() if modules else ""
    defined = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = ", line)
        if m:
            defined[m.group(1)] = re.sub(r", metadata=.*", "", line.strip())[:240]
    return [
        (name, int(size), int(offset), shape, defined.get(name, ""))
        for name, size, offset, shape in VALUE.findall(text)
        if int(size) >= least
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192,1024,32768", metavar="N,D,V")
    parser.add_argument("--leading", default="slice", choices=("slice", "opaque"))
    args = parser.parse_args(argv)
    if args.leading == "opaque":
        from jaxrl_kernels.engine import row_skip

        row_skip._leading = opaque_leading
    n, d, v = map(int, args.shape.split(","))
    logits = n * v * 2
    for padding, every_row in CASES:
        with tempfile.TemporaryDirectory() as dump_dir:
            temp = compiled_loss(n, d, v, padding, every_row, dump_dir)
            temp = temp.memory_analysis().temp_size_in_bytes
            how = "every row run" if every_row else "masked rows skipped"
            print(f"padding {padding:.2f}, {how}: temp {temp / 2**20:.1f} MiB = "
                  f"{temp / logits:.2f} × the logits")  # fmt: skip
            for name, size, offset, shape, line in large_values(dump_dir, logits // 4):
                print(f"  {name:40s} {size / 2**20:9.1f} MiB at {offset / 2**20:9.1f}  {shape}")
                if line:
                    print(f"    {line}")


if __name__ == "__main__":
    main()
