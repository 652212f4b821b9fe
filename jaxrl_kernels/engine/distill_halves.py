"""The distillation ops' halves as engine ops: a per-row divergence between two linear heads
and a head's top-k, over a backend's ``Parts`` (or a ``Whole`` jax differentiates itself).

``linear_distill_loss``'s lean path is :func:`divergence_rows` (its fast path is
``fused_distill``); ``linear_topk_logprobs`` is :func:`topk_rows`. Rows stay where they live,
a vocabulary split over devices is used in place.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels import sharding
from jaxrl_kernels.dispatch.contract import Whole
from jaxrl_kernels.engine import vjp
from jaxrl_kernels.head import geometry


def divergence_rows(parts, operands, row_valid, *, opts, vocab_axis):
    """Per-row d [B, T] (raw on every row) of the validated heads, gradient to the student."""
    rows = "rr"
    roles = (
        rows + "-",
        geometry.roles(opts["weight_layout"]),
        "v",
        rows + "-",
        geometry.roles(opts["teacher_weight_layout"]),
        "v",
    )
    if isinstance(parts, Whole):

        def local(plan, h, w, b, th, tw, tb):
            d = parts.fn(
                vjp.flat_rows(h, 2),
                w,
                b,
                vjp.flat_rows(th, 2),
                tw,
                tb,
                vocab_axes=plan.vocab_axes,
                **opts,
            )
            return (d.reshape(h.shape[:2]),)

        (d,) = sharding.run(
            local,
            operands,
            roles,
            (rows,),
            vocab_axis=vocab_axis,
            differentiable=True,
            record=vjp.note_layout,
        )
        return d

    def forward(plan, h, w, b, th, tw, tb, valid):
        d, lse_s, lse_t, kl_s = parts.stats(h, w, b, th, tw, tb, vocab_axes=plan.vocab_axes, **opts)
        return d, lse_s, lse_t, d, kl_s

    def backward(plan, h, w, b, th, tw, tb, valid, lse_s, lse_t, d, kl_s, g):
        g = jnp.where(valid, g.astype(jnp.float32), 0.0)
        return parts.backward(h, w, b, th, tw, tb, lse_s, lse_t, d, kl_s, g, **opts)

    (d,) = vjp.differentiable(
        forward,
        backward,
        tuple(operands) + (row_valid,),
        roles + (rows,),
        (rows,),
        (rows,) * 4,
        diff=(0, 1, 2),
        vocab_axis=vocab_axis,
    )
    return d


def topk_rows(
    parts, hidden, weight, bias, *, k, n_row_dims, weight_layout, temperature, vocab_axis
):
    """``(values [..., k], ids [..., k], lse [...])`` as an :mod:`engine` op: the values are
    the logits ``z[ids]``; their cotangent and that of ``lse`` pull back to
    ``dz = g_lse·p + Σ_j g_j onehot(id_j)`` (``parts``: a ``Parts`` on every backend, so that
    the top-k runs where the rows and vocabulary slices live, never left to XLA's
    partitioner)."""
    rows = "r" * n_row_dims
    opts = dict(weight_layout=weight_layout, temperature=temperature)
    local_vocab = lambda w: geometry.vocab_size(w, weight_layout)

    def forward(plan, h, w, b):
        values, ids, lse = parts.stats(
            h,
            w,
            b,
            k=k,
            **opts,
            vocab_offset=plan.vocab_offset(local_vocab(w)),
            vocab_axes=plan.vocab_axes,
        )
        return values, ids, lse, ids, lse

    def backward(plan, h, w, b, ids, lse, g_v, _g_ids, g_lse):
        local_ids = ids - plan.vocab_offset(local_vocab(w))
        return parts.backward(
            h, w, b, local_ids, lse, g_v.astype(jnp.float32), g_lse.astype(jnp.float32), **opts
        )

    return vjp.differentiable(
        forward,
        backward,
        (hidden, weight, bias),
        (rows + "-", geometry.roles(weight_layout), "v"),
        (rows + "-", rows + "-", rows),
        (rows + "-", rows),
        diff=(0, 1, 2),
        vocab_axis=vocab_axis,
    )
