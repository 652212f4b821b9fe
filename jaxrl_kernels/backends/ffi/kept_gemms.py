"""``memory="fast"``'s backward GEMMs on Hopper: one custom call that reads the kept gradient's
first rows in place.

The fast losses keep the logits' gradient ``dz`` [R, V] in the head's dtype from the forward
to the backward (``engine.fused_loss``). Under row skipping (``engine.row_skip``) a branch runs
the backward on its first S ≤ R rows. XLA's own GEMMs would take ``dz[:S]`` as a copy, and XLA
assigns every branch's copy a buffer when it compiles, up to ``7/8 · R · V`` elements more at
the peak whatever the padding (docs/performance.md, "Row skipping's memory"). The custom call
``jaxrl_kernels_sm90_kept_grad_gemms`` (``csrc/ffi_kept_gemms.cc``) is handed the whole buffer
and runs two CUTLASS GEMMs on its first S rows::

    d_hidden = c · dz[:S]·W           float32 [S, D]
    d_weight = c · dz[:S]ᵀ·hidden     W's shape and dtype, rounded once from float32

``c`` the loss's cotangent (a float32 scalar), applied to the float32 accumulators. Serves
bfloat16 or float16 hidden, weight and ``dz`` of one dtype, with D and V multiples of 8 (TMA's
16-byte row strides). Automatic choice takes it wherever it serves: on an H100 it held the
fast loss's temp at about one ``[N, V]`` (XLA's GEMMs: up to 1.9×) at XLA's speed within
−6 % … +4 % (docs/performance.md, "Row skipping's memory").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.backends.ffi import extension, linear
from jaxrl_kernels.head import geometry

TARGET = "jaxrl_kernels_sm90_kept_grad_gemms"  # csrc/ffi_kept_gemms.cc
SERVED_DTYPES = linear.SERVED_DTYPES
ALIGN = linear.ALIGN


def declines(primitive: str, problem) -> str | None:
    """Why the custom call does not serve these inputs (None if it does): the head kernels'
    own conditions (``linear.declines``: one 16-bit dtype, D a multiple of 8), and V a multiple
    of 8 in either weight layout, since the call reads ``dz`` [R, V] through TMA too."""
    why = linear.declines(primitive, problem)
    if why is None and problem.vocab % ALIGN:
        return (
            f"V = {problem.vocab} is not a multiple of {ALIGN}: dz [R, V] needs 16-byte row "
            "strides for TMA"
        )
    return why


def kept_grad_gemms(hidden, weight, dz, scale, *, weight_layout):
    """The ``kept_gemms`` primitive: ``(c·dz[:S]·W, c·dz[:S]ᵀ·hidden)`` for ``hidden`` [S, D]
    and ``dz`` [R ≥ S, V_local] (the module docstring), ``d_hidden`` in float32."""
    dtype = hidden.dtype
    vocab = geometry.vocab_size(weight, weight_layout)
    if weight.dtype != dtype or dz.dtype != dtype or dtype.name not in SERVED_DTYPES:
        raise NotImplementedError(
            f"ffi kept_gemms: hidden {dtype}, weight {weight.dtype} and dz {dz.dtype} must be "
            "one of bfloat16, float16"
        )
    if vocab % ALIGN:
        raise NotImplementedError(
            f"ffi kept_gemms: this device's vocabulary share V = {vocab} is not a multiple of "
            f"{ALIGN} (TMA needs 16-byte row strides)"
        )
    n_rows, dim = hidden.shape
    workspace = extension.sm90.kept_gemms_workspace_bytes(
        n_rows, vocab, dim, weight_layout == "dv", dtype == jnp.bfloat16
    )
    d_hidden, d_weight, _ = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((n_rows, dim), jnp.float32),
            jax.ShapeDtypeStruct(weight.shape, weight.dtype),
            jax.ShapeDtypeStruct((workspace,), jnp.uint8),
        ),
        vmap_method="sequential",
    )(
        dz,
        hidden,
        weight,
        jnp.reshape(jnp.asarray(scale, jnp.float32), (1,)),
        weight_dv=weight_layout == "dv",
    )
    return d_hidden, d_weight


OPS = {"kept_gemms": kept_grad_gemms}
