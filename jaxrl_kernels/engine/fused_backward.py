"""The fast losses' backward on one device (``engine.fused_loss``): the two GEMMs on the kept
gradient, or the logits recomputed where the backward needs more than the loss's gradient."""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels.backends.chunked import logprobs as chunked_logprobs
from jaxrl_kernels.engine import saved_logits
from jaxrl_kernels.head import geometry, kept_grads, relative_probs


def head_grads(hidden, weight, bias, dz, *rows, weight_layout, gemms):
    """``(s ⊙ dz·W, dzᵀ·(s ⊙ h), None)`` on one device (``d_bias`` comes from the forward's
    float32 column sums), ``s`` the per-row scale that arrives as ``g`` (``rows[3]``): the
    loss's cotangent times the scale the kept buffer was written with (the relative form's
    ``−g·p_t/T``, float16's ``1/σ``), 0 on inactive rows. ``d_hidden`` is accumulated in
    float32 and scaled there (the caller rounds it after any sum over devices).

    Where every row runs, XLA's GEMMs (``kept_grads.row_scaled_grads``: ``s`` scales ``h``
    before ``d_weight``'s GEMM, so that the ``[V, D]`` GEMM writes the head's dtype directly).
    A row-skipping branch gets ``dz`` with more rows than its own (``row_skip``'s ``whole``):
    there ``gemms``, the ``kept_gemms`` primitive dispatch chose, reads the branch's first
    rows (``kept_grads.leading_rows_scaled``)."""
    scale = rows[3][:, None]
    if dz.shape[0] == hidden.shape[0]:
        return kept_grads.row_scaled_grads(dz, hidden, weight, weight_layout, scale) + (None,)
    return kept_grads.leading_rows_scaled(gemms, hidden, weight, dz, scale, weight_layout) + (None,)


def recomputed_backward(hidden, weight, bias, *rows, vocab, weight_layout, temperature):
    """``saved_logits.recomputed_backward`` on the logits of the distribution the forward took
    its statistics from: the float32 ones where the step took the relative form (``vocab``:
    the global vocabulary; a device that holds less of it did not), a tile at a time, the
    rounded ones where it kept the logits."""
    entropy = rows[2]
    split = () if geometry.vocab_size(weight, weight_layout) == vocab else ("vocab",)
    dtype = jnp.result_type(hidden, weight)
    if not relative_probs.serves(dtype, bias, entropy is not None, split, hidden.shape[0]):
        return saved_logits.recomputed_backward(
            hidden, weight, bias, *rows, weight_layout=weight_layout, temperature=temperature
        )
    # the logits in float32 a tile at a time (the chunked backend's backward): a whole [N, V]
    # float32 copy would sit in every step's program, in the branch of lax.cond not taken
    return chunked_logprobs.linear_backward(
        hidden, weight, bias, *rows, weight_layout=weight_layout, temperature=temperature
    )
