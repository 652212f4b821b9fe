"""A linear head's vocabulary walked in chunks: the loop, a chunk's logits, and the student
head's backward built on them.

Chunk ``c`` of ``size`` columns reads ``[start, start + size)`` with ``start = min(c·size,
V − size)`` (``blocks.Blocks``): chunks never pad or copy their input, and where the last one
is pulled back to stay in bounds, the columns an earlier chunk already covered are not
*fresh* and are masked out. A chunk holds about ``chunk_bytes`` of float32 ``[N, size]``,
``size`` a multiple of 128 (or the whole vocabulary).

:func:`student_backward` is the backward of a head from a per-chunk logit gradient: two GEMMs
per chunk, no ``[N, V]`` array; the chunked backend's distillation and top-k and the pallas
backend's distillation (its logit-gradient kernels) share it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_kernels.head import geometry
from jaxrl_kernels.head.blocks import Blocks, blocks
from jaxrl_kernels.sharding.vma import varying_like

DISTILL_CHUNK_BYTES = 16 * 2**20
"""Target size of one float32 [N, chunk] tile of the two-head loops (distillation, top-k, and
:func:`student_backward`): a few are live at once, per head."""


def vocab_chunking(n_rows: int, vocab: int, chunk_bytes: int) -> Blocks:
    """The chunks of ``vocab`` columns: about ``chunk_bytes`` of float32 per chunk, 128-aligned."""
    size = chunk_bytes // (4 * max(n_rows, 1))
    return blocks(vocab, max(128, size - size % 128))


TILE_ROWS = 256
"""Rows of every tile of a batch-invariant :func:`tiling`: fixed, so that each product and
reduction a row goes through has one shape whatever N is (docs/api.md "Batch-invariant
log-probs")."""


def tile_chunking(vocab: int, dim: int, chunk_bytes: int) -> Blocks:
    """The vocabulary chunks of a batch-invariant :func:`tiling`: a float32 [TILE_ROWS, size]
    tile of about ``chunk_bytes`` and a float32 [size, D] weight chunk of at most
    ``4·chunk_bytes`` (``dim``: D, 0 without a head), 128-aligned: a function of V and D
    only."""
    size = chunk_bytes // (4 * TILE_ROWS)
    if dim:
        size = min(size, chunk_bytes // dim)
    return blocks(vocab, max(128, size - size % 128))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The tiles of :func:`scan_tiles`: ``rows``, blocks of ``rows.size`` rows over ``rows.n``
    rows (operands of fewer rows padded to ``rows.n`` by :meth:`pad`; the last block pulled back
    to end there, its rows an earlier block covered not fresh), and ``chunks`` of
    ``chunks.size`` vocabulary columns."""

    rows: Blocks
    chunks: Blocks
    invariant: bool = False

    def isolate(self, values):
        """``values`` behind an optimization barrier when batch-invariant: XLA then compiles a
        tile's arithmetic as one piece in every context (as the body of a loop over several
        row blocks, or inlined where one block is all), not fused with different neighbours
        (a fused producer changes how XLA vectorises a reduction and where it contracts
        ``a·b + c`` into an FMA)."""
        return jax.lax.optimization_barrier(values) if self.invariant else values

    def pad(self, x, value=0):
        """``x`` [N, ...] (or None) with rows of ``value`` appended up to ``rows.n``."""
        if x is None or x.shape[0] == self.rows.n:
            return x
        return jnp.pad(
            x, [(0, self.rows.n - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value
        )

    def read(self, x, r0):
        """The rows ``[r0, r0 + rows.size)`` of ``x`` (None: None)."""
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, r0, self.rows.size)

    def write(self, x, update, r0, fresh):
        """``x`` with the block ``update`` written at row ``r0`` where ``fresh`` [rows.size]."""
        fresh = fresh.reshape(fresh.shape + (1,) * (update.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(
            x, jnp.where(fresh, update, self.read(x, r0)), r0, 0
        )


def tiling(
    n_rows: int, vocab: int, chunk_bytes: int, *, dim: int = 0, batch_invariant: bool = False
) -> Tiling:
    """The tiles over N rows and V columns: all rows at once in chunks of about
    ``chunk_bytes`` of float32 [N, size] (:func:`vocab_chunking`); ``batch_invariant``: blocks
    of :data:`TILE_ROWS` rows in chunks of :func:`tile_chunking`, so that no shape a row's
    arithmetic sees depends on N (up to ``TILE_ROWS − 1`` rows more work)."""
    if batch_invariant:
        return Tiling(
            blocks(max(n_rows, TILE_ROWS), TILE_ROWS),
            tile_chunking(vocab, dim, chunk_bytes),
            invariant=True,
        )
    n = max(n_rows, 1)
    return Tiling(blocks(n, n), vocab_chunking(n_rows, vocab, chunk_bytes))


def scan_tiles(tile, carry, tiles: Tiling, *, open_chunk=None, close_chunk=None):
    """The carry after ``tile`` over every tile: the vocabulary chunks in order, and in each
    the row blocks in order.

    ``tile(carry, acc, r0, fresh_rows, start, cols, fresh_cols, size) -> (carry, acc)``:
    ``r0`` the block's first row, ``fresh_rows`` [rows.size] which of its rows no earlier
    block covered, ``cols`` the chunk's column ids [size] and ``fresh_cols`` which of them no
    earlier chunk read; ``acc`` the chunk's own state, ``open_chunk(start, size)`` at its
    start (None: none) and handed to ``close_chunk(carry, acc, start, fresh_cols, size) ->
    carry`` at its end."""
    rows, size = tiles.rows, tiles.chunks.size

    def chunk(carry, c):
        start = tiles.chunks.start(c)
        cols, fresh_cols = start + jnp.arange(size), tiles.chunks.fresh(c)
        acc = None if open_chunk is None else open_chunk(start, size)

        def row_block(r, state):
            return tile(*state, rows.start(r), rows.fresh(r), start, cols, fresh_cols, size)

        carry, acc = jax.lax.fori_loop(0, rows.count, row_block, (carry, acc))
        if close_chunk is not None:
            carry = close_chunk(carry, acc, start, fresh_cols, size)
        return carry, None

    return jax.lax.scan(chunk, carry, jnp.arange(tiles.chunks.count))[0]


def scan_chunks(body, init, n_rows: int, vocab: int, chunk_bytes: int):
    """The carry after ``body(carry, start, cols, fresh, size)`` over every chunk, in order
    (``cols``: the chunk's column ids [size]; ``fresh``: which of them no earlier chunk read)."""
    spans = vocab_chunking(n_rows, vocab, chunk_bytes)

    def step(carry, c):
        start = spans.start(c)
        cols = start + jnp.arange(spans.size)
        return body(carry, start, cols, spans.fresh(c), spans.size), None

    return jax.lax.scan(step, init, jnp.arange(spans.count))[0]


def linear_chunk(hidden, weight, bias, weight_layout, temperature):
    """``chunk(start, size)``: the float32 logits [N, size] of the head's columns
    ``[start, start + size)``, divided by ``temperature``."""

    def chunk(start, size):
        w = geometry.vocab_slice(weight, start, size, weight_layout)
        b = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
        return geometry.float32_logits(hidden, w, b, weight_layout) / temperature

    return chunk


def linear_rows(hidden, weight, bias, weight_layout, temperature):
    """``rows(start, size)``: the float32 logits [size, V] of the hidden states' rows
    ``[start, start + size)``, divided by ``temperature`` (:func:`linear_chunk`'s values)."""

    def rows(start, size):
        h = jax.lax.dynamic_slice_in_dim(hidden, start, size)
        return geometry.float32_logits(h, weight, bias, weight_layout) / temperature

    return rows


def accumulate_chunk(d_weight, d_bias, d_w, dz, start, fresh, size: int, weight_layout: str):
    """Write a vocabulary chunk's ``d_w`` into ``d_weight`` and ``Σ_rows dz`` into ``d_bias``,
    on the chunk's fresh columns only (the last chunk overlaps the one before it)."""
    old = geometry.vocab_slice(d_weight, start, size, weight_layout)
    d_w = jnp.where(geometry.per_column(fresh, weight_layout), d_w.astype(d_weight.dtype), old)
    d_weight = geometry.vocab_update(d_weight, d_w, start, weight_layout)
    if d_bias is not None:
        old_b = jax.lax.dynamic_slice_in_dim(d_bias, start, size)
        d_b = jnp.where(fresh, jnp.sum(dz, axis=0), old_b)
        d_bias = jax.lax.dynamic_update_slice_in_dim(d_bias, d_b, start, 0)
    return d_weight, d_bias


def _pow2_scale(amax):
    """2¹⁴ / (the smallest power of two >= amax): x · it lies in [−2¹⁴, 2¹⁴] for |x| <= amax,
    inside float16's range (exact: a power of two; 1 where amax is 0 or not finite)."""
    ok = jnp.isfinite(amax) & (amax > 0)
    top = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(ok, amax, 1.0))))
    return jnp.where(ok, 2.0**14 / top, 1.0).astype(jnp.float32)


def student_backward(
    hidden, weight, bias, weight_layout, tile_grad, operands, chunk_bytes: int | None = None
):
    """(d_hidden, d_weight, d_bias | None) from ``tile_grad(start, cols, fresh, size)``, the
    float32 logit gradient [N, size] of a chunk of ``chunk_bytes`` (default
    :data:`DISTILL_CHUNK_BYTES`): two GEMMs per chunk. ``operands``: the arrays the result
    varies with (``vma.varying_like``).

    float32 heads: float32 GEMMs. 16-bit heads: float16 operands with float32 accumulation,
    every operand scaled by a power of two into float16's range (exact, divided out after the
    GEMM): ``G = σ_c dz`` with σ_c from the chunk's max |dz|, ``h16 = σ_h hidden`` and
    ``W16 = σ_W W`` from their max |x|, so that ``d_hidden += (G·W16_c) / (σ_c σ_W)`` and
    ``d_W_c = (Gᵀ·h16) / (σ_c σ_h)``; float16 keeps 2⁻¹¹ of each entry (bfloat16: 2⁻⁸)."""
    n_rows, vocab = hidden.shape[0], geometry.vocab_size(weight, weight_layout)
    low = jnp.dtype(hidden.dtype).itemsize == 2 and jnp.dtype(weight.dtype).itemsize == 2
    if low:
        sigma_h = _pow2_scale(jnp.max(jnp.abs(hidden.astype(jnp.float32))))
        sigma_w = _pow2_scale(jnp.max(jnp.abs(weight.astype(jnp.float32))))
        h_op = (hidden.astype(jnp.float32) * sigma_h).astype(jnp.float16)
        op_dtype, precision = jnp.float16, jax.lax.Precision.DEFAULT
    else:
        sigma_h = sigma_w = jnp.float32(1.0)
        h_op = hidden.astype(jnp.float32)
        op_dtype, precision = jnp.float32, geometry.matmul_precision(jnp.float32)

    dot = dict(precision=precision, preferred_element_type=jnp.float32)

    def body(carry, start, cols, fresh, size):
        d_hidden, d_weight, d_bias = carry
        dz = jnp.where(fresh, tile_grad(start, cols, fresh, size), 0.0)
        sigma = _pow2_scale(jnp.max(jnp.abs(dz))) if low else jnp.float32(1.0)
        g = (dz * sigma).astype(op_dtype)
        w = geometry.vocab_slice(weight, start, size, weight_layout).astype(jnp.float32)
        w = (w * sigma_w).astype(op_dtype)
        d_hidden = d_hidden + geometry.hidden_grad(g, w, weight_layout, **dot) / (sigma * sigma_w)
        d_w = geometry.weight_grad(g, h_op, weight_layout, **dot) / (sigma * sigma_h)
        d_weight, d_bias = accumulate_chunk(
            d_weight, d_bias, d_w, dz, start, fresh, size, weight_layout
        )
        return d_hidden, d_weight, d_bias

    init = (
        jnp.zeros(hidden.shape, jnp.float32),
        jnp.zeros_like(weight),
        None if bias is None else jnp.zeros((vocab,), jnp.float32),
    )
    chunk_bytes = DISTILL_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    d_hidden, d_weight, d_bias = scan_chunks(
        body, varying_like(init, *operands), n_rows, vocab, chunk_bytes
    )
    return (
        d_hidden,
        d_weight,
        None if bias is None else d_bias.astype(bias.dtype),
    )
