"""The statistics and target Triton kernels of the Pallas ``linear_logprobs`` forward, and the
tile pieces the logit-gradient kernel shares (that kernel: ``linear_grad_kernel.py``; the op
around them: ``linear.py``).

With ``z = (hidden @ Wᵀ + b) / T`` (W is [V, D] for ``"vd"``, [D, V] for ``"dv"``):

* :func:`stats_call`, grid (row block i, vocabulary split s): program (i, s) walks the
  vocabulary tiles of split s; each tile ``h[i] · W[tile]ᵀ`` (:func:`tile_logits`) is a loop
  over D of float32-accumulated dots, folded into the running per-row statistics with
  ``softmax_math.online_softmax_update``. Out: S partial statistics per row.
* :func:`target_call`: the target logit ``h · W[target] + b[target]`` as a gather-dot.

W is read in place in either layout; ragged edges of N, V and D are masked. float32 inputs
use full-precision (IEEE) float32 dots, 16-bit inputs 16-bit operands with float32
accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.backends.pallas.linear_config import fit, pow2_block
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry


def span(start, size: int):
    """Indices ``start + arange(size)``. Tiles are addressed by index arrays, not ``pl.ds``:
    the same Triton pointer arithmetic, but interpret mode then gathers the tile instead of
    padding a copy of the whole operand for every dynamic slice."""
    return start + jnp.arange(size)


def both(a, b):
    """The conjunction of two masks, either of which may be None (all True)."""
    if a is None:
        return b
    return a if b is None else a & b


def in_bounds(start, size: int, extent: int, aligned: bool):
    """Mask of ``start + arange(size) < extent``, or None when the shapes make it all True."""
    return None if aligned else (start + jnp.arange(size)) < extent


def load_masked(ref, mask):
    """``ref``'s values where ``mask`` holds (0 elsewhere; None: all of them)."""
    return pltriton.load(ref, mask=mask, other=None if mask is None else 0)


def _dot_precision(dtype):
    # Triton's default float32 dot is tf32; HIGHEST lowers to an IEEE float32 dot.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def tile_logits(
    h_ref,
    w_ref,
    b_ref,
    row0,
    col0,
    *,
    n_rows,
    vocab,
    dim,
    tiles,
    layout,
    compute_dtype,
    scale,
    cols_ragged,
):
    """``(h[rows] · W[cols]ᵀ + b[cols]) · scale`` for one [bm, bn] tile, in float32."""
    bm, bn, bk = tiles.block_rows, tiles.block_vocab, tiles.block_k
    rows_ok = in_bounds(row0, bm, n_rows, n_rows % bm == 0)
    cols_ok = in_bounds(col0, bn, vocab, not cols_ragged)
    precision = _dot_precision(compute_dtype)

    rows, cols = span(row0, bm), span(col0, bn)

    def k_step(k, acc):
        k0 = pl.multiple_of(k * bk, bk)
        ks = span(k0, bk)
        k_ok = in_bounds(k0, bk, dim, dim % bk == 0)
        h_mask = both(
            None if rows_ok is None else rows_ok[:, None], None if k_ok is None else k_ok[None, :]
        )
        h = load_masked(h_ref.at[rows[:, None], ks[None, :]], h_mask).astype(compute_dtype)
        if layout == "vd":
            w_mask = both(
                None if cols_ok is None else cols_ok[:, None],
                None if k_ok is None else k_ok[None, :],
            )
            w = load_masked(w_ref.at[cols[:, None], ks[None, :]], w_mask)
            return acc + pltriton.dot(h, w.astype(compute_dtype), trans_b=True, precision=precision)
        w_mask = both(
            None if k_ok is None else k_ok[:, None], None if cols_ok is None else cols_ok[None, :]
        )
        w = load_masked(w_ref.at[ks[:, None], cols[None, :]], w_mask)
        return acc + pltriton.dot(h, w.astype(compute_dtype), precision=precision)

    acc = lax.fori_loop(0, pl.cdiv(dim, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    if b_ref is not None:
        acc = acc + load_masked(b_ref.at[cols], cols_ok).astype(jnp.float32)[None, :]
    if scale != 1.0:
        acc = acc * scale
        if common.interpret():
            # XLA:CPU would fuse this product into the consumers' `z - max` as an FMA, so the
            # row max no longer cancels exactly (entropy 1e-8 instead of 0 at V = 1).
            acc = lax.optimization_barrier(acc)
    return acc


def forward_tiles(config, hidden, weight, layout):
    """(tiles of the statistics kernel fitted to the problem, number of vocabulary splits)."""
    n_rows, dim = hidden.shape
    vocab = geometry.vocab_size(weight, layout)
    tiles = fit(
        config.forward,
        n_rows,
        vocab,
        dim,
        jnp.dtype(jnp.result_type(hidden, weight)).itemsize,
        config.batch_invariant,
    )
    return tiles, pl.cdiv(pl.cdiv(vocab, tiles.block_vocab), config.tiles_per_split)


# -- forward: split-vocabulary softmax statistics ---------------------------------------------


def walk_split(
    fold,
    init,
    h_ref,
    w_ref,
    b_ref,
    *,
    n_rows,
    vocab,
    dim,
    tiles,
    tiles_per_split,
    layout,
    compute_dtype,
    scale,
):
    """Program (i, s) of the statistics grid: ``fold(state, z)`` over the logit tiles of row
    block i and vocabulary split s, in order (columns past V as -inf). Returns (first row,
    split, final state)."""
    bm, bn = tiles.block_rows, tiles.block_vocab
    row0 = pl.program_id(0) * bm
    split = pl.program_id(1)
    first = split * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, pl.cdiv(vocab, bn))
    cols_ragged = vocab % bn != 0

    def tile(j, state):
        col0 = pl.multiple_of(j * bn, bn)
        z = tile_logits(
            h_ref,
            w_ref,
            b_ref,
            row0,
            col0,
            n_rows=n_rows,
            vocab=vocab,
            dim=dim,
            tiles=tiles,
            layout=layout,
            compute_dtype=compute_dtype,
            scale=scale,
            cols_ragged=cols_ragged,
        )
        if cols_ragged:
            z = jnp.where((col0 + jnp.arange(bn) < vocab)[None, :], z, -jnp.inf)
        return fold(state, z)

    return row0, split, lax.fori_loop(first, last, tile, init)


def store_split(ref, split, row0, value, *, n_rows, block_rows):
    """Row statistics [block_rows] of one program into ``ref[split, rows]``."""
    rows_ok = in_bounds(row0, block_rows, n_rows, n_rows % block_rows == 0)
    pltriton.store(ref.at[split, span(row0, block_rows)], value, mask=rows_ok)


def _stats_kernel(*refs, has_bias, n_stats, **walk):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    out_refs = refs[2 + has_bias :]
    bm = walk["tiles"].block_rows
    row0, split, stats = walk_split(
        softmax_math.online_softmax_update,
        softmax_math.online_softmax_init((bm,), n_stats == 3),
        h_ref,
        w_ref,
        b_ref,
        **walk,
    )
    for ref, value in zip(out_refs, stats):
        store_split(ref, split, row0, value, n_rows=walk["n_rows"], block_rows=bm)


def stats_call(hidden, weight, bias, *, layout, scale, with_entropy, config):
    """The [S, N] partial statistics (m, s[, a]) of the S vocabulary splits."""
    n_rows, dim = hidden.shape
    tiles, n_splits = forward_tiles(config, hidden, weight, layout)
    n_stats = 3 if with_entropy else 2
    kernel = functools.partial(
        _stats_kernel,
        n_rows=n_rows,
        vocab=geometry.vocab_size(weight, layout),
        dim=dim,
        tiles=tiles,
        tiles_per_split=config.tiles_per_split,
        layout=layout,
        compute_dtype=jnp.result_type(hidden, weight),
        scale=scale,
        has_bias=bias is not None,
        n_stats=n_stats,
    )
    args = (hidden, weight) + (() if bias is None else (bias,))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_splits, n_rows), jnp.float32)] * n_stats,
        grid=(pl.cdiv(n_rows, tiles.block_rows), n_splits),
        compiler_params=common.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=common.interpret(),
        name="linear_logprobs_stats",
    )(*args)


# -- forward: target logits by a gather-dot ---------------------------------------------------


def _target_kernel(*refs, n_rows, dim, block_rows, block_k, layout, scale, has_bias):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    t_ref, out_ref = refs[2 + has_bias :]
    bm, bk = block_rows, block_k
    row0 = pl.program_id(0) * bm
    rows_ok = in_bounds(row0, bm, n_rows, n_rows % bm == 0)
    t = load_masked(t_ref.at[span(row0, bm)], rows_ok)

    def k_step(k, acc):
        ks = k * bk + jnp.arange(bk)
        k_ok = None if dim % bk == 0 else ks < dim
        mask = both(
            None if rows_ok is None else rows_ok[:, None], None if k_ok is None else k_ok[None, :]
        )
        h = load_masked(h_ref.at[span(row0, bm)[:, None], ks[None, :]], mask)
        if layout == "vd":
            w = load_masked(w_ref.at[t[:, None], ks[None, :]], mask)
        else:
            w = load_masked(w_ref.at[ks[None, :], t[:, None]], mask)
        return acc + jnp.sum(h.astype(jnp.float32) * w.astype(jnp.float32), axis=1)

    acc = lax.fori_loop(0, pl.cdiv(dim, bk), k_step, jnp.zeros((bm,), jnp.float32))
    if b_ref is not None:
        acc = acc + pltriton.load(b_ref.at[t]).astype(jnp.float32)
    if scale != 1.0:
        acc = acc * scale
    pltriton.store(out_ref.at[span(row0, bm)], acc, mask=rows_ok)


def target_call(hidden, weight, bias, safe_targets, *, layout, scale, config):
    """The [N] target logits; ``safe_targets`` are in [0, V) (0 where a row has none)."""
    n_rows, dim = hidden.shape
    bm = pow2_block(config.target_rows, n_rows)
    bk = pow2_block(config.target_k, dim)
    kernel = functools.partial(
        _target_kernel,
        n_rows=n_rows,
        dim=dim,
        block_rows=bm,
        block_k=bk,
        layout=layout,
        scale=scale,
        has_bias=bias is not None,
    )
    args = (hidden, weight) + (() if bias is None else (bias,)) + (safe_targets,)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows,), jnp.float32),
        grid=(pl.cdiv(n_rows, bm),),
        compiler_params=common.compiler_params(4, 2),
        interpret=common.interpret(),
        name="linear_logprobs_target",
    )(*args)
