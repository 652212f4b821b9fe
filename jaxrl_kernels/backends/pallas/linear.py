"""``linear_logprobs`` on Pallas (Triton) kernels: log-probs of an LM head without logits.

With ``z = (hidden @ Wᵀ + b) / T`` (W is [V, D] for ``"vd"``, [D, V] for ``"dv"``):
``logp = z[target] - lse(z)`` and ``entropy = lse(z) - Σ softmax(z)·z``.

Forward
  * :func:`_stats_call`, grid (row block i, vocabulary split s): program (i, s) walks the
    vocabulary tiles of split s; each tile ``h[i] · W[tile]ᵀ`` is a loop over D of
    float32-accumulated dots, and is folded into the running per-row statistics with
    ``rl_math.online_softmax_update``. Out: S partial statistics per row.
  * the S partials of a row are combined in a fixed pairwise tree
    (``rl_math.online_softmax_merge``) and finalized.
  * :func:`_target_call`: the target logit ``h · W[target] + b[target]`` as a gather-dot.
Backward (:func:`linear_backward`)
  per vocabulary chunk of C columns, :func:`_grad_call` recomputes the chunk's logits and
  writes ``dz = d loss / d logits`` (``rl_math.logprob_grad_tile``, saved lse) -- for 16-bit
  inputs scaled per row into float16 (``head_grad``); XLA's GEMMs then add ``dz · W_c`` to a
  float32 d_hidden and write ``d_W_c = dzᵀ · hidden``. C bounds the extra memory; no
  atomics, the order of every sum is fixed.

W is read in place in either layout; ragged edges of N, V and D are masked in the kernels.
float32 inputs use full-precision (IEEE) float32 dots, 16-bit inputs 16-bit operands with
float32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_kernels import logprob_core, rl_math
from jaxrl_kernels.logprob_core import Parts
from jaxrl_kernels.backends import head_grad
from jaxrl_kernels.backends.pallas import common

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel."""

    block_rows: int = 128
    block_vocab: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """What tunes the op. The defaults meet docs/api.md; ``grad_mode="bf16"`` (one bf16 rounding of
    dz, below our bf16 tolerance) and ``epilogue="max"`` (no softmax at all) exist only to
    measure what precision and the softmax epilogue cost (benchmarks/bench_linear.py)."""

    forward: TileConfig = TileConfig(128, 256, 64, 8, 4)
    tiles_per_split: int = 4  # vocabulary tiles one forward program walks
    target_rows: int = 16  # rows of one gather-dot program
    target_k: int = 128
    grad: TileConfig = TileConfig()
    chunk_bytes: int = 32 * 2**20  # dz buffers of one backward chunk (head_grad.chunk_columns)
    grad_mode: str = "f16"  # how 16-bit dz enters the GEMMs (see linear_backward)
    epilogue: str = "softmax"  # "max": running max only -- the bare-GEMM timing variant


DEFAULT_CONFIG = Config()


def declines(primitive, problem) -> str | None:
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"pallas linear_logprobs serves {', '.join(SUPPORTED_DTYPES)}, not {problem.dtype}"
    return None


# -- tile helpers ---------------------------------------------------------------------------

def _pow2_block(size: int, extent: int) -> int:
    """``size`` shrunk to the next power of two of ``extent`` but at least 16 (dot minimum)."""
    return max(16, min(size, pl.next_power_of_2(max(extent, 1))))


SMEM_BYTES = 200 * 2**10
"""Shared memory the software pipeline's operand buffers may take (H100: 227 KiB per block)."""


def _fit(tiles: TileConfig, n_rows: int, vocab: int, dim: int, itemsize: int) -> TileConfig:
    """Shrink tiles to the problem, and the pipeline so its num_stages - 1 buffers fit."""
    tiles = dataclasses.replace(
        tiles,
        block_rows=_pow2_block(tiles.block_rows, n_rows),
        block_vocab=_pow2_block(tiles.block_vocab, vocab),
        block_k=_pow2_block(tiles.block_k, dim))
    per_stage = (tiles.block_rows + tiles.block_vocab) * tiles.block_k * itemsize
    return dataclasses.replace(tiles, num_stages=max(1, min(tiles.num_stages,
                                                             1 + SMEM_BYTES // per_stage)))


def _span(start, size: int):
    """Indices ``start + arange(size)``. Tiles are addressed by index arrays, not ``pl.ds``:
    the same Triton pointer arithmetic, but interpret mode then gathers the tile instead of
    padding a copy of the whole operand for every dynamic slice."""
    return start + jnp.arange(size)


def _both(a, b):
    if a is None:
        return b
    return a if b is None else a & b


def _in_bounds(start, size: int, extent: int, aligned: bool):
    """Mask of ``start + arange(size) < extent``, or None when the shapes make it all True."""
    return None if aligned else (start + jnp.arange(size)) < extent


def _dot_precision(dtype):
    # Triton's default float32 dot is tf32; HIGHEST lowers to an IEEE float32 dot.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _tile_logits(h_ref, w_ref, b_ref, row0, col0, *, n_rows, vocab, dim, tiles, layout,
                 compute_dtype, scale, cols_ragged):
    """``(h[rows] · W[cols]ᵀ + b[cols]) · scale`` for one [bm, bn] tile, in float32."""
    bm, bn, bk = tiles.block_rows, tiles.block_vocab, tiles.block_k
    rows_ok = _in_bounds(row0, bm, n_rows, n_rows % bm == 0)
    cols_ok = _in_bounds(col0, bn, vocab, not cols_ragged)
    precision = _dot_precision(compute_dtype)

    rows, cols = _span(row0, bm), _span(col0, bn)

    def k_step(k, acc):
        k0 = pl.multiple_of(k * bk, bk)
        ks = _span(k0, bk)
        k_ok = _in_bounds(k0, bk, dim, dim % bk == 0)
        h_mask = _both(None if rows_ok is None else rows_ok[:, None],
                       None if k_ok is None else k_ok[None, :])
        h = pltriton.load(h_ref.at[rows[:, None], ks[None, :]], mask=h_mask,
                          other=None if h_mask is None else 0)
        h = h.astype(compute_dtype)
        if layout == "vd":
            w_mask = _both(None if cols_ok is None else cols_ok[:, None],
                           None if k_ok is None else k_ok[None, :])
            w = pltriton.load(w_ref.at[cols[:, None], ks[None, :]], mask=w_mask,
                              other=None if w_mask is None else 0)
            return acc + pltriton.dot(h, w.astype(compute_dtype), trans_b=True,
                                      precision=precision)
        w_mask = _both(None if k_ok is None else k_ok[:, None],
                       None if cols_ok is None else cols_ok[None, :])
        w = pltriton.load(w_ref.at[ks[:, None], cols[None, :]], mask=w_mask,
                          other=None if w_mask is None else 0)
        return acc + pltriton.dot(h, w.astype(compute_dtype), precision=precision)

    acc = lax.fori_loop(0, pl.cdiv(dim, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
    if b_ref is not None:
        b = pltriton.load(b_ref.at[cols], mask=cols_ok,
                          other=None if cols_ok is None else 0)
        acc = acc + b.astype(jnp.float32)[None, :]
    if scale != 1.0:
        acc = acc * scale
        if common.interpret():
            # XLA:CPU would fuse this product into the consumers' `z - max` as an FMA, so the
            # row max no longer cancels exactly (entropy 1e-8 instead of 0 at V = 1).
            acc = lax.optimization_barrier(acc)
    return acc


# -- forward: split-vocabulary softmax statistics ---------------------------------------------

def _stats_kernel(*refs, n_rows, vocab, dim, tiles, tiles_per_split, layout, compute_dtype,
                  scale, has_bias, n_stats, epilogue):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    out_refs = refs[2 + has_bias:]
    bm, bn = tiles.block_rows, tiles.block_vocab
    row0 = pl.program_id(0) * bm
    split = pl.program_id(1)
    first = split * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, pl.cdiv(vocab, bn))
    cols_ragged = vocab % bn != 0

    def tile(j, stats):
        col0 = pl.multiple_of(j * bn, bn)
        z = _tile_logits(h_ref, w_ref, b_ref, row0, col0, n_rows=n_rows, vocab=vocab, dim=dim,
                         tiles=tiles, layout=layout, compute_dtype=compute_dtype, scale=scale,
                         cols_ragged=cols_ragged)
        if cols_ragged:
            z = jnp.where((col0 + jnp.arange(bn) < vocab)[None, :], z, -jnp.inf)
        if epilogue == "max":
            return (jnp.maximum(stats[0], jnp.max(z, axis=-1)),) + tuple(stats[1:])
        return rl_math.online_softmax_update(stats, z)

    stats = lax.fori_loop(first, last, tile,
                          rl_math.online_softmax_init((bm,), n_stats == 3))
    rows_ok = _in_bounds(row0, bm, n_rows, n_rows % bm == 0)
    for ref, value in zip(out_refs, stats):
        pltriton.store(ref.at[split, _span(row0, bm)], value, mask=rows_ok)


def _stats_call(hidden, weight, bias, *, layout, scale, with_entropy, config):
    n_rows, dim = hidden.shape
    vocab = weight.shape[0] if layout == "vd" else weight.shape[1]
    tiles = _fit(config.forward, n_rows, vocab, dim,
                 jnp.dtype(jnp.result_type(hidden, weight)).itemsize)
    n_splits = pl.cdiv(pl.cdiv(vocab, tiles.block_vocab), config.tiles_per_split)
    n_stats = 3 if with_entropy else 2
    kernel = functools.partial(
        _stats_kernel, n_rows=n_rows, vocab=vocab, dim=dim, tiles=tiles,
        tiles_per_split=config.tiles_per_split, layout=layout,
        compute_dtype=jnp.result_type(hidden, weight), scale=scale, has_bias=bias is not None,
        n_stats=n_stats, epilogue=config.epilogue)
    args = (hidden, weight) + (() if bias is None else (bias,))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n_splits, n_rows), jnp.float32)] * n_stats,
        grid=(pl.cdiv(n_rows, tiles.block_rows), n_splits),
        compiler_params=common.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=common.interpret(),
        name="linear_logprobs_stats",
    )(*args)


def _merge_splits(parts):
    """Combine [S, N] partial statistics into [N] in a fixed pairwise tree."""
    while parts[0].shape[0] > 1:
        if parts[0].shape[0] % 2:
            identity = (-jnp.inf,) + (0.0,) * (len(parts) - 1)
            parts = tuple(jnp.concatenate([p, jnp.full((1, p.shape[1]), e, p.dtype)])
                          for p, e in zip(parts, identity))
        parts = rl_math.online_softmax_merge(tuple(p[0::2] for p in parts),
                                             tuple(p[1::2] for p in parts))
    return tuple(p[0] for p in parts)


# -- forward: target logits by a gather-dot ---------------------------------------------------

def _target_kernel(*refs, n_rows, dim, block_rows, block_k, layout, scale, has_bias):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    t_ref, out_ref = refs[2 + has_bias:]
    bm, bk = block_rows, block_k
    row0 = pl.program_id(0) * bm
    rows_ok = _in_bounds(row0, bm, n_rows, n_rows % bm == 0)
    t = pltriton.load(t_ref.at[_span(row0, bm)], mask=rows_ok,
                      other=None if rows_ok is None else 0)

    def k_step(k, acc):
        ks = k * bk + jnp.arange(bk)
        k_ok = None if dim % bk == 0 else ks < dim
        mask = _both(None if rows_ok is None else rows_ok[:, None],
                     None if k_ok is None else k_ok[None, :])
        other = None if mask is None else 0
        h = pltriton.load(h_ref.at[_span(row0, bm)[:, None], ks[None, :]], mask=mask, other=other)
        if layout == "vd":
            w = pltriton.load(w_ref.at[t[:, None], ks[None, :]], mask=mask, other=other)
        else:
            w = pltriton.load(w_ref.at[ks[None, :], t[:, None]], mask=mask, other=other)
        return acc + jnp.sum(h.astype(jnp.float32) * w.astype(jnp.float32), axis=1)

    acc = lax.fori_loop(0, pl.cdiv(dim, bk), k_step, jnp.zeros((bm,), jnp.float32))
    if b_ref is not None:
        acc = acc + pltriton.load(b_ref.at[t]).astype(jnp.float32)
    if scale != 1.0:
        acc = acc * scale
    pltriton.store(out_ref.at[_span(row0, bm)], acc, mask=rows_ok)


def _target_call(hidden, weight, bias, safe_targets, *, layout, scale, config):
    n_rows, dim = hidden.shape
    bm = _pow2_block(config.target_rows, n_rows)
    bk = _pow2_block(config.target_k, dim)
    kernel = functools.partial(
        _target_kernel, n_rows=n_rows, dim=dim, block_rows=bm, block_k=bk, layout=layout,
        scale=scale, has_bias=bias is not None)
    args = (hidden, weight) + (() if bias is None else (bias,)) + (safe_targets,)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows,), jnp.float32),
        grid=(pl.cdiv(n_rows, bm),),
        compiler_params=common.compiler_params(4, 2),
        interpret=common.interpret(),
        name="linear_logprobs_target",
    )(*args)


def linear_stats(hidden, weight, bias, targets, row_valid, *, weight_layout, temperature,
                 with_entropy, config=None):
    """The row statistics ``(m, s, a | None, z_target − m)`` of ``logprob_core``."""
    config = config or DEFAULT_CONFIG
    vocab = weight.shape[0] if weight_layout == "vd" else weight.shape[1]
    scale = 1.0 / temperature
    parts = _stats_call(hidden, weight, bias, layout=weight_layout, scale=scale,
                        with_entropy=with_entropy, config=config)
    stats = _merge_splits(tuple(parts))
    in_range = (targets >= 0) & (targets < vocab)
    safe = jnp.where(in_range & row_valid, targets, 0).astype(jnp.int32)
    target_z = _target_call(hidden, weight, bias, safe, layout=weight_layout, scale=scale,
                            config=config)
    return stats[0], stats[1], (stats[2] if with_entropy else None), target_z - stats[0]


# -- backward ------------------------------------------------------------------------------

GRAD_MODES = ("f16", "split", "concat", "tf32", "bf16")


def _grad_kernel(*refs, n_rows, vocab, dim, size, tiles, layout, compute_dtype, temperature,
                 has_bias, with_entropy, parts):
    it = iter(refs)
    start_ref, h_ref, w_ref = next(it), next(it), next(it)
    b_ref = next(it) if has_bias else None
    t_ref, lse_ref, gl_ref = next(it), next(it), next(it)
    ent_ref, ge_ref = (next(it), next(it)) if with_entropy else (None, None)
    dz_ref = next(it)
    lo_ref = next(it) if parts == "pair" else None
    db_ref = next(it) if has_bias else None

    bm, bn = tiles.block_rows, tiles.block_vocab
    i, j = pl.program_id(0), pl.program_id(1)
    row0 = i * bm
    local0 = pl.multiple_of(j * bn, bn)
    col0 = start_ref[0] + local0
    ragged = size % bn != 0
    z = _tile_logits(h_ref, w_ref, b_ref, row0, col0, n_rows=n_rows, vocab=vocab, dim=dim,
                     tiles=tiles, layout=layout, compute_dtype=compute_dtype,
                     scale=1.0 / temperature, cols_ragged=ragged)
    rows_ok = _in_bounds(row0, bm, n_rows, n_rows % bm == 0)

    def rows(ref):
        return pltriton.load(ref.at[_span(row0, bm)], mask=rows_ok,
                             other=None if rows_ok is None else 0)

    t = rows(t_ref)
    is_target = (col0 + jnp.arange(bn))[None, :] == t[:, None]
    dz = rl_math.logprob_grad_tile(
        z, rows(lse_ref), rows(ent_ref) if with_entropy else None, is_target, rows(gl_ref),
        rows(ge_ref) if with_entropy else None, temperature)
    cols_ok = _in_bounds(local0, bn, size, not ragged)
    if cols_ok is not None:
        dz = jnp.where(cols_ok[None, :], dz, 0.0)
    mask = _both(None if rows_ok is None else rows_ok[:, None],
                 None if cols_ok is None else cols_ok[None, :])
    rows, cols = _span(row0, bm)[:, None], _span(local0, bn)[None, :]
    hi = dz.astype(dz_ref.dtype)
    pltriton.store(dz_ref.at[rows, cols], hi, mask=mask)
    if parts in ("pair", "concat"):
        lo = (dz - hi.astype(jnp.float32)).astype(dz_ref.dtype)
        lo_at = lo_ref.at[rows, cols] if parts == "pair" else dz_ref.at[rows, size + cols]
        pltriton.store(lo_at, lo, mask=mask)
    if db_ref is not None:
        if rows_ok is not None:
            dz = jnp.where(rows_ok[:, None], dz, 0.0)
        pltriton.store(db_ref.at[i, _span(local0, bn)], jnp.sum(dz, axis=0), mask=cols_ok)


def _grad_call(start, size, hidden, weight, bias, targets, lse, g_logp, entropy, g_ent, *,
               layout, temperature, parts, dz_dtype, config):
    """dz = d loss / d logits for vocabulary columns [start, start + size).

    Returns ``(buffers, d_bias | None)``; ``parts`` says how dz is laid out in ``buffers``:
    ``"one"``: (dz [N, size] in dz_dtype,); ``"pair"``: (hi, lo), each [N, size], with
    dz ≈ hi + lo; ``"concat"``: ([hi | lo] [N, 2·size],).
    """
    n_rows, dim = hidden.shape
    vocab = weight.shape[0] if layout == "vd" else weight.shape[1]
    compute_dtype = jnp.result_type(hidden, weight)
    tiles = _fit(config.grad, n_rows, size, dim, jnp.dtype(compute_dtype).itemsize)
    with_entropy = g_ent is not None
    n_row_blocks = pl.cdiv(n_rows, tiles.block_rows)
    kernel = functools.partial(
        _grad_kernel, n_rows=n_rows, vocab=vocab, dim=dim, size=size, tiles=tiles,
        layout=layout, compute_dtype=compute_dtype, temperature=temperature,
        has_bias=bias is not None, with_entropy=with_entropy, parts=parts)
    args = [jnp.reshape(jnp.asarray(start, jnp.int32), (1,)), hidden, weight]
    args += [] if bias is None else [bias]
    args += [targets, lse, g_logp] + ([entropy, g_ent] if with_entropy else [])
    width = 2 * size if parts == "concat" else size
    out_shape = [jax.ShapeDtypeStruct((n_rows, width), dz_dtype)] * (2 if parts == "pair" else 1)
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
    n_buf = 2 if parts == "pair" else 1
    return tuple(outs[:n_buf]), (jnp.sum(outs[n_buf], axis=0) if bias is not None else None)


def _tf32():
    """TF32 products with float32 accumulation; interpret mode (CPU) has exact float32 instead."""
    return (lax.DotAlgorithmPreset.TF32_TF32_F32 if jax.default_backend() == "gpu"
            else lax.Precision.HIGHEST)


def _write_grad(bias, targets, *, layout, config):
    """``head_grad.WriteGrad`` on the Triton grad kernel: G = dz / s as float16."""
    def write(rows: head_grad.RowGrad, start, size, hidden, weight, sigma_w):
        (g16,), _ = _grad_call(start, size, hidden, weight, bias, targets, rows.lse, rows.g,
                               rows.entropy, rows.g_ent, layout=layout,
                               temperature=rows.temperature, parts="one",
                               dz_dtype=jnp.float16, config=config)
        # the kernel's column sums of dz are unused (head_grad takes d_bias from G), and
        # head_grad converts the weight chunk
        return g16, None
    return write


def linear_backward(hidden, weight, bias, targets, lse, entropy, g_logp, g_ent, *,
                    weight_layout, temperature, config=None):
    """(d_hidden, d_weight, d_bias | None) of linear_logprobs from per-row cotangents.

    The backward part of ``logprob_core``: ``lse`` [N] is the per-row logsumexp of z (+inf on
    rows without a gradient, whose cotangents are 0), ``entropy`` [N] the entropy output;
    ``g_ent``/``entropy`` may be None; targets outside [0, V) add no one-hot term.

    16-bit inputs, by default (``config.grad_mode="f16"``): ``head_grad.backward``, with
    :func:`_grad_call` writing each chunk's G = dz / s in float16 -- two GEMM-equivalents per
    chunk. float32 inputs: per chunk, float32 dz, d_hidden += dz·W_c, d_W_c = dzᵀ·hidden and
    d_b_c = Σ_rows dz with full-precision float32 GEMMs. The other modes exist to measure what
    precision costs: "bf16" (dz rounded once to bf16, 2^-8, which can exceed our bf16
    tolerance), "split" / "concat" (dz as two bf16 parts hi + lo, 2^-16: four GEMMs, or two
    over hi|lo stacked along the contraction), "tf32" (float32 dz, TF32 products).
    """
    config = config or DEFAULT_CONFIG
    layout = weight_layout
    n_rows = hidden.shape[0]
    vocab = weight.shape[0] if layout == "vd" else weight.shape[1]
    w_axis = 0 if layout == "vd" else 1
    compute_dtype = jnp.dtype(jnp.result_type(hidden, weight))
    mode = "f32" if compute_dtype.itemsize == 4 else config.grad_mode
    if mode not in GRAD_MODES + ("f32",):
        raise ValueError(f"config.grad_mode: unknown {mode!r}; valid: {', '.join(GRAD_MODES)}")
    targets = targets.astype(jnp.int32)
    if mode == "f16":
        return head_grad.backward(
            hidden, weight, bias, targets, lse, entropy, g_logp, g_ent,
            weight_layout=layout, temperature=temperature,
            write_grad=_write_grad(bias, targets, layout=layout, config=config),
            chunk_bytes=config.chunk_bytes, align=config.grad.block_vocab)
    parts = {"split": "pair", "concat": "concat"}.get(mode, "one")
    dz_dtype = {"f32": jnp.float32, "tf32": jnp.float32}.get(mode, compute_dtype)
    operand_dtype = jnp.float32 if mode == "tf32" else dz_dtype
    precision = {"f32": lax.Precision.HIGHEST, "tf32": _tf32()}.get(mode)
    hidden_op = hidden.astype(operand_dtype)

    def dot(a, b, contract):
        return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    def products(buffers, w_c, size):
        """(Σ dz·W_c [N, D], Σ dzᵀ·hidden in W's layout) in float32 over the parts of dz."""
        w_contract = 0 if layout == "vd" else 1
        if parts == "concat":
            [dz] = buffers  # [N, 2·size]: hi | lo
            d_h = dot(dz, jnp.concatenate([w_c, w_c], axis=w_axis), ((1,), (w_contract,)))
            if layout == "vd":
                d_w = dot(dz, hidden_op, ((0,), (0,)))
                return d_h, d_w[:size] + d_w[size:]
            d_w = dot(hidden_op, dz, ((0,), (0,)))
            return d_h, d_w[:, :size] + d_w[:, size:]
        d_h = d_w = None
        for dz in buffers:
            h_part = dot(dz, w_c, ((1,), (w_contract,)))
            w_part = (dot(dz, hidden_op, ((0,), (0,))) if layout == "vd" else
                      dot(hidden_op, dz, ((0,), (0,))))
            d_h = h_part if d_h is None else d_h + h_part
            d_w = w_part if d_w is None else d_w + w_part
        return d_h, d_w

    def chunk(carry, start, size):
        d_hidden, d_weight, d_bias = carry
        buffers, d_b = _grad_call(start, size, hidden, weight, bias, targets, lse, g_logp,
                                  entropy, g_ent, layout=layout, temperature=temperature,
                                  parts=parts, dz_dtype=dz_dtype, config=config)
        w_c = lax.dynamic_slice_in_dim(weight, start, size, axis=w_axis)
        d_h, d_w = products(buffers, w_c.astype(operand_dtype), size)
        d_hidden = d_hidden + d_h
        d_weight = lax.dynamic_update_slice_in_dim(d_weight, d_w.astype(weight.dtype), start,
                                                   axis=w_axis)
        if d_bias is not None:
            d_bias = lax.dynamic_update_slice_in_dim(d_bias, d_b, start, axis=0)
        return d_hidden, d_weight, d_bias

    bytes_per_entry = jnp.dtype(dz_dtype).itemsize * (1 if parts == "one" else 2)
    size = head_grad.chunk_columns(n_rows, vocab, config.chunk_bytes, config.grad.block_vocab,
                                   bytes_per_entry)
    carry = head_grad.run_chunks(chunk, head_grad.initial_grads(hidden, weight, bias), vocab, size)
    d_hidden, d_weight, d_bias = carry
    return (d_hidden.astype(hidden.dtype), d_weight,
            None if bias is None else d_bias.astype(bias.dtype))


# -- the parts of logprob_core, and the primitive built from them ---------------------------

def kernel_parts(config: Config | None = None) -> Parts:
    """The ``logprob_core.Parts`` of these kernels under ``config``."""
    config = config or DEFAULT_CONFIG
    return Parts(functools.partial(linear_stats, config=config),
                 functools.partial(linear_backward, config=config))


def linear_logprobs(hidden, weight, bias, targets, row_valid, *, weight_layout, temperature,
                    return_entropy, config=None):
    """The ``linear_logprobs`` primitive on [N, D] hidden states: (logp [N], entropy [N] | None)."""
    return logprob_core.linear_logprobs(
        kernel_parts(config), hidden, weight, bias, targets.astype(jnp.int32), row_valid,
        weight_layout=weight_layout, temperature=float(temperature),
        return_entropy=bool(return_entropy))


OPS = {"linear_logprobs": kernel_parts(), "linear_logprobs_backward": linear_backward}
