"""``memory="fast"`` for ``linear_distill_loss``: the divergence's gradient taken in the forward.

Each token's divergence ``d`` (``divergence_math``) is a function of its two logit rows only,
so the forward can write its gradient ``J = ∂d/∂z_s`` (for a unit cotangent, with the ``1/T``
of ``z_s = (h·Wᵀ + b) / T``) as soon as both rows are known::

    z_s = h_s·W_sᵀ                        one GEMM, rounded once to the head's dtype: [N, V]
    z_t = h_t·W_tᵀ                        a block of rows at a time (TEACHER_BLOCK_BYTES)
    lse_s, lse_t, d (, KL_s)              row statistics (divergence_math), and
    J = ∂d/∂z_s                           written over z_s, a smaller block at a time

and the backward, given each token's cotangent ``g``, runs the two GEMMs left::

    d_hidden = g ⊙ (J·W_s),   d_weight = Jᵀ·(g ⊙ h_s),   d_bias = Σ_rows g ⊙ J

Four GEMMs (teacher and student forward, ``d_hidden``, ``d_weight``), as many as the plain
code that materialises both heads' logits, but one ``[N, V]`` buffer from the forward to the
backward (the student's logits, then ``J`` in their place) and a block of the teacher's
logits, instead of two heads' logits and their float32 softmaxes. ``g`` scales the ``[N, D]``
sides only (``d_hidden``'s float32 GEMM result, and ``h_s`` before ``d_weight``'s GEMM,
rounded once to its dtype), so the ``[V, D]`` GEMM writes the head's dtype directly.

As in the plain bf16 code, ``lse`` and ``J`` see the logits rounded to the head's dtype, and
``J`` is rounded to it once more. Under a vocabulary split each block's row statistics cross
devices (``pmax`` / ``psum`` of per-row values) before its ``J`` is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels import divergence_math as dm
from jaxrl_kernels import head, saved_logits, sharding
from jaxrl_kernels.placement import varying_like

TEACHER_BLOCK_BYTES = 2**30
"""The teacher's logits are computed in blocks of rows of at most this many bytes (in its head's
dtype), all of one size: the forward's largest buffer beyond the kept ``[N, V]`` one. (H200,
N=4096, D_s=2048, D_t=4096, V=151936, reverse KL: 21.7 ms forward+backward against 22.2 for
256 MiB blocks and 21.4 for the whole teacher at once, which doubles the memory.)"""

ROW_BLOCK_BYTES = 64 * 2**20
"""Within a teacher block, ``J`` is written over the student's logits in blocks of rows whose
float32 logits come to about this size."""


def equal_blocks(n_rows: int, max_rows: int) -> tuple[int, int]:
    """``(count, size)``: the fewest blocks of at most ``max_rows`` rows covering ``n_rows``,
    all of one size (the last one ends at ``n_rows``, overlapping its predecessor by less
    than ``count`` rows)."""
    count = -(-n_rows // max(1, min(max_rows, n_rows)))
    return count, -(-n_rows // count)


def _rows_stats(plan, a, t, *, divergence, beta, temperature):
    """Rows of both heads' scaled logits ``a``, ``t`` [rows, V_local] (float32):
    ``(d, lse_s, lse_t, kl_s)`` per row (``kl_s``: the JSD's KL(p_s ‖ m), else 0)."""
    stats = dm.pair_stats_update(dm.pair_stats_init(a.shape[:1]), a, t, True)
    stats = dm.pair_stats_combine(stats, plan.vocab_axes)
    lse_s, lse_t, reverse, forward = dm.pair_stats_finalize(stats)
    d, kl_s = dm.choose_divergence(divergence, beta, reverse, forward,
                                   lambda: dm.jsd_tile_sums(a, t, lse_s, lse_t, True, beta),
                                   plan.vocab_axes)
    return d, lse_s, lse_t, kl_s


def _local_forward(plan, hidden, weight, bias, t_hidden, t_weight, t_bias, *, weight_layout,
                   teacher_weight_layout, teacher_block_bytes, row_block_bytes, **math):
    """This device's rows [B, T, ·] and vocabulary slice: ``(d [B, T], J [B, T, V_local])``.

    The student's logits ``z`` [N, V] come from one GEMM and become ``J`` in place; the
    teacher's come a block of rows at a time, whose row statistics are reductions over the
    whole block and whose ``J`` is written a smaller block at a time. Blocks that end at N
    start early: rows already done (below ``done``) keep what they hold."""
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    th = t_hidden.reshape(-1, t_hidden.shape[-1])
    n, vocab = h.shape[0], head.vocab_size(weight, weight_layout)
    kept = saved_logits.kept_dtype(hidden.dtype, weight.dtype)
    t_itemsize = saved_logits.kept_dtype(t_hidden.dtype, t_weight.dtype).itemsize
    t_count, t_size = equal_blocks(n, teacher_block_bytes // max(1, vocab * t_itemsize))
    r_count, r_size = equal_blocks(t_size, row_block_bytes // max(1, vocab * 4))
    temperature = math["temperature"]
    z = saved_logits._product(h, weight, weight_layout, saved_logits.DEFAULT)

    def teacher_block(i, carry):
        d_all, z, done = carry
        t0 = jnp.minimum(i * t_size, n - t_size)
        z_t = saved_logits._product(jax.lax.dynamic_slice_in_dim(th, t0, t_size), t_weight,
                                    teacher_weight_layout, saved_logits.DEFAULT)
        a = saved_logits._scaled(jax.lax.dynamic_slice_in_dim(z, t0, t_size), bias, temperature)
        stats = _rows_stats(plan, a, saved_logits._scaled(z_t, t_bias, temperature), **math)
        fresh = t0 + jnp.arange(t_size) >= done
        d = jnp.where(fresh, stats[0], jax.lax.dynamic_slice_in_dim(d_all, t0, t_size))

        def row_block(k, carry):
            z, done = carry
            r0 = jnp.minimum(k * r_size, t_size - r_size)
            start = t0 + r0
            z_s = jax.lax.dynamic_slice_in_dim(z, start, r_size)
            a = saved_logits._scaled(z_s, bias, temperature)
            t = saved_logits._scaled(jax.lax.dynamic_slice_in_dim(z_t, r0, r_size), t_bias,
                                     temperature)
            d, lse_s, lse_t, kl_s = (jax.lax.dynamic_slice_in_dim(x, r0, r_size)
                                     for x in stats)
            j = dm.student_grad_tile(math["divergence"], a, t, lse_s, lse_t, d, kl_s,
                                     jnp.ones_like(d), math["beta"], temperature)
            j = jnp.where((start + jnp.arange(r_size) >= done)[:, None], j.astype(kept), z_s)
            return jax.lax.dynamic_update_slice_in_dim(z, j, start, 0), start + r_size

        z, done = jax.lax.fori_loop(0, r_count, row_block, (z, done))
        return jax.lax.dynamic_update_slice_in_dim(d_all, d, t0, 0), z, done

    # d has crossed the vocabulary slices (psum): it varies with the rows only
    init = (varying_like(jnp.zeros((n,), jnp.float32), hidden, t_hidden), z, jnp.int32(0))
    d, grad, _ = jax.lax.fori_loop(0, t_count, teacher_block, init)
    return d.reshape(lead), grad.reshape(lead + (vocab,))


def _local_backward(plan, hidden, weight, bias, grad, row_valid, g, *, weight_layout):
    """``(g ⊙ J·W, Jᵀ·(g ⊙ h), Σ g ⊙ J)`` on one device (see the module docstring)."""
    g = plan.output_cotangent(g, weight)
    g = jnp.where(row_valid, g.astype(jnp.float32), 0.0).reshape(-1, 1)
    h = hidden.reshape(-1, hidden.shape[-1])
    j = grad.reshape(-1, grad.shape[-1])
    dtype = jnp.result_type(hidden, weight)
    precision = head.matmul_precision(dtype)
    j = j.astype(dtype)
    d_hidden = head.hidden_grad(j, weight.astype(dtype), weight_layout, precision=precision,
                                preferred_element_type=jnp.float32) * g
    h_scaled = (h.astype(jnp.float32) * g).astype(dtype)
    d_weight = head.weight_grad(j, h_scaled, weight_layout, precision=precision,
                                preferred_element_type=saved_logits.gemm_dtype(weight.dtype))
    d_bias = None if bias is None else jnp.sum(j.astype(jnp.float32) * g, axis=0)
    return (d_hidden.astype(hidden.dtype).reshape(hidden.shape), d_weight.astype(weight.dtype),
            None if bias is None else d_bias.astype(bias.dtype))


def divergence_rows(operands, row_valid, *, opts, vocab_axis, record):
    """Per-row ``d`` [B, T] of the validated heads ``operands`` = (hidden, weight, bias,
    t_hidden, t_weight, t_bias), its gradient to the student taken in the forward (the
    teacher's operands get none)."""
    rows = "rr"
    roles = (rows + "-", head.roles(opts["weight_layout"]), "v", rows + "-",
             head.roles(opts["teacher_weight_layout"]), "v")
    forward = functools.partial(_local_forward, teacher_block_bytes=TEACHER_BLOCK_BYTES,
                                row_block_bytes=ROW_BLOCK_BYTES, **opts)
    backward = functools.partial(_local_backward, weight_layout=opts["weight_layout"])

    @jax.custom_vjp
    def op(*args):
        return fwd(*args)[0]

    def fwd(h, w, b, th, tw, tb, valid):
        d, grad = sharding.run(forward, (h, w, b, th, tw, tb), roles, (rows, rows + "v"),
                               vocab_axis=vocab_axis, record=record)
        return d, (h, w, b, grad, valid)

    def bwd(res, g):
        h, w, b, grad, valid = res
        has_bias = b is not None
        grads = sharding.run(backward, (h, w, b, grad, valid, g),
                             roles[:3] + (rows + "v", rows, rows),
                             roles[:2] + (("v",) if has_bias else ()),
                             grads_of=(0, 1) + ((2,) if has_bias else ()),
                             vocab_axis=vocab_axis)
        db = grads[2] if has_bias else None
        return grads[0], grads[1], db, None, None, None, None  # the teacher and the mask: zero

    op.defvjp(fwd, bwd)
    return op(*operands, row_valid)
