"""A linear head's two backward GEMMs from a gradient of the logits kept in the head's dtype
(``memory="fast"``: ``engine.fused_loss``, ``engine.fused_distill``)::

    d_hidden = scale · dz·W       (float32)
    d_weight = dzᵀ·(scale · h)    (W's dtype)

with ``scale`` a float32 cotangent per row or for the whole loss. :func:`leading_rows_grads` is
the ``kept_gemms`` primitive on XLA's GEMMs (the reference backend's): a branch of row skipping
hands it the whole kept buffer.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels.head import geometry
from jaxrl_kernels.head.head_grad import pow2_range, rounded_weight_grad


def rows_scaled_weight_grad(dz, scaled_hidden, weight, weight_layout):
    """``dzᵀ·scaled_hidden`` in W's dtype, for a float32 ``scaled_hidden`` [N, D] (the hidden
    states times per-row cotangents) rounded once to ``dz``'s dtype: a float16 one is first
    brought into float16's range by a power of two (small cotangents would put it among the
    subnormals), undone exactly in the float32 result (``head_grad.rounded_weight_grad``)."""
    rounded, top = _rounded_hidden(scaled_hidden, dz.dtype)
    scale = None if top is None else 1.0 / top
    return rounded_weight_grad(dz, rounded, weight, weight_layout, scale)


def _rounded_hidden(scaled_hidden, dtype):
    """``(σ·scaled_hidden in dtype, σ)``: for float16, σ the power of two that brings it into
    range (``pow2_range``), None (no factor) for any other dtype."""
    if dtype != jnp.float16:
        return scaled_hidden.astype(dtype), None
    top = pow2_range(jnp.max(jnp.abs(scaled_hidden)))
    return (scaled_hidden * top).astype(dtype), top


def row_scaled_grads(dz, hidden, weight, weight_layout, scale):
    """``(scale ⊙ dz·W, dzᵀ·(scale ⊙ hidden))`` for a gradient of the logits ``dz`` [N, V]
    kept in the head's dtype and a float32 ``scale`` (per row [N, 1], or a scalar): the two
    GEMMs in the head's dtype, ``scale`` applied to their ``[N, D]`` sides only —
    ``d_hidden`` to the GEMM's float32 result (rounded by the caller after any sum over
    devices), ``hidden`` before ``d_weight``'s GEMM (:func:`rows_scaled_weight_grad`)."""
    dtype = jnp.result_type(hidden, weight)
    dz = dz.astype(dtype)
    d_hidden = (
        geometry.hidden_grad(
            dz,
            weight.astype(dtype),
            weight_layout,
            precision=geometry.matmul_precision(dtype),
            preferred_element_type=jnp.float32,
        )
        * scale
    )
    d_weight = rows_scaled_weight_grad(
        dz, hidden.astype(jnp.float32) * scale, weight, weight_layout
    )
    return d_hidden, d_weight


def leading_rows_grads(hidden, weight, dz, scale, *, weight_layout):
    """The ``kept_gemms`` primitive on XLA's GEMMs: :func:`row_scaled_grads` of ``dz``'s first
    S rows for ``hidden`` [S, D] (``dz`` [R ≥ S, V]; XLA copies those rows out for its GEMMs
    where R > S), ``d_hidden`` in float32."""
    return row_scaled_grads(dz[: hidden.shape[0]], hidden, weight, weight_layout, scale)


def leading_rows_scaled(gemms, hidden, weight, dz, scale, weight_layout):
    """:func:`row_scaled_grads` of ``dz``'s first S rows (``hidden`` [S, D], ``dz`` [R ≥ S, V])
    on ``gemms``, a ``kept_gemms`` primitive (whose own scale is one float32 scalar): ``scale``
    [S, 1] goes into the hidden states it reads (a float16 copy first brought into range by a
    power of two, undone in its scalar) and onto the ``d_hidden`` it returns."""
    rounded, top = _rounded_hidden(hidden.astype(jnp.float32) * scale, hidden.dtype)
    top = 1.0 if top is None else top
    d_hidden, d_weight = gemms(rounded, weight, dz, 1.0 / top, weight_layout=weight_layout)
    return d_hidden * (scale * top), d_weight
