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
  two for a 16-bit one, see ``vocab_chunks.student_backward``). The teacher needs no backward
  GEMM.

GEMMs per forward + backward: ``4 S + 2 T`` for either KL, ``5 S + 3 T`` for the JSD. A chunk
holds about ``vocab_chunks.DISTILL_CHUNK_BYTES`` of float32 logits.

``topk_logprobs``: one pass keeping each row's online logsumexp and a running top-k
(``lax.top_k`` of the current k and the chunk's columns, in id order, so that equal logits keep
the lower id); the backward recomputes the chunk's softmax and adds the one-hot cotangents of
the k values ``z[ids]`` by a scatter: ``dz = g_lse p + Σ_j g_j onehot(id_j)``, then two GEMMs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry, vocab_chunks
from jaxrl_kernels.head.vocab_chunks import linear_chunk, student_backward
from jaxrl_kernels.sharding.vma import varying_like


def _scan(body, init, n_rows: int, vocab: int):
    """``vocab_chunks.scan_chunks`` in chunks of ``vocab_chunks.DISTILL_CHUNK_BYTES``."""
    return vocab_chunks.scan_chunks(body, init, n_rows, vocab, vocab_chunks.DISTILL_CHUNK_BYTES)


# -- distillation -------------------------------------------------------------------------


def _both_chunks(student, teacher, temperature):
    zs = linear_chunk(*student, temperature)
    zt = linear_chunk(*teacher, temperature)
    return lambda start, size: (zs(start, size), zt(start, size))


def distill_forward(
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    *,
    weight_layout,
    teacher_weight_layout,
    divergence,
    beta,
    temperature,
    vocab_axes=(),
):
    """Per row [N]: ``(d, lse_s, lse_t, kl_s)`` (``kl_s`` = KL(p_s ‖ m) for the JSD, else 0)."""
    n_rows, vocab = hidden.shape[0], geometry.vocab_size(weight, weight_layout)
    chunks = _both_chunks(
        (hidden, weight, bias, weight_layout),
        (t_hidden, t_weight, t_bias, teacher_weight_layout),
        temperature,
    )

    def body(stats, start, cols, fresh, size):
        return dm.pair_stats_update(stats, *chunks(start, size), fresh)

    operands = (hidden, weight, bias, t_hidden, t_weight, t_bias)
    stats = _scan(body, varying_like(dm.pair_stats_init((n_rows,)), *operands), n_rows, vocab)
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


def distill_backward(
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    lse_s,
    lse_t,
    d,
    kl_s,
    g,
    *,
    weight_layout,
    teacher_weight_layout,
    divergence,
    beta,
    temperature,
):
    """(d_hidden, d_weight, d_bias | None) of the student for per-row cotangents ``g``."""
    chunks = _both_chunks(
        (hidden, weight, bias, weight_layout),
        (t_hidden, t_weight, t_bias, teacher_weight_layout),
        temperature,
    )

    def tile_grad(start, cols, fresh, size):
        zs, zt = chunks(start, size)
        return dm.student_grad_tile(divergence, zs, zt, lse_s, lse_t, d, kl_s, g, beta, temperature)

    return student_backward(
        hidden,
        weight,
        bias,
        weight_layout,
        tile_grad,
        (hidden, weight, bias, t_hidden, t_weight, t_bias, lse_s, lse_t, d, kl_s, g),
    )


# -- top-k log-probs -------------------------------------------------------------------------


def topk_forward(
    hidden, weight, bias, *, k, weight_layout, temperature, vocab_offset, vocab_axes=()
):
    """``(values [N, k], ids [N, k] int32, lse [N])``: the k largest logits of each row (global
    ids, equal values in id order) and the row's logsumexp."""
    n_rows, vocab = hidden.shape[0], geometry.vocab_size(weight, weight_layout)
    k_local = min(k, vocab)
    z_chunk = linear_chunk(hidden, weight, bias, weight_layout, temperature)

    def body(carry, start, cols, fresh, size):
        stats, values, ids = carry
        z = jnp.where(fresh, z_chunk(start, size), -jnp.inf)
        stats = softmax_math.online_softmax_update(stats, z)
        cand_v = jnp.concatenate([values, z], axis=1)
        cand_i = jnp.concatenate(
            [ids, jnp.broadcast_to((cols + vocab_offset).astype(jnp.int32), z.shape)], axis=1
        )
        values, ids = dm.topk_merge(cand_v, cand_i, k_local)
        return stats, values, ids

    init = (
        softmax_math.online_softmax_init((n_rows,), False),
        jnp.full((n_rows, k_local), -jnp.inf, jnp.float32),
        jnp.full((n_rows, k_local), -1, jnp.int32),
    )
    stats, values, ids = _scan(body, varying_like(init, hidden, weight, bias), n_rows, vocab)
    if vocab_axes:
        m_all = jax.lax.pmax(stats[0], vocab_axes)
        stats = (m_all, jax.lax.psum(stats[1] * jnp.exp(stats[0] - m_all), vocab_axes))
    lse, _ = softmax_math.online_softmax_finalize(stats)
    values, ids = dm.topk_across_shards(values, ids, k, vocab_axes)
    return values, ids, lse


def topk_backward(
    hidden, weight, bias, local_ids, lse, g_values, g_lse, *, weight_layout, temperature
):
    """(d_hidden, d_weight, d_bias | None) for cotangents of the values ``z[ids]`` [N, k] and
    of ``lse`` [N]; ``local_ids`` are this device's column indices (any other value: an id
    another shard holds)."""
    z_chunk = linear_chunk(hidden, weight, bias, weight_layout, temperature)
    rows = jnp.broadcast_to(jnp.arange(hidden.shape[0])[:, None], local_ids.shape)

    def tile_grad(start, cols, fresh, size):
        p = jnp.exp(z_chunk(start, size) - lse[:, None])
        dz = g_lse[:, None] * p
        at = local_ids - start
        at = jnp.where((at >= 0) & (at < size), at, size)  # size: out of bounds, dropped
        dz = dz.at[rows, at].add(g_values, mode="drop")
        return dz / temperature

    return student_backward(
        hidden,
        weight,
        bias,
        weight_layout,
        tile_grad,
        (hidden, weight, bias, local_ids, lse, g_values, g_lse),
    )


OPS = {
    "distill_divergence": Parts(distill_forward, distill_backward),
    "topk_logprobs": Parts(topk_forward, topk_backward),
}
