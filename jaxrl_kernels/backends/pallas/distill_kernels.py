"""The Mosaic GPU kernels of the Pallas ``distill_divergence`` (the op and backward glue
around them: ``distill.py``).

Every kernel works on a block of :data:`BLOCK_ROWS` tokens against the vocabulary in tiles of
:data:`BLOCK_VOCAB` columns. A tile's logits of either head are a wgmma GEMM over the hidden
dimension in steps of :data:`BLOCK_K` (``plgpu.emit_pipeline``: TMA loads of the hidden
block and the weight tile, :data:`PIPELINE_DEPTH` steps in flight), scaled by ``1/T`` and
added to ``b/T``. Each head is padded to whole tiles (:func:`prepare`); padded vocabulary
columns get the logit :data:`PAD_LOGIT`, so that ``p = 0`` there and they add nothing (no mask
in the kernels).

* :func:`pair_stats` (forward): per row block, a loop over every vocabulary tile folds both
  heads' tiles into ``divergence_math``'s pair statistics (``S + T`` GEMMs).
* :func:`jsd_sums` (forward, JSD only): the same loop summing ``KL_t`` and ``KL_s`` once
  ``lse_s`` and ``lse_t`` are known (``S + T``).
* :func:`student_grad` (backward): per vocabulary chunk, the student's float32 logit
  gradient ``dz`` (``divergence_math.student_grad_tile``) of every tile of the chunk
  (``S + T``).

Off a GPU they run in Mosaic GPU interpret mode (``plgpu.InterpretGPUParams``, jax ≥ 0.12) in
a host callback (:func:`_kernel`), for the tests: unsharded, under Explicit mesh axes and in
``shard_map`` (under Auto axes XLA's CPU runtime crashes running the callback).
"""

from __future__ import annotations

import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.head import geometry
from jaxrl_kernels.sharding.vma import varying_like

BLOCK_ROWS = 64
"""Tokens per kernel program: one warpgroup's wgmma M."""
BLOCK_VOCAB = 128
"""Vocabulary columns per tile: the wgmma N."""
BLOCK_K = 128
"""Hidden-dimension step (two 128-byte swizzled rows of 16-bit values)."""
PIPELINE_DEPTH = 4
"""Hidden-dimension steps whose operands are in shared memory at once (4 × 48 KiB; five,
240 KiB, exceed an H100's 227 KiB of shared memory per block). docs/performance.md compares
this setting with 64-wide steps, two in flight."""
PAD_LOGIT = -1e30
"""The logit (already divided by T) of a padded vocabulary column: ``exp`` of it is 0."""

_ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a [BLOCK_ROWS, BLOCK_VOCAB] tile
_COL = plgpu.Layout.WGMMA.reduce(0)  # a value per column
_OPERAND = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_F32_TILE = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

_LOAD_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_TAKES_INDEX = _LOAD_IDX is not None and _LOAD_IDX.default is inspect.Parameter.empty


def _load(ref, layout):
    if _LOAD_TAKES_INDEX:  # an older plgpu.load(src, idx)
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def pad(x, axis, multiple, value=0.0):
    """``x`` padded with ``value`` along ``axis`` to a multiple of ``multiple`` (no copy where
    it is one)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def prepare(hidden, weight, bias, layout, temperature):
    """``(hidden [Np, Dp], weight, b/T [Vp] float32)`` padded to whole tiles: zero rows and
    hidden columns, :data:`PAD_LOGIT` on the padded vocabulary (a copy only where unaligned)."""
    v_axis, vocab = geometry.vocab_axis(layout), geometry.vocab_size(weight, layout)
    hidden = pad(pad(hidden, 0, BLOCK_ROWS), 1, BLOCK_K)
    weight = pad(pad(weight, v_axis, BLOCK_VOCAB), 1 - v_axis, BLOCK_K)
    b = jnp.zeros((vocab,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    return hidden, weight, pad(b / temperature, 0, BLOCK_VOCAB, PAD_LOGIT)


# -- in-kernel pieces --------------------------------------------------------------------------


def _head_tile(h_rows, w_tile, layout, depth):
    """``h_rows [BLOCK_ROWS, Dp] · W_tileᵀ`` [BLOCK_ROWS, BLOCK_VOCAB] float32 (GMEM refs;
    ``w_tile`` is the tile's ``[BLOCK_VOCAB, Dp]`` or ``[Dp, BLOCK_VOCAB]``). One wgmma stays
    in flight while the next step's operands land; a step's buffers are released one step
    late (``delay_release``) so that it can."""
    n_k = h_rows.shape[1] // BLOCK_K
    depth = min(depth, n_k)
    late = 1 if depth > 1 else 0
    spec = lambda shape, index: plgpu.BlockSpec(
        shape, index, transforms=_OPERAND, delay_release=late
    )
    h_spec = spec((BLOCK_ROWS, BLOCK_K), lambda k: (0, k))
    if layout == "vd":
        w_spec = spec((BLOCK_VOCAB, BLOCK_K), lambda k: (0, k))
    else:
        w_spec = spec((BLOCK_K, BLOCK_VOCAB), lambda k: (k, 0))

    def compute(acc_ref):
        def step(_, h_smem, w_smem):
            plgpu.wgmma(acc_ref, h_smem, w_smem.transpose((1, 0)) if layout == "vd" else w_smem)
            plgpu.wgmma_wait(late)

        plgpu.emit_pipeline(
            step, grid=(n_k,), in_specs=[h_spec, w_spec], max_concurrent_steps=depth
        )(h_rows, w_tile)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(compute, plgpu.ACC((BLOCK_ROWS, BLOCK_VOCAB), jnp.float32))


def _vocab_tile(w, j, layout):
    cols = pl.ds(j * BLOCK_VOCAB, BLOCK_VOCAB)
    return w.at[cols] if layout == "vd" else w.at[:, cols]


def _logits(h_rows, w_tile, bias_cols, layout, inv_t, depth):
    z = _head_tile(h_rows, w_tile, layout, depth) * inv_t
    return z + lax.broadcast_in_dim(bias_cols, z.shape, (1,))


def _kernel(body, out_type, scratch, grid, grid_names):
    """The Mosaic GPU kernel ``body`` as a function of arrays, its results typed as varying
    over the manual axes its operands vary over (a host callback's result is typed varying
    over none, and autodiff would then sum a cotangent over those axes). Off a GPU it runs in
    Mosaic GPU interpret mode inside a ``jax.pure_callback``, one kernel at a time (the
    interpreter's state is global): its ordered IO effects would otherwise reach
    ``custom_partitioning`` and ``shard_map``, which lower none."""
    emulated = common.interpret()
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(),
        interpret=plgpu.InterpretGPUParams() if emulated else None,
    )
    if not emulated:
        return lambda *args: varying_like(call(*args), *args)
    run = jax.jit(call)

    def run_alone(*args):  # the interpreter's state is global: one kernel at a time
        with _INTERPRETER_LOCK:
            return jax.tree.map(np.asarray, run(*args))

    def on_host(*args):
        out = jax.pure_callback(run_alone, out_type, *args, vmap_method="sequential")
        return varying_like(out, *args)

    return on_host


_INTERPRETER_LOCK = threading.Lock()


def _load_rows(refs, block, smem, barriers, first):
    """The row values ``refs[i][block]`` (GMEM [Np] float32) in the row layout (through
    ``smem`` [>= len(refs), BLOCK_ROWS] and ``barriers[first + i]``)."""
    for i, ref in enumerate(refs):
        plgpu.copy_gmem_to_smem(ref.at[block], smem.at[i], barriers.at[first + i])
    values = []
    for i in range(len(refs)):
        plgpu.barrier_wait(barriers.at[first + i])
        values.append(_load(smem.at[i], _ROW))
    return values


def _bias_tile(b_ref, j, smem, barrier):
    """``b_ref`` [Vp]'s tile ``j`` in the column layout (through ``smem`` [BLOCK_VOCAB])."""
    plgpu.copy_gmem_to_smem(b_ref.at[pl.ds(j * BLOCK_VOCAB, BLOCK_VOCAB)], smem, barrier)
    plgpu.barrier_wait(barrier)
    return _load(smem, _COL)


def _both_logits(refs, block, j, bias_smem, barriers, layouts, inv_t, depth=PIPELINE_DEPTH):
    """Both heads' logits [BLOCK_ROWS, BLOCK_VOCAB] of row block ``block``, vocabulary tile
    ``j`` (``refs`` = the six GMEM refs; ``bias_smem``/``barriers`` hold two slots)."""
    hs, ws, bs, ht, wt, bt = refs
    out = []
    for i, (h, w, b) in enumerate(((hs, ws, bs), (ht, wt, bt))):
        bias = _bias_tile(b, j, bias_smem.at[i], barriers.at[i])
        out.append(
            _logits(h.at[block], _vocab_tile(w, j, layouts[i]), bias, layouts[i], inv_t, depth)
        )
    return out


def _row_pass(fold, init, student, teacher, row_inputs, *, layouts, temperature):
    """Per row: ``fold(carry, zs, zt, *rows)`` over every vocabulary tile of both heads,
    from ``init(shape)`` (float32 per-row values); returns the final carry, each [Np]."""
    n_rows, n_tiles = student[0].shape[0], student[2].shape[0] // BLOCK_VOCAB
    n_in, n_out = len(row_inputs), len(init((1,)))
    inv_t = 1.0 / temperature

    def body(*refs):
        heads, row_refs = refs[:6], refs[6 : 6 + n_in]
        out_refs = refs[6 + n_in : 6 + n_in + n_out]
        bias_smem, rows_smem, barriers = refs[6 + n_in + n_out :]
        block = pl.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)
        row_values = _load_rows(row_refs, block, rows_smem, barriers, 2)

        def step(j, carry):
            zs, zt = _both_logits(heads, block, j, bias_smem, barriers, layouts, inv_t)
            return fold(carry, zs, zt, *row_values)

        start = tuple(plgpu.layout_cast(x, _ROW) for x in init((BLOCK_ROWS,)))
        carry = lax.fori_loop(0, n_tiles, step, start)
        for i, x in enumerate(carry):
            rows_smem[i] = x
        plgpu.commit_smem()
        for i, ref in enumerate(out_refs):
            plgpu.copy_smem_to_gmem(rows_smem.at[i], ref.at[block])
        plgpu.wait_smem_to_gmem(0)

    n_slots = max(n_in, n_out)
    out = _kernel(
        body,
        [jax.ShapeDtypeStruct((n_rows,), jnp.float32)] * n_out,
        [
            plgpu.SMEM((2, BLOCK_VOCAB), jnp.float32),
            plgpu.SMEM((n_slots, BLOCK_ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=2 + max(n_in, 1)),
        ],
        (n_rows // BLOCK_ROWS,),
        ("rows",),
    )(*student, *teacher, *row_inputs)
    return tuple(out)


def pair_stats(student, teacher, *, layouts, temperature):
    """``divergence_math.pair_stats`` of every row (padded rows included)."""
    return _row_pass(
        lambda stats, zs, zt: dm.pair_stats_update(stats, zs, zt, None),
        dm.pair_stats_init,
        student,
        teacher,
        (),
        layouts=layouts,
        temperature=temperature,
    )


def jsd_sums(student, teacher, lse_s, lse_t, beta, *, layouts, temperature):
    """``(KL_t, KL_s)`` of every row given its ``lse_s``, ``lse_t`` [Np]."""

    def fold(sums, zs, zt, ls, lt):
        kl_t, kl_s = dm.jsd_tile_sums(zs, zt, ls, lt, None, beta)
        return sums[0] + kl_t, sums[1] + kl_s

    zeros = lambda shape: (jnp.zeros(shape, jnp.float32),) * 2
    return _row_pass(
        fold, zeros, student, teacher, (lse_s, lse_t), layouts=layouts, temperature=temperature
    )


def student_grad(student, teacher, rows, *, layouts, divergence, beta, temperature):
    """The float32 ``dz`` [Np, C] of one vocabulary chunk: ``student``/``teacher`` hold the
    chunk's weight columns and ``b/T``; ``rows`` = (lse_s, lse_t, d, kl_s, g) [Np]."""
    n_rows, size = student[0].shape[0], student[2].shape[0]
    inv_t = 1.0 / temperature

    def body(*refs):
        heads, row_refs, out_ref = refs[:6], refs[6:11], refs[11]
        bias_smem, rows_smem, out_smem, barriers = refs[12:]
        block = pl.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)
        j = lax.axis_index("tiles")
        lse_s, lse_t, d, kl_s, g = _load_rows(row_refs, block, rows_smem, barriers, 2)
        # one step less in flight: the float32 output tile takes its shared memory
        zs, zt = _both_logits(
            heads, block, j, bias_smem, barriers, layouts, inv_t, PIPELINE_DEPTH - 1
        )
        out_smem[...] = dm.student_grad_tile(
            divergence, zs, zt, lse_s, lse_t, d, kl_s, g, beta, temperature
        )
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[block, pl.ds(j * BLOCK_VOCAB, BLOCK_VOCAB)])
        plgpu.wait_smem_to_gmem(0)

    return _kernel(
        body,
        jax.ShapeDtypeStruct((n_rows, size), jnp.float32),
        [
            plgpu.SMEM((2, BLOCK_VOCAB), jnp.float32),
            plgpu.SMEM((5, BLOCK_ROWS), jnp.float32),
            plgpu.SMEM((BLOCK_ROWS, BLOCK_VOCAB), jnp.float32, transforms=_F32_TILE),
            plgpu.Barrier(num_barriers=7),
        ],
        (n_rows // BLOCK_ROWS, size // BLOCK_VOCAB),
        ("rows", "tiles"),
    )(*student, *teacher, *rows)
