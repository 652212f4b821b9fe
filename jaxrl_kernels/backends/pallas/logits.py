"""Pallas kernels for per-token log-probabilities from logits.

For each row of ``z = logits / T`` (``T`` the temperature), with target ``t``:

    lse      = log Σ_v exp(z_v)
    logp     = z_t - lse
    entropy  = lse - Σ_v softmax(z)_v · z_v

Forward (the ``stats`` part of ``logprob_core``): one program per (row, split of the
vocabulary) walks its tiles of V once, folding each tile into the online statistics of
``softmax_math`` (running max, Σ exp, Σ exp·(z - max)); ``paired_logprobs`` carries the policy
and reference statistics through the same walk. Tiles that run past V are masked loads;
the logits are never padded or copied. Only per-(row, split) statistics and the target's
logit leave the kernel; ``softmax_math.online_softmax_merge`` combines the splits in order.

Backward (the ``backward`` part): one program per (row, split) recomputes
``p = exp(z - lse)`` tile by tile from the saved lse and writes
``d logits = softmax_math.logprob_grad_tile(...)`` once, in the logits' dtype, with the per-row
cotangents folded in (p = 0 below a per-row ``floor`` of a truncated softmax, if given).
Rows without a gradient come with ``lse = +inf`` and read nothing.

Rows with ``row_valid == False`` read no logits. The target is only used to index when the
row is valid and the target inside this device's columns; no address outside the logits is
formed. ``logprob_core`` holds the custom_vjp, the outputs (0 for invalid rows, NaN for
out-of-range targets) and the sharding.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import softmax_math

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

TILE_BYTES = 8192
"""Bytes of one forward logits tile per row: 4096 bf16/f16 or 2048 f32 values, two 16-byte
loads per thread at 8 warps. With entropy (three running statistics, more arithmetic per
value) half of that at 4 warps measured faster on an H100; the backward (no reduction, a
store per value) runs a twice larger tile. See benchmarks/bench_logits.py --sweep."""

MIN_PROGRAMS = 512
"""Fewer rows than this split the vocabulary across programs (about 4 per H100 SM)."""

FWD_STAGES = 3
"""Triton software-pipelining depth of the forward's vocabulary walk."""


class LogitsLaunch(NamedTuple):
    """Launch configuration of the kernels for one shape."""

    block_v: int  # forward vocabulary tile (a power of two)
    splits: int  # programs per row (split-V); 1 = finalise inside the kernel
    num_warps: int
    num_stages: int
    bwd_block_v: int = 0  # backward tile; 0 = block_v
    bwd_num_warps: int = 0  # 0 = num_warps

    def tiles_per_split(self, vocab: int, block_v: int | None = None) -> int:
        return pl.cdiv(pl.cdiv(vocab, block_v or self.block_v), self.splits)

    def backward(self) -> tuple[int, int]:
        return self.bwd_block_v or self.block_v, self.bwd_num_warps or self.num_warps


def _warps(block_v: int, itemsize: int) -> int:
    return max(1, min(8, block_v * itemsize // 1024))


def make_launch(
    n_rows: int,
    vocab: int,
    itemsize: int,
    *,
    entropy: bool = False,
    block_v: int | None = None,
    splits: int | None = None,
) -> LogitsLaunch:
    """The documented heuristic. Forward: a ``TILE_BYTES`` tile (half with entropy; fewer
    for small V), one warp per KiB of tile up to 8, ``FWD_STAGES`` pipeline stages.
    Backward: a ``2 * TILE_BYTES`` tile, one warp per KiB up to 16, two stages. The
    vocabulary is split over ``ceil(MIN_PROGRAMS / rows)`` programs per row when there
    are fewer than ``MIN_PROGRAMS`` rows."""
    if block_v is None:
        tile = TILE_BYTES // 2 if entropy else TILE_BYTES
        block_v = min(pl.next_power_of_2(vocab), tile // itemsize)
    n_tiles = pl.cdiv(vocab, block_v)
    if splits is None:
        splits = 1 if n_rows >= MIN_PROGRAMS else pl.cdiv(MIN_PROGRAMS, max(n_rows, 1))
    splits = max(1, min(splits, n_tiles))
    splits = pl.cdiv(n_tiles, pl.cdiv(n_tiles, splits))  # no split without a tile
    bwd_block = min(pl.next_power_of_2(vocab), 2 * TILE_BYTES // itemsize)
    bwd_warps = max(1, min(16, bwd_block * itemsize // 1024))
    return LogitsLaunch(
        block_v, splits, _warps(block_v, itemsize), FWD_STAGES, bwd_block, bwd_warps
    )


def declines(primitive: str, problem) -> str | None:
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"pallas {primitive} takes {'/'.join(SUPPORTED_DTYPES)} logits, not {problem.dtype}"
    return None


# -- kernels --------------------------------------------------------------------------------


def _scaled(x, temperature: float):
    z = x.astype(jnp.float32)
    return z if temperature == 1.0 else z / temperature


def _tile_columns(j, block_v: int, vocab: int):
    cols = j * block_v + jnp.arange(block_v, dtype=jnp.int32)
    return cols, cols < vocab


def _forward_kernel(
    target_ref,
    valid_ref,
    *refs,
    n_in: int,
    entropy: bool,
    temperature: float,
    block_v: int,
    tiles_per_split: int,
):
    """Outputs: (m, s[, a]) of each input for this (row, split), then z_target of each input
    (written by split 0; 0 where the target is not a column of these logits)."""
    x_refs, out_refs = refs[:n_in], refs[n_in:]
    vocab = x_refs[0].shape[-1]
    n_tiles = pl.cdiv(vocab, block_v)
    target = target_ref[...]
    valid = valid_ref[...]
    in_range = (target >= 0) & (target < vocab)
    lo = pl.program_id(1) * tiles_per_split
    hi = jnp.where(valid, jnp.minimum(lo + tiles_per_split, n_tiles), lo)  # invalid: no reads

    def body(j, stats):
        cols, inside = _tile_columns(j, block_v, vocab)
        new = []
        for ref, st in zip(x_refs, stats):
            x = plgpu.load(ref.at[cols], mask=inside, other=-jnp.inf, eviction_policy="evict_first")
            new.append(softmax_math.online_softmax_update(st, _scaled(x, temperature)))
        return tuple(new)

    safe_target = jnp.where(valid & in_range, target, 0)
    target_z = [
        jnp.where(in_range, _scaled(ref[safe_target], temperature), 0.0) for ref in x_refs
    ]  # issued before the walk
    init = tuple(softmax_math.online_softmax_init((), entropy and k == 0) for k in range(n_in))
    stats = lax.fori_loop(lo, hi, body, init)
    pos = 0
    for st in stats:
        for val in st:
            out_refs[pos][...] = val
            pos += 1

    @pl.when(pl.program_id(1) == 0)
    def _():
        for k in range(n_in):
            out_refs[pos + k][...] = target_z[k]


def _grad_kernel(
    target_ref,
    x_ref,
    lse_ref,
    g_ref,
    *refs,
    entropy: bool,
    has_floor: bool,
    temperature: float,
    block_v: int,
    tiles_per_split: int,
):
    refs = list(refs)
    ent_ref, g_ent_ref = (refs.pop(0), refs.pop(0)) if entropy else (None, None)
    floor_ref = refs.pop(0) if has_floor else None
    (dx_ref,) = refs
    vocab = x_ref.shape[-1]
    n_tiles = pl.cdiv(vocab, block_v)
    target = target_ref[...]
    lse, g = lse_ref[...], g_ref[...]
    live = lse != jnp.inf  # rows without a gradient come with lse = +inf: no reads
    ent, g_ent = (ent_ref[...], g_ent_ref[...]) if entropy else (None, None)
    floor = floor_ref[...] if has_floor else None
    lo = pl.program_id(1) * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, n_tiles)

    @pl.loop(lo, hi)
    def _(j):
        cols, inside = _tile_columns(j, block_v, vocab)
        x = plgpu.load(x_ref.at[cols], mask=inside & live, other=0.0, eviction_policy="evict_first")
        dz = softmax_math.logprob_grad_tile(
            _scaled(x, temperature), lse, ent, cols == target, g, g_ent, temperature, floor=floor
        )
        plgpu.store(dx_ref.at[cols], jnp.where(live, dz, 0.0).astype(dx_ref.dtype), mask=inside)


# -- launchers ------------------------------------------------------------------------------


def _row_specs(count: int, vocab: int | None = None):
    if vocab is None:
        return [pl.BlockSpec((None,), lambda i, s: (i,)) for _ in range(count)]
    return [pl.BlockSpec((None, vocab), lambda i, s: (i, 0)) for _ in range(count)]


def _forward(xs, targets, row_valid, *, temperature: float, entropy: bool, plan: LogitsLaunch):
    """Per input, the row statistics ``(m, s, a | None, z_target − m)`` of ``logprob_core``
    (entropy statistics for input 0 only, when asked)."""
    n, vocab = xs[0].shape
    n_in = len(xs)
    n_stats = 2 * n_in + entropy
    kernel = functools.partial(
        _forward_kernel,
        n_in=n_in,
        entropy=entropy,
        temperature=temperature,
        block_v=plan.block_v,
        tiles_per_split=plan.tiles_per_split(vocab),
    )
    outs = pl.pallas_call(
        kernel,
        grid=(n, plan.splits),
        in_specs=_row_specs(2) + _row_specs(n_in, vocab),
        out_specs=([pl.BlockSpec((None, None), lambda i, s: (i, s))] * n_stats + _row_specs(n_in)),
        out_shape=(
            [jax.ShapeDtypeStruct((n, plan.splits), jnp.float32)] * n_stats
            + [jax.ShapeDtypeStruct((n,), jnp.float32)] * n_in
        ),
        compiler_params=common.compiler_params(plan.num_warps, plan.num_stages),
        interpret=common.interpret(),
        name="logprobs_fwd" if n_in == 1 else "paired_logprobs_fwd",
    )(targets, row_valid, *xs)
    return _combine_splits(outs, n_in=n_in, entropy=entropy)


def _combine_splits(outs, *, n_in: int, entropy: bool):
    """Merge the per-split statistics of each input in split order (deterministic)."""
    pos, result = 0, []
    for k in range(n_in):
        width = 3 if (entropy and k == 0) else 2
        parts = outs[pos : pos + width]
        pos += width
        stats = tuple(p[:, 0] for p in parts)
        for j in range(1, parts[0].shape[1]):
            stats = softmax_math.online_softmax_merge(stats, tuple(p[:, j] for p in parts))
        target_z = outs[2 * n_in + entropy + k]
        a = stats[2] if width == 3 else None
        result.append((stats[0], stats[1], a, target_z - stats[0]))
    return result


def _backward(x, targets, lse, g, ent, g_ent, floor, *, temperature: float, plan: LogitsLaunch):
    n, vocab = x.shape
    entropy = ent is not None
    block_v, num_warps = plan.backward()
    kernel = functools.partial(
        _grad_kernel,
        entropy=entropy,
        has_floor=floor is not None,
        temperature=temperature,
        block_v=block_v,
        tiles_per_split=plan.tiles_per_split(vocab, block_v),
    )
    extra = ((ent, g_ent) if entropy else ()) + (
        () if floor is None else (floor.astype(jnp.float32),)
    )
    return pl.pallas_call(
        kernel,
        grid=(n, plan.splits),
        in_specs=_row_specs(1) + _row_specs(1, vocab) + _row_specs(2 + len(extra)),
        out_specs=_row_specs(1, vocab)[0],
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=common.compiler_params(num_warps, 2),
        interpret=common.interpret(),
        name="logprobs_bwd",
    )(targets, x, lse, g.astype(jnp.float32), *extra)


# -- the two parts of logprob_core, and the primitives built from them ----------------------


def _checked_plan(logits, plan, entropy=False):
    n, vocab = logits.shape
    return plan or make_launch(n, vocab, jnp.dtype(logits.dtype).itemsize, entropy=entropy)


def token_stats(logits, targets, row_valid, *, temperature, with_entropy, plan=None):
    if logits.shape[0] == 0:
        empty = jnp.zeros((0,), jnp.float32)
        return empty, empty, (empty if with_entropy else None), empty
    (stats,) = _forward(
        [logits],
        targets.astype(jnp.int32),
        row_valid.astype(jnp.bool_),
        temperature=float(temperature),
        entropy=bool(with_entropy),
        plan=_checked_plan(logits, plan, bool(with_entropy)),
    )
    return stats


def paired_stats(policy_logits, ref_logits, targets, row_valid, *, temperature, plan=None):
    if policy_logits.shape != ref_logits.shape:
        raise ValueError(
            f"ref_logits: expected shape {policy_logits.shape}, got {ref_logits.shape}"
        )
    if policy_logits.shape[0] == 0:
        empty = jnp.zeros((0,), jnp.float32)
        return (empty, empty, None, empty), (empty, empty, None, empty)
    return tuple(
        _forward(
            [policy_logits, ref_logits],
            targets.astype(jnp.int32),
            row_valid.astype(jnp.bool_),
            temperature=float(temperature),
            entropy=False,
            plan=_checked_plan(policy_logits, plan),
        )
    )


def token_backward(logits, targets, lse, entropy, g, g_ent, *, temperature, floor=None, plan=None):
    """d logits of token_logprobs from per-row cotangents (the ``logprob_core`` backward part).

    ``floor`` [N] | None: a truncated softmax keeping ``logits / T >= floor`` per row (``lse``
    and ``entropy`` are the kept set's), so p = 0 below it; the one-hot term is not masked.
    """
    if logits.shape[0] == 0:
        return jnp.zeros_like(logits)
    return _backward(
        logits,
        targets.astype(jnp.int32),
        lse,
        g,
        entropy,
        g_ent,
        floor,
        temperature=float(temperature),
        plan=_checked_plan(logits, plan, entropy is not None),
    )


def kernel_parts(plan: LogitsLaunch | None = None, *, paired: bool = False) -> Parts:
    """The ``logprob_core.Parts`` of these kernels, with a fixed launch plan if given."""
    stats = paired_stats if paired else token_stats
    return Parts(functools.partial(stats, plan=plan), functools.partial(token_backward, plan=plan))


OPS = {"token_logprobs": kernel_parts(), "paired_logprobs": kernel_parts(paired=True)}
