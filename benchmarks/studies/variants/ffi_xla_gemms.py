"""The SM90 backward's chunks as XLA GEMMs around the grad custom call (measurement only).

``ffi.linear.linear_backward`` runs every chunk inside one custom call with CUTLASS GEMMs.
This variant runs the same chunks as ``head_grad.backward``: a ``fori_loop`` whose body is the
grad custom call (``jaxrl_kernels_sm90_linear_logprobs_grad``, csrc/ffi_variants.cc: G = dz / s
in float16 and the chunk's float16 weight copy) and XLA's two GEMMs; d_weight starts as a
buffer nobody writes (``jaxrl_kernels_uninitialized``), since the loop writes every column. It
is the A/B partner of ``studies.linear_kernels --fused`` and, through :func:`write_grad`, runs the grad
kernel alone (``--kernels``, ``--clocks kernels``, tests/backends/test_ffi.py). The grad call exists only
in an extension built with ``JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON`` (docs/building.md;
``_sm90.measurement_handlers``); without it XLA finds no handler for the call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.head import head_grad


def write_grad(bias, targets, weight_layout, weight_copy=True):
    """``head_grad.WriteGrad`` on the grad custom call (operands prepared once, outside the
    chunk loop); ``weight_copy=False`` leaves the chunk's float16 weight copy to XLA."""
    bias32, targets32 = ffi_linear._f32_or_empty(bias), targets.astype(jnp.int32)

    def write(rows, start, size, hidden, weight, sigma_w):
        depth = hidden.shape[1]
        w16_shape = (
            (0, 0) if not weight_copy else (size, depth) if weight_layout == "vd" else (depth, size)
        )
        call = jax.ffi.ffi_call(
            ffi_linear.GRAD_TARGET,
            (
                jax.ShapeDtypeStruct((hidden.shape[0], size), jnp.float16),
                jax.ShapeDtypeStruct(w16_shape, jnp.float16),
            ),
            vmap_method="sequential",
        )
        g16, w16 = call(
            hidden,
            weight,
            bias32,
            targets32,
            rows.lse,
            rows.alpha,
            rows.beta,
            ffi_linear._f32_or_empty(rows.gamma),
            jnp.reshape(jnp.asarray(start, jnp.int32), (1,)),
            jnp.reshape(jnp.asarray(sigma_w, jnp.float32), (1,)),
            weight_dv=weight_layout == "dv",
            has_bias=bias is not None,
            has_entropy=rows.gamma is not None,
            temperature=np.float32(rows.temperature),
        )
        return g16, (w16 if weight_copy else None)

    return write


uninitialized_like = extension.uninitialized_like


def linear_backward(
    hidden,
    weight,
    bias,
    targets,
    lse,
    entropy,
    g_logp,
    g_ent,
    *,
    weight_layout,
    temperature,
    chunk_bytes=ffi_linear.GRAD_CHUNK_BYTES,
    weight_grad_init=uninitialized_like,
    weight_copy=True,
):
    """``ffi.linear.linear_backward``'s arguments and results, its chunks as
    ``head_grad.backward``'s loop of the grad custom call and XLA's GEMMs."""
    ffi_linear._check_served(hidden, weight, weight_layout)
    return head_grad.backward(
        hidden,
        weight,
        bias,
        targets,
        lse,
        entropy,
        g_logp,
        g_ent,
        weight_layout=weight_layout,
        temperature=temperature,
        write_grad=write_grad(bias, targets, weight_layout, weight_copy),
        chunk_bytes=chunk_bytes,
        align=ffi_linear.TILE_COLS,
        weight_grad_init=weight_grad_init,
    )
