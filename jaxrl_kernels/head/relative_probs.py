"""The fast loss's relative form: the logits kept as probabilities relative to the target's.

``memory="fast"``'s losses keep one ``[N, V]`` buffer from the forward to the backward. For a
loss of the log-probs alone (no entropy term), on a head without bias, in bfloat16 or
float32, with the vocabulary on one device, the logits' gradient factors per row::

    dz_v = g · (onehot_t − p_v) / T = s · E'_v,        s = −g · p_t / T
    E'_v = p_v / p_t = exp(z̃_v − z̃_t)   (v ≠ t),      E'_t = 1 − 1/p_t

So the forward's GEMM writes ``E = exp((y − y_t) / T)`` (``y = h·Wᵀ``; ``y_t = h · W[t]`` in
float32, the *offsets*: ``rounded_logits.target_logits`` at ``T = 1``) rounded to the head's
dtype, the target's entry is set once the row's log-prob is known
(:func:`with_target_entries`: N entries), and the backward's two GEMMs read
``E'`` with ``s`` applied on their ``[N, D]`` sides (``kept_grads.row_scaled_grads``): no
pass over ``[N, V]`` forms the gradient.

Accuracy: each ``p_v = p_t · E_v`` carries one rounding of ``E`` (relative 2⁻⁹ in bfloat16),
where rounded logits err by ``|z|·2⁻⁹`` in the exponent; the row statistics come from the
unrounded float32 logits, and the target's term ``g·(1 − p_t)`` is one rounding of a value
formed in float32 (no cancellation between large terms on a peaked row).

Range: ``Σ_v E_v = 1/p_t``, so every entry and every sum the GEMMs form is at most
``exp(−logp)``. A row whose target has ``logp < LOGP_FLOOR`` gets ``s = 0`` here, and the
loss's backward recomputes the logits for a step that has such a row (``engine.fused_loss``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels.head import geometry

LOGP_FLOOR = -64.0
"""Below this target log-prob a row leaves the relative form (``E ≤ e⁶⁴``, far inside
bfloat16's range, and ``s`` far above its smallest normal)."""


MIN_ROWS = 512
"""Fewer rows on a device keep the logits instead: the pass the relative form saves is short
there, and ``d_weight`` takes one rounding more in it (of ``s·h``, see :func:`serves`)."""


def serves(dtype, bias, with_entropy: bool, vocab_axes, n_rows: int = MIN_ROWS) -> bool:
    """Whether a fused loss's step on ``n_rows`` rows takes the relative form: a bfloat16 or
    float32 head (float16's range ends at 65504 = e^11), no bias (its gradient is a column
    sum of the gradient, a pass), no entropy term (``p·log p`` does not factor per row), the
    vocabulary on one device (the offset is the target's logit, which one device holds), at
    least :data:`MIN_ROWS` rows.

    ``d_weight = E'ᵀ·(s ⊙ h)`` rounds ``s ⊙ h`` to the head's dtype where the kept gradient's
    form rounds nothing on that side: on a flat distribution (a random head), where the
    rounded logits cost nothing, its error is ~1.2× the plain bfloat16 code's; on a peaked one,
    a fraction of it."""
    return (
        n_rows >= MIN_ROWS
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
        and bias is None
        and not with_entropy
        and not vocab_axes
    )


def local_stats(
    hidden, weight, t_local, row_valid, exp_offsets, *, weight_layout, temperature, with_entropy
):
    """The ``kept_logits`` primitive's relative form on XLA's GEMM and reductions:
    ``(stats, z̃_t − m, E)`` with the row statistics ``(m, Σ e^(z̃−m)[, Σ e^(z̃−m)(z̃−m)])`` of
    the float32 logits and ``E`` [N, V_local] in the head's dtype, 0 on rows that are not
    valid or whose target lies outside these columns."""
    dtype = jnp.result_type(hidden, weight)
    y = geometry.float32_logits(hidden, weight, None, weight_layout)
    zs = y / temperature
    m = jnp.max(zs, axis=-1)
    shifted = zs - m[:, None]
    e = jnp.exp(shifted)
    stats = (m, jnp.sum(e, axis=-1))
    if with_entropy:
        stats += (jnp.sum(e * shifted, axis=-1),)
    z_off = exp_offsets / temperature
    live = row_valid & (t_local >= 0) & (t_local < y.shape[1])
    rel = jnp.where(live[:, None], jnp.exp(zs - z_off[:, None]), 0.0)
    return stats, z_off - m, rel.astype(dtype)


def with_target_entries(e, t_local, logp, active):
    """``E'``: ``e`` [R ≥ S, V_local] with the target entry of each active row among its
    first S (``t_local``, ``logp``, ``active`` [S]) set to ``1 − 1/p_t = −expm1(−logp)``,
    in place (N entries); the other rows as they are."""
    n = t_local.shape[0]
    cols = jnp.where(active, t_local, e.shape[1])  # out of bounds: dropped
    entry = jnp.where(active, -jnp.expm1(-logp), 0.0).astype(e.dtype)
    return e.at[jnp.arange(n), cols].set(entry, mode="drop")


def row_scale(g, logp, active, temperature):
    """``s = −g · p_t / T`` [S] in float32: 0 on inactive rows and below :data:`LOGP_FLOOR`."""
    live = active & (logp >= LOGP_FLOOR)
    return jnp.where(live, -g * jnp.exp(jnp.where(live, logp, 0.0)) / temperature, 0.0)


def has_low_rows(logp, active):
    """Whether any active row's target log-prob lies below :data:`LOGP_FLOOR` (a scalar)."""
    return jnp.any(active & (logp < LOGP_FLOOR))
