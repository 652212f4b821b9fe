"""The reference backend's distillation and top-k ops: plain jnp on the float32 logits; the
oracle the chunked backend matches. Under a split vocabulary each device holds its slice of the
logits and per-row values cross devices by ``pmax`` / ``psum`` (the top-k: each slice's top-k,
merged by ``divergence_math.topk_across_shards``).

``distill_divergence`` is a ``logprob_core.Whole``: jax differentiates it. ``topk_logprobs`` is
a ``Parts`` (forward, and a backward that forms the logit gradient and lets jax pull it back
through the head): jax cannot leave ``lax.top_k`` to XLA's partitioner under Auto mesh axes,
which runs it on every row and the whole vocabulary on each device (all-gathering the logits,
even where only the rows are split); as ``Parts`` it runs where the rows and the vocabulary
slices live, like the chunked backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.backends.reference.logprobs import split_entry
from jaxrl_kernels.dispatch.contract import Parts, Whole
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.head.geometry import float32_logits as linear_logits


def distill_divergence(
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
    """Per-row ``d`` [N] of flat hidden states [N, D_s] and [N, D_t]; no gradient to the
    teacher. ``vocab_axes``: ``logprobs.split_entry`` (d_hidden summed in float32)."""
    if vocab_axes:
        hidden = split_entry(hidden, vocab_axes)
    zs = linear_logits(hidden, weight, bias, weight_layout) / temperature
    zt = jax.lax.stop_gradient(
        linear_logits(t_hidden, t_weight, t_bias, teacher_weight_layout) / temperature
    )
    return dm.divergence_of_logits(zs, zt, divergence, beta, vocab_axes)


def topk_logprobs(
    hidden, weight, bias, *, k, weight_layout, temperature, vocab_offset, vocab_axes=()
):
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


def topk_backward(
    hidden, weight, bias, local_ids, lse, g_values, g_lse, *, weight_layout, temperature
):
    """(d_hidden, d_weight, d_bias | None) for cotangents of the values ``z[ids]`` [N, k] and of
    ``lse`` [N]: ``dz = g_lse p + Σ_j g_j onehot(id_j)`` on this device's slice of the logits
    (``local_ids`` outside ``[0, V_local)``: held by another slice), pulled back through
    ``z = (hidden·Wᵀ + b) / temperature`` by jax."""
    z, pull = jax.vjp(
        lambda h, w, b: linear_logits(h, w, b, weight_layout) / temperature, hidden, weight, bias
    )
    local_vocab = z.shape[-1]
    rows = jnp.broadcast_to(jnp.arange(z.shape[0])[:, None], local_ids.shape)
    at = jnp.where((local_ids >= 0) & (local_ids < local_vocab), local_ids, local_vocab)
    dz = (g_lse[:, None] * jnp.exp(z - lse[:, None])).at[rows, at].add(g_values, mode="drop")
    return pull(dz)


OPS = {
    "distill_divergence": Whole(distill_divergence),
    "topk_logprobs": Parts(topk_logprobs, topk_backward),
}
