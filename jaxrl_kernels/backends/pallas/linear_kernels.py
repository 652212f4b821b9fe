"""The Triton kernels of the Pallas ``linear_logprobs`` (the op around them: ``linear.py``).

With ``z = (hidden @ Wᵀ + b) / T`` (W is [V, D] for ``"vd"``, [D, V] for ``"dv"``):

* :func:`stats_call`, grid (row block i, vocabulary split s): program (i, s) walks the
  vocabulary tiles of split s; each tile ``h[i] · W[tile]ᵀ`` (:func:`tile_logits`) is a loop
  over D of float32-accumulated dots, folded into the running per-row statistics with
  ``softmax_math.online_softmax_update``. Out: S partial statistics per row.
* :func:`target_call`: the target logit ``h · W[target] + b[target]`` as a gather-dot.
* :func:`grad_call`: for the vocabulary columns of one backward chunk, recompute the logits
  and write ``dz = d loss / d logits`` (``softmax_math.logprob_grad_tile``, saved lse, and a
  per-row floor on z where the softmax is truncated), and the chunk's column sums of dz.

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


def _load(ref, mask):
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
        h = _load(h_ref.at[rows[:, None], ks[None, :]], h_mask).astype(compute_dtype)
        if layout == "vd":
            w_mask = both(
                None if cols_ok is None else cols_ok[:, None],
                None if k_ok is None else k_ok[None, :],
            )
            w = _load(w_ref.at[cols[:, None], ks[None, :]], w_mask)
            return acc + pltriton.dot(h, w.astype(compute_dtype), trans_b=True, precision=precision)
        w_mask = both(
            None if k_ok is None else k_ok[:, None], None if cols_ok is None else cols_ok[None, :]
        )
        w = _load(w_ref.at[ks[:, None], cols[None, :]], w_mask)
        return acc + pltriton.dot(h, w.astype(compute_dtype), precision=precision)

    acc = lax.fori_loop(0, pl.cdiv(dim, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    if b_ref is not None:
        acc = acc + _load(b_ref.at[cols], cols_ok).astype(jnp.float32)[None, :]
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
    t = _load(t_ref.at[span(row0, bm)], rows_ok)

    def k_step(k, acc):
        ks = k * bk + jnp.arange(bk)
        k_ok = None if dim % bk == 0 else ks < dim
        mask = both(
            None if rows_ok is None else rows_ok[:, None], None if k_ok is None else k_ok[None, :]
        )
        h = _load(h_ref.at[span(row0, bm)[:, None], ks[None, :]], mask)
        if layout == "vd":
            w = _load(w_ref.at[t[:, None], ks[None, :]], mask)
        else:
            w = _load(w_ref.at[ks[None, :], t[:, None]], mask)
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


# -- backward: the logit gradient of one vocabulary chunk --------------------------------------


def _grad_kernel(
    *refs,
    n_rows,
    vocab,
    dim,
    size,
    tiles,
    layout,
    compute_dtype,
    temperature,
    has_bias,
    with_entropy,
    has_floor,
):
    it = iter(refs)
    start_ref, h_ref, w_ref = next(it), next(it), next(it)
    b_ref = next(it) if has_bias else None
    t_ref, lse_ref, gl_ref = next(it), next(it), next(it)
    ent_ref, ge_ref = (next(it), next(it)) if with_entropy else (None, None)
    floor_ref = next(it) if has_floor else None
    dz_ref = next(it)
    db_ref = next(it) if has_bias else None

    bm, bn = tiles.block_rows, tiles.block_vocab
    i, j = pl.program_id(0), pl.program_id(1)
    row0 = i * bm
    local0 = pl.multiple_of(j * bn, bn)
    col0 = start_ref[0] + local0
    ragged = size % bn != 0
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
        scale=1.0 / temperature,
        cols_ragged=ragged,
    )
    rows_ok = in_bounds(row0, bm, n_rows, n_rows % bm == 0)

    def rows(ref):
        return _load(ref.at[span(row0, bm)], rows_ok)

    t = rows(t_ref)
    is_target = (col0 + jnp.arange(bn))[None, :] == t[:, None]
    dz = softmax_math.logprob_grad_tile(
        z,
        rows(lse_ref),
        rows(ent_ref) if with_entropy else None,
        is_target,
        rows(gl_ref),
        rows(ge_ref) if with_entropy else None,
        temperature,
        floor=rows(floor_ref) if has_floor else None,
    )
    cols_ok = in_bounds(local0, bn, size, not ragged)
    if cols_ok is not None:
        dz = jnp.where(cols_ok[None, :], dz, 0.0)
    mask = both(
        None if rows_ok is None else rows_ok[:, None], None if cols_ok is None else cols_ok[None, :]
    )
    pltriton.store(
        dz_ref.at[span(row0, bm)[:, None], span(local0, bn)[None, :]],
        dz.astype(dz_ref.dtype),
        mask=mask,
    )
    if db_ref is not None:
        if rows_ok is not None:
            dz = jnp.where(rows_ok[:, None], dz, 0.0)
        pltriton.store(db_ref.at[i, span(local0, bn)], jnp.sum(dz, axis=0), mask=cols_ok)


def grad_call(
    start,
    size,
    hidden,
    weight,
    bias,
    targets,
    lse,
    g_logp,
    entropy,
    g_ent,
    *,
    layout,
    temperature,
    dz_dtype,
    config,
    floor=None,
):
    """(dz [N, size] in ``dz_dtype``, d_bias [size] | None) for the vocabulary columns
    [start, start + size): ``softmax_math.logprob_grad_tile`` of the recomputed logits, with
    p = 0 where z < ``floor`` [N] (None: no floor, and no such operand)."""
    n_rows, dim = hidden.shape
    compute_dtype = jnp.result_type(hidden, weight)
    tiles = fit(
        config.grad, n_rows, size, dim, jnp.dtype(compute_dtype).itemsize, config.batch_invariant
    )
    with_entropy = g_ent is not None
    n_row_blocks = pl.cdiv(n_rows, tiles.block_rows)
    kernel = functools.partial(
        _grad_kernel,
        n_rows=n_rows,
        vocab=geometry.vocab_size(weight, layout),
        dim=dim,
        size=size,
        tiles=tiles,
        layout=layout,
        compute_dtype=compute_dtype,
        temperature=temperature,
        has_bias=bias is not None,
        with_entropy=with_entropy,
        has_floor=floor is not None,
    )
    args = [jnp.reshape(jnp.asarray(start, jnp.int32), (1,)), hidden, weight]
    args += [] if bias is None else [bias]
    args += [targets, lse, g_logp] + ([entropy, g_ent] if with_entropy else [])
    args += [] if floor is None else [floor.astype(jnp.float32)]
    out_shape = [jax.ShapeDtypeStruct((n_rows, size), dz_dtype)]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((n_row_blocks, size), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_row_blocks, pl.cdiv(size, tiles.block_vocab)),
        compiler_params=common.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=common.interpret(),
        name="linear_logprobs_grad",
    )(*args)
    return outs[0], (jnp.sum(outs[1], axis=0) if bias is not None else None)
