"""A linear head's logits rounded once to the head's dtype, as the fast mode keeps them.

The forward's GEMM writes ``z = h·Wᵀ`` in the head's 16-bit dtype (float32 for float32
inputs). The fast mode's distribution is that of these rounded values (:func:`scaled`) with
one exception: each row's target entry is exact (``z̃_t`` from ``h · W[t]`` in float32,
:func:`target_logits`). A peaked row puts nearly all its mass on its target, whose logit is
large (10-20), where bfloat16's rounding moves it by up to 2⁻⁵; with the target taken exact
and the rest rounded, ``logp = z̃_t − lse`` errs only by the rounding of the *other* entries,
weighted by their (small) probabilities. The forward's statistics and the backward's softmax
both read this distribution (:func:`exact_target_stats`, :func:`with_exact_target`), so ``p``
sums to 1 with the forward's ``lse`` and ``p_t = exp(logp)``. :func:`local_stats` is the
``kept_logits`` primitive on XLA's GEMM and reductions (the reference backend's; ffi has a
kernel of its own); both give the rounded logits' statistics, the fast mode's engine corrects
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.head import geometry, relative_probs


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


def exact_target_stats(stats, target_rel, z, t_local, bias, temperature):
    """Row statistics ``(m, s[, a])`` of the rounded logits ``z`` [N, V_local] made those of
    the fast mode's distribution: each row's target term ``exp(z̃_t − m)`` (and
    ``exp(z̃_t − m)·(z̃_t − m)``) swapped from its rounded value to its exact one,
    ``target_rel = z̃_t − m``. Rows whose target lies outside these columns are unchanged.

    The swap is a difference of two terms of nearly equal size on a peaked row (both ≈ s);
    in float32 it leaves ``s`` within a few ulps of 1·s, where bfloat16's rounding of
    ``z̃_t`` moved it by up to 3 %."""
    m = stats[0]
    # a step's logits may be laid out at more rows (Placement.logits_rows): the first are these
    z = z[: t_local.shape[0]]
    vocab = z.shape[1]
    holds = (t_local >= 0) & (t_local < vocab)
    t = jnp.clip(t_local, 0, vocab - 1)
    b_t = None if bias is None else bias[t]
    rounded_rel = scaled(jnp.take_along_axis(z, t[:, None], axis=1)[:, 0], b_t, temperature) - m
    exact_rel = jnp.where(holds, target_rel, rounded_rel)
    e_exact, e_rounded = jnp.exp(exact_rel), jnp.exp(rounded_rel)
    out = (m, stats[1] + jnp.where(holds, e_exact - e_rounded, 0.0))
    if len(stats) == 3:
        swap = e_exact * exact_rel - e_rounded * rounded_rel
        out += (stats[2] + jnp.where(holds, swap, 0.0),)
    return out


def with_exact_target(zs, t_local, exact, start=0):
    """``zs`` [N, C] (z̃ of the columns ``[start, start + C)``) with each row's target entry
    ``exact`` [N] (``t_local``: the row's column on this device; rows whose target lies
    elsewhere are unchanged)."""
    cols = start + jnp.arange(zs.shape[1])
    return jnp.where(cols[None, :] == t_local[:, None], exact[:, None], zs)


def row_stats(zs, with_entropy):
    """``(m, Σ exp(z̃ − m)[, Σ exp(z̃ − m)(z̃ − m)])`` per row of ``zs`` [N, V] (two passes)."""
    m = jnp.max(zs, axis=-1)
    shifted = zs - m[:, None]
    e = jnp.exp(shifted)
    return (m, jnp.sum(e, axis=-1)) + ((jnp.sum(e * shifted, axis=-1),) if with_entropy else ())


def local_stats(
    plan,
    hidden,
    weight,
    bias,
    t_local,
    row_valid,
    *,
    weight_layout,
    temperature,
    with_entropy,
    exp_offsets=None,
):
    """One device's rows [N, D] and columns: its row statistics, the target's ``z̃ − m`` and
    the kept logits ``z`` [N, V_local] (the forward half of the engine's linear-head op): the
    ``kept_logits`` primitive on XLA's GEMM and reductions (the reference backend's).

    The statistics are those of the rounded logits (``scaled``), the target's ``z̃ − m``
    exact: the fast mode's engine swaps the target's term (:func:`exact_target_stats`).

    With ``exp_offsets`` [N] (raw logits ``y_off``, no bias): the relative form
    (``relative_probs.local_stats``)."""
    if exp_offsets is not None:
        return relative_probs.local_stats(
            hidden,
            weight,
            t_local,
            row_valid,
            exp_offsets,
            weight_layout=weight_layout,
            temperature=temperature,
            with_entropy=with_entropy,
        )
    del plan, row_valid
    z = product(hidden, weight, weight_layout)
    stats = row_stats(scaled(z, bias, temperature), with_entropy)
    target_rel = target_logits(hidden, weight, bias, t_local, weight_layout, temperature) - stats[0]
    return stats, target_rel, z
