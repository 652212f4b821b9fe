"""The logit-gradient Triton kernel of the Pallas ``linear_logprobs`` backward (the forward's
kernels and the tile pieces it shares: ``linear_kernels.py``; the op: ``linear.py``).

:func:`grad_call`: for the vocabulary columns of one backward chunk, recompute the logits
(``linear_kernels.tile_logits``) and write ``dz = d loss / d logits``
(``softmax_math.logprob_grad_tile``, saved lse, and a per-row floor on z where the softmax is
truncated), and the chunk's column sums of dz (the bias gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.backends.pallas.linear_config import fit
from jaxrl_kernels.backends.pallas.linear_kernels import (
    both,
    in_bounds,
    load_masked,
    span,
    tile_logits,
)
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry


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
        return load_masked(ref.at[span(row0, bm)], rows_ok)

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
