"""A linear head's logits rounded once to the head's dtype, as the fast mode keeps them.

The forward's GEMM writes ``z = h·Wᵀ`` in the head's 16-bit dtype (float32 for float32
inputs); every statistic the forward takes and every softmax the backward forms reads these
rounded values (:func:`scaled`), so the two agree. :func:`local_stats` is the ``kept_logits``
primitive on XLA's GEMM and reductions (the reference backend's; ffi has a kernel of its own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.head import geometry


def kept_dtype(hidden_dtype, weight_dtype):
    """The dtype the forward keeps the logits in: a 16-bit head's own, float32 otherwise."""
    dtype = jnp.dtype(jnp.result_type(hidden_dtype, weight_dtype))
    return dtype if dtype.itemsize == 2 else jnp.dtype(jnp.float32)


def kept_bytes(n_rows: int, vocab: int, hidden_dtype, weight_dtype) -> int:
    """Bytes of the logits the forward keeps for the backward."""
    return n_rows * vocab * kept_dtype(hidden_dtype, weight_dtype).itemsize


def product(hidden, weight, weight_layout):
    """``hidden @ Wᵀ`` [N, V]: accumulated in float32, rounded once to :func:`kept_dtype`."""
    dtype = jnp.result_type(hidden, weight)
    z = geometry.logits(
        hidden.astype(dtype),
        weight.astype(dtype),
        weight_layout,
        precision=geometry.matmul_precision(dtype),
        preferred_element_type=geometry.gemm_dtype(dtype),
    )
    return z.astype(kept_dtype(hidden.dtype, weight.dtype))


def scaled(z, bias, temperature):
    """z̃ = (z + b) / T in float32, from the values the kept logits ``z`` hold.

    ``reduce_precision`` pins them: XLA's GPU compiler drops a float32 → 16-bit → float32
    round trip where it can (``xla_allow_excess_precision``, as when an N = 1 product becomes
    a fused reduction), which would take the forward's statistics from unrounded logits and
    the backward's softmax from the kept, rounded ones."""
    finfo = jnp.finfo(z.dtype)
    z = jax.lax.reduce_precision(
        z.astype(jnp.float32), exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant
    )
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return z if temperature == 1.0 else z / temperature


def target_logits(hidden, weight, bias, t_local, weight_layout, temperature):
    """z̃ at each row's target column, in float32 from the operands (exact, not rounded);
    anything for a target outside this device's columns."""
    t = jnp.clip(t_local, 0, geometry.vocab_size(weight, weight_layout) - 1)
    rows = geometry.target_rows(weight, t, weight_layout)
    z_t = jnp.sum(hidden.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1)
    if bias is not None:
        z_t = z_t + bias[t].astype(jnp.float32)
    return z_t if temperature == 1.0 else z_t / temperature


def row_stats(zs, with_entropy):
    """``(m, Σ exp(z̃ − m)[, Σ exp(z̃ − m)(z̃ − m)])`` per row of ``zs`` [N, V] (two passes)."""
    m = jnp.max(zs, axis=-1)
    shifted = zs - m[:, None]
    e = jnp.exp(shifted)
    return (m, jnp.sum(e, axis=-1)) + ((jnp.sum(e * shifted, axis=-1),) if with_entropy else ())


def local_stats(
    plan, hidden, weight, bias, t_local, row_valid, *, weight_layout, temperature, with_entropy
):
    """One device's rows [N, D] and columns: its row statistics, the target's ``z̃ − m`` and
    the kept logits ``z`` [N, V_local] (the forward half of the engine's linear-head op): the
    ``kept_logits`` primitive on XLA's GEMM and reductions (the reference backend's).

    The statistics are those of the rounded logits the backward reads (``scaled``), so that
    the backward's softmax sums to 1 with the forward's ``lse``: a row whose mass sits on one
    token gets ``p = 1`` there, not ``exp`` of that token's rounding error."""
    del plan, row_valid
    z = product(hidden, weight, weight_layout)
    stats = row_stats(scaled(z, bias, temperature), with_entropy)
    target_rel = target_logits(hidden, weight, bias, t_local, weight_layout, temperature) - stats[0]
    return stats, target_rel, z
