"""Packed rows against padded ones at the same real tokens: ``linear_grpo_loss``, value and
gradient (docs/api.md "Packed sequences").

S completions with lengths drawn from a long-tailed distribution (log-normal, median
``--median`` tokens, clipped to ``[16, L]``) are laid out two ways:

* padded: ``[S, L]``, one completion per row (what a trainer without packing feeds);
* packed: first-fit (longest first) into rows of ``L`` positions, ``segment_ids`` marking the
  completions: the same real tokens, far less padding.

Rows, each timed by ``common.time_calls`` in one run and one process, the first four under
``memory="lean"`` and again under ``"fast"`` (the automatic default could pick a different
mode for each layout, which would hide what packing itself saves):

* ``packed``: the packed rows with ``segment_ids`` (the op as a packing trainer calls it);
* ``packed, no ids``: the same rows without ``segment_ids`` (one sequence per row): what the
  per-sequence bookkeeping costs on top of the head's work (goal: ≤ 1.05×);
* ``padded``: the padded rows, their masked tails skipped (``engine/row_skip.py``);
* ``padded, every row``: the same with row skipping off (``row_skip.MIN_ROWS`` raised for
  this row's trace, so every row runs and masked ones are zeroed): the baseline of the goal
  for ``packed``, ≤ (P / padded tokens) × 1.05 of it;
* ``padded, every row, none masked``: the padded rows with a mask of ones, so no row is
  zeroed: the same GEMM work as the row above on the tails' hidden states instead of zeros (a
  different loss: it counts the tails). GEMMs on zeros draw less power and run faster at the
  power cap; this row shows how much of ``padded, every row``'s time that saves;
* ``jnp bf16 padded``: plain jnp code on the padded rows (bf16 logits ``[S, L, V]``, the
  reference log-probs, group advantages, ``ppo_loss``).

The default size (S=32 completions, median 256 tokens, rows of L=1024, D=2048, V=131072)
keeps the plain code's padded ``[S, L, V]`` logits and their float32 softmax within one
H100's memory. A row that fails (out of memory, say) is printed with its error and the
others still run. ``--small`` runs toy sizes on any device
(tests/benchmarks/test_bench_packed.py).
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

from benchmarks import output


def lengths(rng, count, median, longest):
    """``count`` completion lengths, log-normal around ``median``, in ``[16, longest]``."""
    raw = rng.lognormal(np.log(median), 0.8, count)
    return np.clip(raw, min(16, longest), longest).astype(int)


def pack(lens, row_len):
    """First-fit of the longest first: ``(segment_ids [B, row_len], (row, start) each)``."""
    free, places = [], {}
    for s in np.argsort(-lens, kind="stable"):
        n = int(lens[s])
        row = next((r for r, f in enumerate(free) if f >= n), None)
        if row is None:
            row = len(free)
            free.append(row_len)
        places[int(s)] = (row, row_len - free[row])
        free[row] -= n
    ids = -np.ones((len(free), row_len), np.int32)
    for s, (r, c) in places.items():
        ids[r, c : c + int(lens[s])] = s
    return ids, places


def layouts(rng, lens, row_len, d, v):
    """The padded and packed inputs of the same completions (bf16 hidden states and head)."""
    import jax.numpy as jnp

    s = len(lens)
    ids, places = pack(lens, row_len)
    hidden = rng.standard_normal((s, row_len, d)).astype(np.float32)
    actions = rng.integers(0, v, (s, row_len)).astype(np.int32)
    old = (-np.abs(rng.standard_normal((s, row_len))) - 8.0).astype(np.float32)
    pad_mask = (np.arange(row_len)[None] < lens[:, None]).astype(np.float32)
    shape = ids.shape
    packed = dict(hidden=np.zeros(shape + (d,), np.float32), actions=np.zeros(shape, np.int32))
    packed.update(old=np.zeros(shape, np.float32), mask=np.zeros(shape, np.float32))
    for q, (r, c) in places.items():
        n = int(lens[q])
        packed["hidden"][r, c : c + n] = hidden[q, :n]
        packed["actions"][r, c : c + n] = actions[q, :n]
        packed["old"][r, c : c + n] = old[q, :n]
        packed["mask"][r, c : c + n] = 1.0
    weight = jnp.asarray(0.02 * rng.standard_normal((v, d)), jnp.bfloat16)
    rewards = jnp.asarray(rng.integers(0, 2, s), jnp.float32)

    def arrays(x):
        return (jnp.asarray(x["hidden"], jnp.bfloat16), weight, jnp.asarray(x["actions"]),
                jnp.asarray(x["old"]), rewards, jnp.asarray(x["mask"]))  # fmt: skip

    padded = dict(hidden=hidden, actions=actions, old=old, mask=pad_mask)
    return arrays(padded), arrays(packed), jnp.asarray(ids)


def losses(group, memory):
    """``(ours, rows, plain)``: each ``loss(hidden, weight, actions, old_logp, rewards, mask,
    ids)``, ours under the memory mode ``memory``."""
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    groups = jk.Groups(size=group)
    config = jk.PolicyLoss(clip_high=0.28, loss_agg_mode="seq_mean_token_mean")

    def ours(h, w, a, old, r, mask, ids):
        return jk.linear_grpo_loss(
            h,
            w,
            a,
            old,
            r,
            mask,
            segment_ids=ids,
            groups=groups,
            config=config,
            memory=memory,
        )[0]

    def rows(h, w, a, old, adv, mask, ids):
        """One sequence per row, [B] advantages given (any B: no groups to divide it)."""
        return jk.linear_grpo_loss(
            h, w, a, old, adv, mask, advantages=adv, config=config, memory=memory
        )[0]

    def plain(h, w, a, old, r, mask, ids):
        logp = jk.token_logprobs(jnp.einsum("btd,vd->btv", h, w), a, backend="reference")
        adv = jk.group_advantages(r, groups=groups)
        return jk.ppo_loss(logp, old, adv, mask, config=config)[0]

    return ours, rows, plain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--median", type=int, default=None, help="median completion length")
    output.output_arguments(parser)
    args = parser.parse_args(argv)

    import jax

    from benchmarks import common

    s, row_len, d, v, median = (
        (16, 64, 64, 512, 12) if args.small else (32, 1024, 2048, 131072, 256)
    )
    median = args.median or median
    rng = np.random.default_rng(0)
    lens = lengths(rng, s, median, row_len)
    padded, packed, ids = layouts(rng, lens, row_len, d, v)
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
    n_rows = packed[0].shape[0]
    row_adv = jax.numpy.asarray(np.arange(n_rows) % 2 - 0.5, jax.numpy.float32)
    cases = {}
    for memory in ("lean", "fast"):
        ours, per_row, plain = losses(group=8, memory=memory)
        cases.update({
            (memory, "packed"): (grad(ours), packed + (ids,), False),
            (memory, "packed, no ids"): (
                grad(per_row), packed[:4] + (row_adv,) + packed[5:] + (None,), False),
            (memory, "padded"): (grad(ours), padded + (None,), False),
            (memory, "padded, every row"): (grad(ours), padded + (None,), True),
            (memory, "padded, every row, none masked"): (
                grad(ours), padded[:5] + (jax.numpy.ones_like(padded[5]), None), True),
        })  # fmt: skip
    cases[("", "jnp bf16 padded")] = (grad(plain), padded + (None,), False)
    real = int(lens.sum())
    rows = []
    for (memory, name), (fn, call_args, every_row) in cases.items():
        tokens = call_args[0].shape[0] * call_args[0].shape[1]
        row = dict(
            impl=name,
            memory=memory,
            rows=call_args[0].shape[0],
            tokens=tokens,
            padding=1 - real / tokens,
        )
        try:
            with every_row_runs(every_row):
                timing = common.time_calls(fn, *call_args, runs=args.runs)
                row.update(ms=timing.median, temp_mib=common.temp_mib(fn, *call_args))
        except Exception as err:  # one failing row (out of memory, say) must not end the run
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print(row, flush=True)
        rows.append(row)
    for base, key in (("padded", "vs_padded"), ("padded, every row", "vs_every_row")):
        for memory in ("lean", "fast"):
            base_row = next(r for r in rows if (r["memory"], r["impl"]) == (memory, base))
            for row in rows:
                if row["memory"] in (memory, "") and "ms" in row and "ms" in base_row:
                    row[key] = row["ms"] / base_row["ms"]
    columns = [
        "impl",
        "memory",
        "rows",
        "tokens",
        "padding",
        "ms",
        "vs_padded",
        "vs_every_row",
        "temp_mib",
    ]
    if any("error" in r for r in rows):
        columns.append("error")
    print(common.write_results("bench_packed", rows, columns))
    return rows


@contextlib.contextmanager
def every_row_runs(on: bool):
    """Row skipping off while ``on`` (the op is traced inside, by its first timed call)."""
    from jaxrl_kernels.engine import row_skip

    saved = row_skip.MIN_ROWS
    row_skip.MIN_ROWS = 2**62 if on else saved
    try:
        yield
    finally:
        row_skip.MIN_ROWS = saved


if __name__ == "__main__":
    main()
