"""The reference backend's distillation and top-k ops: plain jnp on the float32 logits of both
heads, differentiated by jax (``logprob_core.Whole``); the oracle the chunked backend matches.
Under a split vocabulary each device holds its slice of the logits and per-row values cross
devices by ``pmax`` / ``psum`` (the top-k by an ``all_gather`` of each slice's top-k)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import divergence_math as dm
from jaxrl_kernels.logprob_core import Whole
from jaxrl_kernels.head import float32_logits as linear_logits


def distill_divergence(hidden, weight, bias, t_hidden, t_weight, t_bias, *, weight_layout,
                       teacher_weight_layout, divergence, beta, temperature, vocab_axes=()):
    """Per-row ``d`` [N] of flat hidden states [N, D_s] and [N, D_t]; no gradient to the
    teacher."""
    zs = linear_logits(hidden, weight, bias, weight_layout) / temperature
    zt = jax.lax.stop_gradient(
        linear_logits(t_hidden, t_weight, t_bias, teacher_weight_layout) / temperature)
    return dm.divergence_of_logits(zs, zt, divergence, beta, vocab_axes)


def topk_logprobs(hidden, weight, bias, *, k, weight_layout, temperature, vocab_offset,
                  vocab_axes=()):
    """``(values [N, k], ids [N, k] int32, lse [N])`` as in the chunked backend."""
    z = linear_logits(hidden, weight, bias, weight_layout) / temperature
    local_vocab = z.shape[-1]
    values, where = jax.lax.top_k(z, min(k, local_vocab))
    ids = (where + vocab_offset).astype(jnp.int32)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
    s = jnp.sum(jnp.exp(z - m[:, None]), axis=-1)
    if vocab_axes:
        m_all = jax.lax.pmax(m, vocab_axes)
        s = jax.lax.psum(s * jnp.exp(m - m_all), vocab_axes)
        m = m_all
    values, ids = dm.topk_across_shards(values, ids, k, vocab_axes)
    return values, ids, m + jnp.log(s)


OPS = {
    "distill_divergence": Whole(distill_divergence),
    "topk_logprobs": Whole(topk_logprobs),
}
