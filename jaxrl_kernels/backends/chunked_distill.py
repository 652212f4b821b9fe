"""The chunked backend's distillation and top-k ops: jnp over vocabulary chunks, no [N, V] buffer.

Both are ``logprob_core.Parts`` on one device's rows [N] and vocabulary slice; each part
combines its per-row statistics across the vocabulary axes it is given (``vocab_axes``) itself.

``distill_divergence`` (see ``divergence_math`` for the math), with ``S`` a GEMM of the student
head ([N, D_s] × [D_s, V]) and ``T`` one of the teacher head ([N, D_t] × [D_t, V]):

* forward, reverse / forward KL: one pass over the chunks, both heads' logits per chunk
  (``S + T``), folding each head's online logsumexp and the rescaled cross sums ``A_s``, ``A_t``;
  ``d = A_s / s_s − lse_s + lse_t`` (reverse) or ``A_t / s_t − lse_t + lse_s`` (forward).
* forward, JSD: that pass for ``lse_s``, ``lse_t`` (``S + T``), then a second one that sums
  ``KL_t`` and ``KL_s`` per chunk (``S + T``).
* backward: one pass recomputing both heads' chunk logits (``S + T``), forming the student's
  logit gradient ``dz_s`` per chunk, then ``d_hidden += dz_s · W_c`` and ``d_W_c = dz_sᵀ ·
  hidden`` (``2 S``: float32 GEMMs for a float32 head, float16 operands scaled by powers of
  two for a 16-bit one, see :func:`student_backward`). The teacher needs no backward GEMM.

GEMMs per forward + backward: ``4 S + 2 T`` for either KL, ``5 S + 3 T`` for the JSD.

``topk_logprobs``: one pass keeping each row's online logsumexp and a running top-k
(``lax.top_k`` of the current k and the chunk's columns, in id order, so that equal logits keep
the lower id); the backward recomputes the chunk's softmax and adds the one-hot cotangents of
the k values ``z[ids]`` by a scatter: ``dz = g_lse p + Σ_j g_j onehot(id_j)``, then two GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import divergence_math as dm
from jaxrl_kernels import softmax_math
from jaxrl_kernels.logprob_core import Parts
from jaxrl_kernels.placement import varying_like
from jaxrl_kernels import head
from jaxrl_kernels.head import matmul_precision

CHUNK_BYTES = 16 * 2**20
"""Target size of one float32 [N, chunk] tile (a few are live at once, per head)."""


def _chunked():
    from jaxrl_kernels.backends import chunked  # imported late: chunked imports this module
    return chunked


def _scan(body, init, n_rows: int, vocab: int):
    """``chunked``'s chunk loop with this module's chunk size (:data:`CHUNK_BYTES`)."""
    ck = _chunked()
    size = CHUNK_BYTES // (4 * max(n_rows, 1))
    size = min(vocab, max(128, size - size % 128))

    def step(carry, c):
        return body(carry, *ck._chunk_columns(c, size, vocab), size), None

    return jax.lax.scan(step, init, jnp.arange(-(-vocab // size)))[0]


def _pow2_scale(amax):
    """2¹⁴ / (the smallest power of two >= amax): x · it lies in [−2¹⁴, 2¹⁴] for |x| <= amax,
    inside float16's range (exact: a power of two; 1 where amax is 0 or not finite)."""
    ok = jnp.isfinite(amax) & (amax > 0)
    top = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(ok, amax, 1.0))))
    return jnp.where(ok, 2.0 ** 14 / top, 1.0).astype(jnp.float32)


def student_backward(hidden, weight, bias, weight_layout, tile_grad, operands):
    """(d_hidden, d_weight, d_bias | None) from ``tile_grad(start, cols, fresh, size)``, the
    float32 logit gradient [N, size] of a chunk: two GEMMs per chunk (the pallas backend's
    kernels supply ``tile_grad`` too).

    float32 heads: float32 GEMMs. 16-bit heads: float16 operands with float32 accumulation,
    every operand scaled by a power of two into float16's range (exact, divided out after the
    GEMM): ``G = σ_c dz`` with σ_c from the chunk's max |dz|, ``h16 = σ_h hidden`` and
    ``W16 = σ_W W`` from their max |x|, so that ``d_hidden += (G·W16_c) / (σ_c σ_W)`` and
    ``d_W_c = (Gᵀ·h16) / (σ_c σ_h)``; float16 keeps 2⁻¹¹ of each entry (bfloat16: 2⁻⁸)."""
    n_rows, vocab = hidden.shape[0], head.vocab_size(weight, weight_layout)
    low = jnp.dtype(hidden.dtype).itemsize == 2 and jnp.dtype(weight.dtype).itemsize == 2
    if low:
        sigma_h = _pow2_scale(jnp.max(jnp.abs(hidden.astype(jnp.float32))))
        sigma_w = _pow2_scale(jnp.max(jnp.abs(weight.astype(jnp.float32))))
        h_op = (hidden.astype(jnp.float32) * sigma_h).astype(jnp.float16)
        op_dtype, precision = jnp.float16, jax.lax.Precision.DEFAULT
    else:
        sigma_h = sigma_w = jnp.float32(1.0)
        h_op = hidden.astype(jnp.float32)
        op_dtype, precision = jnp.float32, matmul_precision(jnp.float32)

    dot = dict(precision=precision, preferred_element_type=jnp.float32)

    def body(carry, start, cols, fresh, size):
        d_hidden, d_weight, d_bias = carry
        dz = jnp.where(fresh, tile_grad(start, cols, fresh, size), 0.0)
        sigma = _pow2_scale(jnp.max(jnp.abs(dz))) if low else jnp.float32(1.0)
        g = (dz * sigma).astype(op_dtype)
        w = head.vocab_slice(weight, start, size, weight_layout).astype(jnp.float32)
        w = (w * sigma_w).astype(op_dtype)
        d_hidden = d_hidden + head.hidden_grad(g, w, weight_layout, **dot) / (sigma * sigma_w)
        d_w = head.weight_grad(g, h_op, weight_layout, **dot) / (sigma * sigma_h)
        d_weight, d_bias = _chunked().accumulate_chunk(d_weight, d_bias, d_w, dz, start, fresh,
                                                       size, weight_layout)
        return d_hidden, d_weight, d_bias

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(weight),
            None if bias is None else jnp.zeros((vocab,), jnp.float32))
    d_hidden, d_weight, d_bias = _scan(body, varying_like(init, *operands), n_rows, vocab)
    return (d_hidden.astype(hidden.dtype), d_weight,
            None if bias is None else d_bias.astype(bias.dtype))


# -- distillation -------------------------------------------------------------------------

def _both_chunks(student, teacher, temperature):
    ck = _chunked()
    zs = ck._linear_chunk(*student, temperature)
    zt = ck._linear_chunk(*teacher, temperature)
    return lambda start, size: (zs(start, size), zt(start, size))


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, *, weight_layout,
                    teacher_weight_layout, divergence, beta, temperature, vocab_axes=()):
    """Per row [N]: ``(d, lse_s, lse_t, kl_s)`` (``kl_s`` = KL(p_s ‖ m) for the JSD, else 0)."""
    n_rows, vocab = hidden.shape[0], head.vocab_size(weight, weight_layout)
    chunks = _both_chunks((hidden, weight, bias, weight_layout),
                          (t_hidden, t_weight, t_bias, teacher_weight_layout), temperature)

    def body(stats, start, cols, fresh, size):
        return dm.pair_stats_update(stats, *chunks(start, size), fresh)

    operands = (hidden, weight, bias, t_hidden, t_weight, t_bias)
    stats = _scan(body, varying_like(dm.pair_stats_init((n_rows,)), *operands), n_rows,
                            vocab)
    stats = dm.pair_stats_combine(stats, vocab_axes)
    lse_s, lse_t, reverse, forward = dm.pair_stats_finalize(stats)

    def body2(sums, start, cols, fresh, size):
        kl_t, kl_s = dm.jsd_tile_sums(*chunks(start, size), lse_s, lse_t, fresh, beta)
        return sums[0] + kl_t, sums[1] + kl_s

    def jsd_sums():
        zero = jnp.zeros_like(lse_s)
        return _scan(body2, varying_like((zero, zero), *operands, lse_s, lse_t), n_rows, vocab)

    d, kl_s = dm.choose_divergence(divergence, beta, reverse, forward, jsd_sums, vocab_axes)
    return d, lse_s, lse_t, kl_s


def distill_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, lse_s, lse_t, d, kl_s,
                     g, *, weight_layout, teacher_weight_layout, divergence, beta, temperature):
    """(d_hidden, d_weight, d_bias | None) of the student for per-row cotangents ``g``."""
    chunks = _both_chunks((hidden, weight, bias, weight_layout),
                          (t_hidden, t_weight, t_bias, teacher_weight_layout), temperature)

    def tile_grad(start, cols, fresh, size):
        zs, zt = chunks(start, size)
        return dm.student_grad_tile(divergence, zs, zt, lse_s, lse_t, d, kl_s, g, beta,
                                    temperature)

    return student_backward(hidden, weight, bias, weight_layout, tile_grad,
                             (hidden, weight, bias, t_hidden, t_weight, t_bias, lse_s, lse_t, d,
                              kl_s, g))


# -- top-k log-probs -------------------------------------------------------------------------

def topk_forward(hidden, weight, bias, *, k, weight_layout, temperature, vocab_offset,
                 vocab_axes=()):
    """``(values [N, k], ids [N, k] int32, lse [N])``: the k largest logits of each row (global
    ids, equal values in id order) and the row's logsumexp."""
    ck = _chunked()
    n_rows, vocab = hidden.shape[0], head.vocab_size(weight, weight_layout)
    k_local = min(k, vocab)
    z_chunk = ck._linear_chunk(hidden, weight, bias, weight_layout, temperature)

    def body(carry, start, cols, fresh, size):
        stats, values, ids = carry
        z = jnp.where(fresh, z_chunk(start, size), -jnp.inf)
        stats = softmax_math.online_softmax_update(stats, z)
        cand_v = jnp.concatenate([values, z], axis=1)
        cand_i = jnp.concatenate(
            [ids, jnp.broadcast_to((cols + vocab_offset).astype(jnp.int32), z.shape)], axis=1)
        values, ids = dm.topk_merge(cand_v, cand_i, k_local)
        return stats, values, ids

    init = (softmax_math.online_softmax_init((n_rows,), False),
            jnp.full((n_rows, k_local), -jnp.inf, jnp.float32),
            jnp.full((n_rows, k_local), -1, jnp.int32))
    stats, values, ids = _scan(body, varying_like(init, hidden, weight, bias), n_rows,
                                         vocab)
    if vocab_axes:
        m_all = jax.lax.pmax(stats[0], vocab_axes)
        stats = (m_all, jax.lax.psum(stats[1] * jnp.exp(stats[0] - m_all), vocab_axes))
    lse, _ = softmax_math.online_softmax_finalize(stats)
    values, ids = dm.topk_across_shards(values, ids, k, vocab_axes)
    return values, ids, lse


def topk_backward(hidden, weight, bias, local_ids, lse, g_values, g_lse, *, weight_layout,
                  temperature):
    """(d_hidden, d_weight, d_bias | None) for cotangents of the values ``z[ids]`` [N, k] and
    of ``lse`` [N]; ``local_ids`` are this device's column indices (any other value: an id
    another shard holds)."""
    ck = _chunked()
    z_chunk = ck._linear_chunk(hidden, weight, bias, weight_layout, temperature)
    rows = jnp.broadcast_to(jnp.arange(hidden.shape[0])[:, None], local_ids.shape)

    def tile_grad(start, cols, fresh, size):
        p = jnp.exp(z_chunk(start, size) - lse[:, None])
        dz = g_lse[:, None] * p
        at = local_ids - start
        at = jnp.where((at >= 0) & (at < size), at, size)  # size: out of bounds, dropped
        dz = dz.at[rows, at].add(g_values, mode="drop")
        return dz / temperature

    return student_backward(hidden, weight, bias, weight_layout, tile_grad,
                             (hidden, weight, bias, local_ids, lse, g_values, g_lse))


OPS = {
    "distill_divergence": Parts(distill_forward, distill_backward),
    "topk_logprobs": Parts(topk_forward, topk_backward),
}
