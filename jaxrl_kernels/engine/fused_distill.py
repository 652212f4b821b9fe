"""``memory="fast"`` for ``linear_distill_loss``: the divergence's gradient taken in the forward.

Each token's divergence ``d`` (``divergence_math``) is a function of its two logit rows only,
so the forward can write its gradient ``J = ∂d/∂z_s`` (for a unit cotangent, with the ``1/T``
of ``z_s = (h·Wᵀ + b) / T``) as soon as both rows are known. A block of rows at a time::

    z_s = h_s·W_sᵀ,  z_t = h_t·W_tᵀ       two GEMMs with float32 results: [rows, V] each
    lse_s, lse_t, d (, KL_s)              row statistics (divergence_math) of those products
    J = ∂d/∂z_s                           rounded once to the student head's dtype into
                                          the one [N, V] buffer kept for the backward (a
                                          float16 one scaled per row by a power of two σ,
                                          its largest entry to 2¹⁴)

and the backward, given each token's cotangent ``g``, runs the two GEMMs left::

    d_hidden = g ⊙ (J·W_s),   d_weight = Jᵀ·(g ⊙ h_s),   d_bias = Σ_rows g ⊙ J

(float16: with ``σ·J`` and ``g/σ``; the scaling is exact, and keeps the small entries of
``J`` out of float16's subnormals).

Four GEMMs (teacher and student forward, ``d_hidden``, ``d_weight``), as many as the plain
code that materialises both heads' logits. The statistics, ``d`` and ``J`` see the GEMMs'
float32 accumulators, never logits rounded to 16 bits, so ``d`` (and the loss) is as accurate
as the lean path's, and the gradient carries one rounding of ``J`` to the head's dtype, as the
plain bf16 code's logit gradient does. Memory: the ``[N, V]`` buffer of ``J`` in the student
head's dtype, and one block's float32 logits of both heads (``BLOCK_BYTES``) with the
elementwise work beside them. ``g`` scales the ``[N, D]`` sides only (``d_hidden``'s float32
GEMM result, and ``h_s`` before ``d_weight``'s GEMM, rounded once to its dtype), so the
``[V, D]`` GEMM writes the head's dtype directly. Under a vocabulary split each block's row
statistics cross devices (``pmax`` / ``psum`` of per-row values) before its ``J`` is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels.engine import vjp
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.head import geometry, head_grad, kept_grads, rounded_logits
from jaxrl_kernels.head.blocks import equal_blocks
from jaxrl_kernels.sharding.vma import varying_like

BLOCK_BYTES = 2**30
"""A block's float32 logits of both heads come to at most this many bytes; the blocks all have
one size, the fewest that cover the rows."""


def _scaled_logits(hidden, weight, bias, layout, temperature):
    """``(hidden·Wᵀ + b) / T`` [rows, V] in float32, from the GEMM's float32 accumulator."""
    z = geometry.float32_logits(hidden, weight, bias, layout)
    return z if temperature == 1.0 else z / temperature


def _rows_stats(plan, a, t, *, divergence, beta, temperature):
    """Rows of both heads' scaled logits ``a``, ``t`` [rows, V_local] (float32):
    ``(d, lse_s, lse_t, kl_s)`` per row (``kl_s``: the JSD's KL(p_s ‖ m), else 0)."""
    stats = dm.pair_stats_update(dm.pair_stats_init(a.shape[:1]), a, t, True)
    stats = dm.pair_stats_combine(stats, plan.vocab_axes)
    lse_s, lse_t, reverse, forward = dm.pair_stats_finalize(stats)
    d, kl_s = dm.choose_divergence(
        divergence,
        beta,
        reverse,
        forward,
        lambda: dm.jsd_tile_sums(a, t, lse_s, lse_t, True, beta),
        plan.vocab_axes,
    )
    return d, lse_s, lse_t, kl_s


def _local_forward(
    plan,
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    *,
    weight_layout,
    teacher_weight_layout,
    block_bytes,
    **math,
):
    """This device's flat rows and vocabulary slice: ``d`` [N], then the residuals ``1/σ`` [N]
    and ``σ·J`` [N, V_local].

    A block of rows at a time: both heads' float32 logits, their row statistics, ``d`` and
    ``J``. The last block ends at N and so repeats a few rows of its predecessor, which it
    recomputes from the same operands."""
    h, th = hidden, t_hidden
    n, vocab = h.shape[0], geometry.vocab_size(weight, weight_layout)
    kept = rounded_logits.kept_dtype(hidden.dtype, weight.dtype)
    spans = equal_blocks(n, block_bytes // max(1, 2 * vocab * 4))
    divergence, beta, temperature = math["divergence"], math["beta"], math["temperature"]

    def block(i, carry):
        d_all, inv_all, grad = carry
        start = spans.start(i)
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, spans.size)
        a = _scaled_logits(rows(h), weight, bias, weight_layout, temperature)
        t = _scaled_logits(rows(th), t_weight, t_bias, teacher_weight_layout, temperature)
        d, lse_s, lse_t, kl_s = _rows_stats(plan, a, t, **math)
        j = dm.student_grad_tile(
            divergence, a, t, lse_s, lse_t, d, kl_s, jnp.ones_like(d), beta, temperature
        )
        sigma = (
            _row_scale(j, plan.vocab_axes)
            if kept == jnp.float16
            else jnp.ones(j.shape[:1], jnp.float32)
        )
        update = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, start, 0)
        return (
            update(d_all, d),
            update(inv_all, 1.0 / sigma),
            update(grad, (j * sigma[:, None]).astype(kept)),
        )

    # d and σ have crossed the vocabulary slices (psum, pmax): they vary with the rows only
    per_row = varying_like(jnp.zeros((n,), jnp.float32), hidden, t_hidden)
    init = (per_row, per_row, varying_like(jnp.zeros((n, vocab), kept), hidden, weight, t_hidden))
    return jax.lax.fori_loop(0, spans.count, block, init)


def _row_scale(j, vocab_axes):
    """σ per row of ``j`` [rows, V_local]: the power of two that brings the row's largest
    ``|J|`` (over the whole vocabulary) to at most 2¹⁴, so that ``σ·J`` keeps float16's full
    precision (its subnormals start at 6.1e-5) and dividing by σ is exact. (bfloat16 has
    float32's exponent range: there σ = 1, and no pass over the block for its maximum.)"""
    amax = jnp.max(jnp.abs(j), axis=-1)
    if vocab_axes:
        amax = jax.lax.pmax(amax, vocab_axes)
    return head_grad.pow2_range(amax)


def _local_backward(
    plan,
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    row_valid,
    inv_sigma,
    grad,
    g,
    *,
    weight_layout,
):
    """``(g ⊙ J·W, Jᵀ·(g ⊙ h), Σ g ⊙ J)`` on one device's flat rows (see the module
    docstring), from the kept ``σ·J`` and ``1/σ``: ``g/σ`` scales its rows, exactly.
    ``d_hidden`` is float32 (rounded after the sum over vocabulary slices)."""
    del plan, t_hidden, t_weight, t_bias
    g = jnp.where(row_valid, g.astype(jnp.float32) * inv_sigma, 0.0)[:, None]
    d_hidden, d_weight = kept_grads.row_scaled_grads(grad, hidden, weight, weight_layout, g)
    if bias is None:
        return d_hidden, d_weight, None
    return d_hidden, d_weight, jnp.sum(grad.astype(jnp.float32) * g, axis=0).astype(bias.dtype)


def divergence_rows(operands, row_valid, *, opts, vocab_axis):
    """Per-row ``d`` [B, T] of the validated heads ``operands`` = (hidden, weight, bias,
    t_hidden, t_weight, t_bias), its gradient to the student taken in the forward (the
    teacher's operands get none)."""
    rows = "rr"
    roles = (
        rows + "-",
        geometry.roles(opts["weight_layout"]),
        "v",
        rows + "-",
        geometry.roles(opts["teacher_weight_layout"]),
        "v",
        rows,
    )

    def forward(plan, *args):
        return _local_forward(plan, *args[:6], block_bytes=BLOCK_BYTES, **opts)

    backward = functools.partial(_local_backward, weight_layout=opts["weight_layout"])
    (d,) = vjp.differentiable(
        forward,
        backward,
        tuple(operands) + (row_valid,),
        roles,
        (rows,),
        (rows, rows + "v"),
        diff=(0, 1, 2),
        unused=(3, 4, 5),
        vocab_axis=vocab_axis,
    )
    return d
