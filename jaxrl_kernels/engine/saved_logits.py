"""``memory="fast"``: the linear head's logits kept from the forward pass (3 GEMMs, not 4).

The lean ops never hold the ``[N, V]`` logits, so their backward recomputes them: one GEMM
forward, three backward (logits again, ``d_hidden``, ``d_weight``). Here the forward's GEMM
writes ``z = h·Wᵀ`` once, in the head's 16-bit dtype (float32 for float32 inputs), and the
backward reads it back: one GEMM forward, two backward. The price is ``N·V·itemsize`` bytes
held from the forward to the backward (1 GiB at N = 4096, V = 131072, bfloat16).

With ``z̃ = (z + b) / T`` in float32 per row::

    lse = log Σ_v exp z̃_v              (from the kept, rounded z)
    logp = z̃_t − lse                    (z̃_t recomputed exactly: hidden · W[t], N·D work)
    entropy = lse − Σ_v softmax(z̃)_v · z̃_v
    dz = g · (onehot_t − p) − g_H · p · (log p + H),  p = exp(z̃ − lse)   (softmax_math)
    d_hidden = dz·W / T,  d_weight = dzᵀ·h / T,  d_bias = Σ_rows dz / T

with every z̃ but the target's read from the kept, rounded logits and the target's exact
(``rounded_logits``' docstring says why): the forward's ``lse`` and the backward's ``p`` are
those of one distribution, so ``p`` sums to 1 and ``p_t = exp(logp)``; only the other
entries see the rounding of ``z`` to 16 bits, a peaked row's target none.

The op is :func:`linear_head.linear_head_op` with the two per-device halves below, the
logits its one ``[N, V]`` residual: the forward is the ``kept_logits`` primitive dispatch
chose (XLA's GEMM and reductions, ``head.rounded_logits.local_stats``; on Hopper ffi's
kernel, which writes the logits as it folds them), the backward plain jnp (XLA's GEMMs and
fusions). A bfloat16 head's logits are kept as bfloat16 (a float16
copy, a one-pass lse, vocabulary blocks in the backward and a float16 gradient were slower on
an H100: ``benchmarks/studies/bench_fast_mode.py`` measures them,
``benchmarks/studies/variants/fast_mode.py`` holds them).

Where the relative form serves (log-probs alone: no entropy, no sampler truncation, one target
per row; a bfloat16 or float32 head without bias, the whole vocabulary on each device, at
least ``relative_probs.MIN_ROWS`` rows: ``head.relative_probs``), the kept buffer holds
``E = exp(z̃ − z̃_t)`` with the statistics of the float32 logits, and the backward writes the
N target entries into it and runs its two GEMMs on it with the row scale ``s = −g·p_t/T``
(:func:`relative_backward`): no pass over ``[N, V]`` forms ``dz``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.backends.chunked import logprobs as chunked_logprobs
from jaxrl_kernels.engine import linear_head
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import (
    geometry,
    head_grad,
    head_ids,
    kept_grads,
    kept_set,
    relative_probs,
    rounded_logits,
)
from jaxrl_kernels.sharding import vocab_pieces


def local_backward(
    hidden,
    weight,
    bias,
    z,
    t_local,
    lse,
    entropy,
    g,
    g_ent,
    *,
    weight_layout,
    temperature,
    floor=None,
):
    """(d_hidden, d_weight, d_bias | None) on one device from the kept logits; rows without a
    gradient arrive with g = g_ent = 0 and lse = +inf (``logprob_core.backward_rows``).

    A float16 head takes the scaled gradient (``head_grad.Scaled``): unscaled, a row's small
    entries of ``dz`` fall among float16's subnormals (below 6.1e-5), where it keeps few
    bits. ``t_local`` and ``g`` [N, K]: K ids per row (``head_ids.split_targets``);
    ``floor``: a kept set's (``softmax_math.logprob_grad_tile``)."""
    t_local, g, ids, g_ids = head_ids.split_targets(t_local, g)
    is_target = jnp.arange(z.shape[1])[None, :] == t_local[:, None]
    dtype = jnp.dtype(jnp.result_type(hidden, weight))
    zs = rounded_logits.scaled(z, bias, temperature)
    if ids is None:  # one target per row: its exact logit, as the forward's statistics
        exact = rounded_logits.target_logits(
            hidden, weight, bias, t_local, weight_layout, temperature
        )
        zs = rounded_logits.with_exact_target(zs, t_local, exact)
    if dtype == jnp.float16:
        sc = head_grad.Scaled.of(hidden, weight, lse, entropy, g, g_ent, temperature, g_ids)
        dz = softmax_math.logprob_grad_tile(
            zs,
            lse,
            entropy,
            is_target,
            sc.rows.g,
            sc.rows.g_ent,
            temperature,
            floor,
        )
        if ids is not None:
            dz = head_ids.add_id_grads(dz, ids, g_ids / (sc.s * temperature)[:, None], 0)
        g16 = dz.astype(jnp.float16)
        w16 = (weight.astype(jnp.float32) * sc.sigma_w).astype(jnp.float16)
        acc = geometry.hidden_grad(g16, w16, weight_layout, preferred_element_type=jnp.float32)
        d_weight = head_grad.rounded_weight_grad(g16, sc.h16, weight, weight_layout, sc.d_w_scale)
        d_bias = None if bias is None else jnp.sum(dz * sc.s[:, None], axis=0)
        return (
            sc.finish(acc),
            d_weight.astype(weight.dtype),
            None if bias is None else d_bias.astype(bias.dtype),
        )
    dz = softmax_math.logprob_grad_tile(
        zs,
        lse,
        entropy,
        is_target,
        g,
        g_ent,
        temperature,
        floor,
    )
    if ids is not None:
        dz = head_ids.add_id_grads(dz, ids, g_ids / temperature, 0)
    dz_op = dz.astype(dtype)
    d_hidden = geometry.hidden_grad(
        dz_op,
        weight.astype(dtype),
        weight_layout,
        precision=geometry.matmul_precision(dtype),
        preferred_element_type=jnp.float32,
    )
    d_weight = head_grad.rounded_weight_grad(dz_op, hidden.astype(dtype), weight, weight_layout)
    return d_hidden, d_weight, None if bias is None else jnp.sum(dz, axis=0).astype(bias.dtype)


def recomputed_backward(hidden, weight, bias, *rest, weight_layout, temperature):
    """:func:`local_backward` with the logits recomputed (one GEMM more) instead of kept."""
    return local_backward(
        hidden,
        weight,
        bias,
        rounded_logits.product(hidden, weight, weight_layout),
        *rest,
        weight_layout=weight_layout,
        temperature=temperature,
    )


def relative_backward(
    hidden, weight, bias, e, t_local, lse, entropy, g, g_ent, *, weight_layout, temperature
):
    """:func:`local_backward` where the forward kept ``E`` (``head.relative_probs``): each
    active row's log-prob ``z̃_t − lse`` (its target logit recomputed exactly, N·D work), the
    N target entries written into ``e``, the two GEMMs on ``E'`` scaled by ``s = −g·p_t/T``
    per row. A step with a row below ``relative_probs.LOGP_FLOOR`` takes the float32 logits
    tile by tile instead (the chunked backend's backward, exact; ``lax.cond``: one branch
    runs). Inactive rows arrive with ``lse = +inf`` and ``g = 0``."""
    active = lse < jnp.inf
    exact = rounded_logits.target_logits(hidden, weight, None, t_local, weight_layout, temperature)
    logp = jnp.where(active, exact - lse, 0.0)

    def kept_form(e):
        e = relative_probs.with_target_entries(e, t_local, logp, active)
        scale = relative_probs.row_scale(g, logp, active, temperature)[:, None]
        return kept_grads.row_scaled_grads(e, hidden, weight, weight_layout, scale) + (None,)

    def recomputed(e):
        del e
        return chunked_logprobs.linear_backward(
            *(hidden, weight, bias, t_local, lse, entropy, g, g_ent),
            weight_layout=weight_layout,
            temperature=temperature,
        )

    return jax.lax.cond(relative_probs.has_low_rows(logp, active), recomputed, kept_form, e)


def relative_stats(kept, plan, hidden, weight, bias, t_local, row_valid, **options):
    """``kept``'s ``(row statistics, target's z̃ − m, E)`` in the relative form
    (``head.relative_probs``): the offsets ``y_t`` computed first, the statistics those of the
    float32 logits. ``options``: ``kept``'s keywords (``weight_layout``, ``temperature``,
    ``with_entropy``)."""
    offsets = rounded_logits.target_logits(
        hidden, weight, None, t_local, options["weight_layout"], 1.0
    )
    stats, _, e = kept(
        plan, hidden, weight, bias, t_local, row_valid, exp_offsets=offsets, **options
    )
    return stats, offsets / options["temperature"] - stats[0], e  # the offset: z_t's logit


def kept_stats(kept, plan, hidden, weight, bias, t_local, row_valid, **options):
    """``kept``'s ``(row statistics, target's z̃ − m, z)`` (the ``kept_logits`` primitive's
    contract: statistics of the rounded logits), the statistics made the fast mode's: the
    target's term exact (``rounded_logits.exact_target_stats``). ``options``: ``kept``'s
    keywords (``weight_layout``, ``temperature``, ``with_entropy``)."""
    stats, t_rel, z = kept(plan, hidden, weight, bias, t_local, row_valid, **options)
    stats = rounded_logits.exact_target_stats(
        stats, t_rel, z, t_local, bias, options["temperature"]
    )
    return stats, t_rel, z


def kept_logits(bias, z, temperature, t_local, exact):
    """z̃ of the kept logits, each row's target entry ``exact`` [N] (``t_local``: its column),
    as a ``kept_set.Logits``: columns ``[start, start + size)`` or rows ``[start, start + size)``.
    ``z`` may hold more rows than ``t_local`` (``Placement.logits_rows``): the first are these."""
    z = z[: t_local.shape[0]]

    def columns(start, size):
        b = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
        zs = rounded_logits.scaled(
            jax.lax.dynamic_slice_in_dim(z, start, size, axis=1), b, temperature
        )
        return rounded_logits.with_exact_target(zs, t_local, exact, start)

    def rows(start, size):
        zs = rounded_logits.scaled(jax.lax.dynamic_slice_in_dim(z, start, size), bias, temperature)
        return rounded_logits.with_exact_target(
            zs,
            jax.lax.dynamic_slice_in_dim(t_local, start, size),
            jax.lax.dynamic_slice_in_dim(exact, start, size),
        )

    return kept_set.Logits(columns, rows)


def fast_linear_logprobs(
    kept, hidden, weight, bias, targets, row_valid, call: linear_head.HeadCall, *, find_kept=None
):
    """``(logp, entropy | None)`` of ``hidden @ Wᵀ + bias``, the logits kept for the backward.

    ``kept``: the ``kept_logits`` primitive dispatch chose (:func:`local_stats`, or a kernel
    with its contract). Same arguments and layouts as ``linear_head.linear_from_parts`` (rows
    ``[...]``, global target ids, ``call.vocab_axis`` inside ``jax.shard_map``); a
    ``call.truncation``'s kept set is found over the kept logits (by ``find_kept``, the
    ``kept_set`` primitive)."""
    options = dict(weight_layout=call.weight_layout, temperature=call.temperature)
    vocab = geometry.vocab_size(weight, call.weight_layout)
    # whether a step may take the relative form; each step also needs the serving dtype, no
    # bias, enough rows and the whole vocabulary (the backward in vocabulary pieces would
    # see a part of it, whose rows' log-probs it cannot form)
    relative = (
        call.truncation is None
        and call.vocab_axis is None  # inside jax.shard_map, ``weight`` is one device's slice
        and not call.return_entropy
        and targets.ndim == hidden.ndim - 1
        and vocab_pieces.requested() == 1
    )

    def takes_relative(h, w, b):
        whole = () if geometry.vocab_size(w, call.weight_layout) == vocab else ("vocab",)
        return relative and relative_probs.serves(
            jnp.result_type(h, w), b, False, whole, h.shape[0]
        )

    def stats(plan, h, w, b, t_local, valid):
        if takes_relative(h, w, b):
            return relative_stats(
                kept, plan, h, w, b, t_local, valid, with_entropy=False, **options
            )
        return kept_stats(
            kept, plan, h, w, b, t_local, valid, with_entropy=call.return_entropy, **options
        )

    def logits_of(h, w, b, z, *, t_local):
        exact = rounded_logits.target_logits(h, w, b, t_local, **options)
        return kept_logits(b, z, call.temperature, t_local, exact)

    def backward(h, w, b, *rest, floor=None):
        if takes_relative(h, w, b):
            return relative_backward(h, w, b, *rest, **options)
        return local_backward(h, w, b, *rest, floor=floor, **options)

    return linear_head.linear_head_op(
        stats,
        backward,
        hidden,
        weight,
        bias,
        targets,
        row_valid,
        call,
        n_kept=1,
        find_kept=find_kept,
        logits_of=logits_of,
    )
