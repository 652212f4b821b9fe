"""The geometry of a linear LM head: which axis of the weight is the vocabulary.

A head maps hidden states ``h`` [N, D] to logits ``z = h · Wᵀ`` [N, V] with its weight stored
one of two ways, its ``weight_layout``:

=========  ==========  ===========================================================
layout     weight      typical source
=========  ==========  ===========================================================
``"vd"``   ``[V, D]``  an LM head or a tied embedding table
``"dv"``   ``[D, V]``  the kernel of a Flax ``nn.Dense`` / ``nnx.Linear``
=========  ==========  ===========================================================

Every module that touches a head asks here instead of branching on the layout itself: the
sizes, the vocabulary axis (for slicing a chunk of columns), the three products of a head's
forward and backward (``z = h·Wᵀ``, ``dh = dz·W``, ``dW = dzᵀ·h`` in the weight's layout),
their precision, and the sharding roles of the weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LAYOUTS = ("vd", "dv")
SHAPES = {"vd": "[V, D]", "dv": "[D, V]"}


def vocab_axis(layout: str) -> int:
    """The weight's vocabulary axis: 0 for ``"vd"``, 1 for ``"dv"``."""
    return 0 if layout == "vd" else 1


def model_axis(layout: str) -> int:
    """The weight's hidden (D) axis: 1 for ``"vd"``, 0 for ``"dv"``."""
    return 1 - vocab_axis(layout)


def vocab_size(weight, layout: str) -> int:
    """V of a head weight (its local slice under a vocabulary split)."""
    return weight.shape[vocab_axis(layout)]


def hidden_dim(weight, layout: str) -> int:
    """D of a head weight."""
    return weight.shape[model_axis(layout)]


def roles(layout: str) -> str:
    """The weight's sharding roles (``sharding.run``): ``"v-"`` or ``"-v"``."""
    return "v-" if layout == "vd" else "-v"


def vocab_slice(weight, start, size: int, layout: str):
    """The weight's columns ``[start, start + size)`` of the vocabulary (a dynamic slice)."""
    return jax.lax.dynamic_slice_in_dim(weight, start, size, axis=vocab_axis(layout))


def vocab_update(weight, update, start, layout: str):
    """``weight`` with ``update`` written at vocabulary offset ``start``."""
    return jax.lax.dynamic_update_slice_in_dim(weight, update, start, axis=vocab_axis(layout))


def per_column(x, layout: str):
    """A per-vocabulary-column vector [C] broadcast against a weight slice."""
    return x[:, None] if layout == "vd" else x[None, :]


def target_rows(weight, targets, layout: str):
    """``W[targets]`` as [N, D] (the rows of the target tokens)."""
    return weight[targets] if layout == "vd" else weight[:, targets].T


def logits(hidden, weight, layout: str, **dot_options):
    """``hidden [N, D] · Wᵀ -> [N, V]`` (``dot_options``: ``precision``,
    ``preferred_element_type``)."""
    return jax.lax.dot_general(
        hidden, weight, (((1,), (model_axis(layout),)), ((), ())), **dot_options
    )


def matmul_precision(dtype) -> jax.lax.Precision:
    """float32 operands get full float32 products; narrower ones are exact in float32 anyway."""
    return (
        jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT
    )


def gemm_dtype(dtype):
    """The output dtype for a GEMM whose float32 accumulator is to be rounded once to
    ``dtype``: ``dtype`` itself for bfloat16 on a GPU (XLA's GEMM rounds the accumulator to
    its output), else float32, rounded after: XLA's GPU GEMM may accumulate a float16 output
    at lower precision (entropies off by 0.06 with jax 0.12), and its CPU dot accumulates in
    its output's dtype."""
    return dtype if (jax.default_backend() == "gpu" and dtype == jnp.bfloat16) else jnp.float32


def float32_logits(hidden, weight, bias, layout: str):
    """``hidden @ Wᵀ (+ bias)`` in float32, the operands promoted to their common dtype."""
    dtype = jnp.result_type(hidden, weight)
    z = logits(
        hidden.astype(dtype),
        weight.astype(dtype),
        layout,
        precision=matmul_precision(dtype),
        preferred_element_type=jnp.float32,
    )
    return z if bias is None else z + bias.astype(jnp.float32)


def hidden_grad(dz, weight, layout: str, **dot_options):
    """``dz [N, V] · W -> [N, D]``."""
    return jax.lax.dot_general(dz, weight, (((1,), (vocab_axis(layout),)), ((), ())), **dot_options)


def weight_grad(dz, hidden, layout: str, **dot_options):
    """``dzᵀ · hidden`` in the weight's layout: [V, D] for ``"vd"``, [D, V] for ``"dv"``."""
    pair = (dz, hidden) if layout == "vd" else (hidden, dz)
    return jax.lax.dot_general(*pair, (((0,), (0,)), ((), ())), **dot_options)
