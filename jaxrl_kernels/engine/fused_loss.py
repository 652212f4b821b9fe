"""``memory="fast"`` for the linear losses: the loss's gradient taken in the forward pass.

A loss ``L(logp, H, x)`` of the per-token log-probs (entropies ``H``, other inputs ``x``) knows
every token's cotangent ``g = ∂L/∂logp`` and ``g_H = ∂L/∂H`` as soon as the forward has the
log-probs of all rows: sequence-level options (GSPO's ratio, sequence aggregation, sequence
importance weights) are sums over those ``[B, T]`` arrays. So the forward, right after the
head's logits ``z = h·Wᵀ`` (one GEMM, rounded to the head's dtype as in
:mod:`saved_logits`), writes the logits' gradient over them::

    dz = g · (onehot_t − p) − g_H · p · (log p + H),   p = exp(z̃ − lse)   (softmax_math)

and the backward, given the cotangent ``c`` of the loss, runs the two GEMMs left::

    d_hidden = c · dz·W / T,   d_weight = dzᵀ·(c·h) / T,   d_bias = c · Σ_rows dz / T

``d_hidden`` accumulated in float32 and scaled there, ``c·h`` rounded to the head's dtype
(exact for ``jax.grad``'s ``c = 1``); with a bias, the forward also keeps ``Σ_rows dz`` in
float32, summed before ``dz`` is rounded.

Where it serves (a bfloat16 or float32 head without bias, no entropy term, the vocabulary on
one device, at least 512 rows: ``head.relative_probs``), the kernel keeps ``E = exp(z̃ − z̃_t)``
instead of the logits, N target entries make it ``dz / s`` per row, and no pass over
``[N, V]`` runs: the backward's GEMMs apply ``s`` on their ``[N, D]`` sides.

Three GEMMs, and one ``[N, V]`` buffer in the head's dtype from the forward to the backward
(the logits, then their gradient in their place): half of what keeping the logits for a later
backward holds at its peak (the logits and their gradient at once).

The other outputs (policy loss, KL, metrics) keep exact gradients for any cotangent: where
one of theirs is not a symbolic zero, the backward takes the whole per-token cotangent (the
loss's and theirs) through :func:`saved_logits.recomputed_backward` (one GEMM more than the
loss alone, the kept gradient unused). The loss's other inputs get their gradients from the
loss function's own VJP.

The op is the engine's two steps (:func:`vjp.stage`) with the loss function over every row
between them, so its ``custom_vjp`` is its own: the loss's leaves and symbolic zeros are
part of it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxrl_kernels.engine import fused_backward, linear_head, logprob_core, saved_logits, vjp
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry, head_grad, kept_grads, relative_probs, rounded_logits
from jaxrl_kernels.head.blocks import blocks
from jaxrl_kernels.sharding import collectives
from jaxrl_kernels.sharding.vma import varying_like


def _is_float(x) -> bool:
    return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


ROW_BLOCK_BYTES = 64 * 2**20
"""The logits' gradient is written over them in blocks of rows of about this size."""


def _local_forward(
    kept,
    plan,
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    with_entropy,
):
    """One device's flat rows: (logp, entropy if asked, lse, active, z [N, V_local]), the
    logits and their statistics from ``kept`` (the ``kept_logits`` primitive)."""
    vocab = geometry.vocab_size(weight, weight_layout)
    t_local = targets - plan.vocab_offset(vocab)
    options = dict(weight_layout=weight_layout, temperature=temperature, with_entropy=with_entropy)
    dtype = jnp.result_type(hidden, weight)
    relative = relative_probs.serves(dtype, bias, with_entropy, plan.vocab_axes, hidden.shape[0])
    stats_of = saved_logits.relative_stats if relative else saved_logits.kept_stats
    stats, t_rel, z = stats_of(kept, plan, hidden, weight, bias, t_local, row_valid, **options)
    logp, ent, lse, active = logprob_core.finish_rows(plan, stats, t_rel, t_local, vocab, row_valid)
    return (logp,) + ((ent,) if with_entropy else ()) + (lse, active, z)


def _local_logit_grad(
    plan,
    weight,
    bias,
    z,
    targets,
    logp,
    lse,
    entropy,
    active,
    g,
    g_ent,
    row_valid,
    *,
    weight_layout,
    temperature,
):
    """This device's ``dz`` in z's dtype, written over its kept logits ``z`` [R ≥ S, V_local]
    block by block of the S rows of the per-row operands (a loop of in-place updates: no
    second ``[R, V]`` buffer; ``z``'s rows past S are left as they are: a row-skipping branch
    gets it whole, kept rows first, and the rows it skips hold logits of zeroed rows, 0, and
    so their gradient already: ``engine.row_skip``), the target's entry exact (``lse +
    logp``, as the forward's statistics took it), the ``1/σ`` it was written times (float16:
    :func:`_float16_scale`), and, with a bias, its float32 column sums ``Σ_rows dz``
    [V_local] before that rounding."""
    del row_valid  # its rows are inactive: g = g_H = 0 and p = 0 there, so dz is 0
    vocab = geometry.vocab_size(weight, weight_layout)
    g, g_ent = (collectives.output_cotangent(plan, c, weight) for c in (g, g_ent))
    per_row = logprob_core.backward_rows(plan, vocab, targets, lse, entropy, active, g, g_ent)
    if relative_probs.serves(z.dtype, bias, entropy is not None, plan.vocab_axes, targets.shape[0]):
        # z holds E (``head.relative_probs``): N target entries make it E', dz = s·E'
        e = relative_probs.with_target_entries(z, per_row[0], logp, active)
        return e, relative_probs.row_scale(per_row[3], logp, active, temperature), None
    g, g_ent = per_row[3], per_row[4]
    exact = jnp.where(active, logp + lse, 0.0)  # z̃_t; inactive rows have no gradient
    per_row = per_row + (exact,)
    spans = blocks(targets.shape[0], ROW_BLOCK_BYTES // max(1, vocab * z.dtype.itemsize))
    scale = _float16_scale(g, g_ent, per_row[2], temperature) if z.dtype == jnp.float16 else 1.0

    def block(c, carry):
        flat, col_sums = carry if bias is not None else (carry, None)
        start = spans.start(c)
        fresh = spans.fresh(c)[:, None]
        t, l, ent, gg, ge, z_t = (
            None if x is None else jax.lax.dynamic_slice_in_dim(x, start, spans.size)
            for x in per_row
        )
        z_c = jax.lax.dynamic_slice_in_dim(flat, start, spans.size)
        zs = rounded_logits.with_exact_target(rounded_logits.scaled(z_c, bias, temperature), t, z_t)
        is_target = jnp.arange(vocab)[None, :] == t[:, None]
        dz = softmax_math.logprob_grad_tile(zs, l, ent, is_target, gg, ge, temperature)
        flat = jax.lax.dynamic_update_slice_in_dim(
            flat, jnp.where(fresh, (dz * scale).astype(flat.dtype), z_c), start, 0
        )
        if col_sums is None:
            return flat
        return flat, col_sums + jnp.sum(jnp.where(fresh, dz, 0.0), axis=0)

    init = z
    if bias is not None:
        init = (z, varying_like(jnp.zeros((vocab,), jnp.float32), z, weight))
    # A static trip count: XLA's GPU runtime reads a loop's predicate back to the host on every
    # iteration when the count is only known on the device (one host sync per block, each an
    # idle gap between kernels). Row skipping's branches give each its own static S.
    out = jax.lax.fori_loop(0, spans.count, block, init)
    dz, col_sums = out if bias is not None else (out, None)
    inv_scale = jnp.broadcast_to(1.0 / jnp.asarray(scale, jnp.float32), g.shape)
    return dz, inv_scale, col_sums


def _float16_scale(g, g_ent, entropy, temperature):
    """The power of two that brings this device's largest ``|dz|`` (bounded per row by
    ``(|g| + |g_H| (1/e + |H|)) / T``) to at most 2¹⁴: ``dz`` is written times it, so that its
    small entries stay out of float16's subnormals (below 6.1e-5; the aggregation's ``1/N``
    puts many there)."""
    bound = jnp.abs(g)
    if g_ent is not None:
        bound = bound + jnp.abs(g_ent) * (jnp.exp(-1.0) + jnp.abs(entropy))
    return head_grad.pow2_range(jnp.max(bound, initial=0.0) / temperature)


def fused_linear_loss(
    kept,
    loss_fn,
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    inputs,
    call: linear_head.HeadCall,
    *,
    gemms=kept_grads.leading_rows_grads,
):
    """``loss_fn(logp, entropy | None, inputs)`` on the log-probs of ``hidden @ Wᵀ + bias``,
    its gradient to the head taken in the forward (see the module docstring).

    ``kept``: the ``kept_logits`` primitive dispatch chose (``rounded_logits.local_stats``, or
    a kernel with its contract), which makes the logits and their row statistics; ``gemms``:
    the ``kept_gemms`` primitive, the backward's GEMMs on a row-skipping branch's rows.

    ``loss_fn`` returns a pytree whose first leaf is the scalar loss; ``inputs`` is a pytree
    of its other arrays (float leaves get their gradients through ``loss_fn``'s VJP).
    ``hidden``, ``weight``, ``bias``, ``targets``, ``row_valid`` and ``call`` are as in
    ``linear_head.linear_from_parts``; ``row_valid`` False rows get no gradient.
    """
    weight_layout, temperature = call.weight_layout, call.temperature
    with_entropy, vocab_axis = call.return_entropy, call.vocab_axis
    rows = "r" * targets.ndim
    h_roles, w_roles, b_roles = linear_head.head_roles(targets.ndim, weight_layout)
    options = dict(weight_layout=weight_layout, temperature=temperature)
    leaves, tree = jax.tree.flatten(inputs)
    floats = [i for i, x in enumerate(leaves) if _is_float(x)]
    has_bias = bias is not None

    def small_vjp(logp, entropy, leaves):
        """``loss_fn``'s outputs and VJP in (logp, entropy, the float leaves of inputs)."""

        def f(logp, entropy, float_leaves):
            full = list(leaves)
            for i, x in zip(floats, float_leaves):
                full[i] = x
            return loss_fn(logp, entropy, jax.tree.unflatten(tree, full))

        return jax.vjp(f, logp, entropy, [leaves[i] for i in floats])

    def forward(hidden, weight, bias, targets, row_valid):
        """(logp, entropy | None), (lse, active, z), through the engine's forward step."""
        local = functools.partial(_local_forward, kept, with_entropy=with_entropy, **options)
        outs = vjp.stage(
            local,
            (hidden, weight, bias, targets, row_valid),
            (h_roles, w_roles, b_roles, rows, rows),
            (rows,) * (4 if with_entropy else 3) + (rows + "v",),
            vocab_axis=vocab_axis,
            note=True,
            keep_at=4,
        )
        return (outs[0], outs[1] if with_entropy else None), outs[-3:]

    def logit_grad(weight, bias, z, targets, logp, lse, entropy, active, g, g_ent, row_valid):
        local = functools.partial(_local_logit_grad, **options)

        return vjp.stage(
            local,
            (weight, bias, z, targets, logp, lse, entropy, active, g, g_ent, row_valid),
            (w_roles, b_roles, rows + "v") + (rows,) * 8,
            (rows + "v", rows) + ((b_roles,) if has_bias else ()),
            grads_of=(None, None) + ((1,) if has_bias else ()),
            vocab_axis=vocab_axis,
            keep_at=10,
            whole=(2,),  # z: updated in place over a branch's first rows
        )

    @jax.custom_vjp
    def op(hidden, weight, bias, targets, row_valid, leaves):
        (logp, entropy), _ = forward(hidden, weight, bias, targets, row_valid)
        return small_vjp(logp, entropy, leaves)[0]

    def fwd(hidden, weight, bias, targets, row_valid, leaves):
        hidden, weight, bias, targets, row_valid, leaves = jax.tree.map(
            lambda p: p.value, (hidden, weight, bias, targets, row_valid, leaves)
        )
        (logp, entropy), (lse, active, z) = forward(hidden, weight, bias, targets, row_valid)
        # a row the relative form leaves (relative_probs.LOGP_FLOOR) sends the backward to the
        # recomputed logits; None where no step can take the relative form
        low = None
        if relative_probs.serves(z.dtype, bias, with_entropy, vocab_axis, targets.size):
            low = relative_probs.has_low_rows(logp, active)
        outs, pullback = small_vjp(logp, entropy, leaves)
        g, g_ent, _ = pullback(_seed(outs))
        dz, inv_scale, *col_sums = logit_grad(
            weight, bias, z, targets, logp, lse, entropy, active, g, g_ent, row_valid
        )
        return outs, (
            hidden,
            weight,
            bias,
            targets,
            row_valid,
            leaves,
            logp,
            entropy,
            lse,
            active,
            dz,
            inv_scale,
            col_sums,
            low,
        )

    def bwd(res, cts):
        (
            hidden,
            weight,
            bias,
            targets,
            row_valid,
            leaves,
            logp,
            entropy,
            lse,
            active,
            dz,
            inv_scale,
            col_sums,
            low,
        ) = res
        ct_leaves = jax.tree.leaves(cts, is_leaf=lambda c: isinstance(c, SymbolicZero))
        c, others = ct_leaves[0], ct_leaves[1:]
        outs, pullback = small_vjp(logp, entropy, leaves)
        g, g_ent, d_floats = pullback(_instantiate(cts, outs))
        grads = None
        common = (targets, lse, entropy, active, row_valid)

        def recomputed():
            # the whole per-token cotangent through the recomputed logits: one rounding of
            # the logits' gradient, as for the loss alone
            return linear_head.head_backward(
                functools.partial(
                    fused_backward.recomputed_backward,
                    vocab=geometry.vocab_size(weight, weight_layout),
                    **options,
                ),
                hidden,
                weight,
                bias,
                (),
                *common,
                g,
                g_ent,
                call,
            )

        def from_kept():
            c_rows = c.astype(jnp.float32) * inv_scale
            d_hidden, d_weight, _ = linear_head.head_backward(
                functools.partial(
                    fused_backward.head_grads, weight_layout=weight_layout, gemms=gemms
                ),
                hidden,
                weight,
                None,
                (dz,),
                *common,
                c_rows,
                None,
                call,
                whole_kept=True,
            )
            d_bias = (
                None if bias is None else (c.astype(jnp.float32) * col_sums[0]).astype(bias.dtype)
            )
            return d_hidden, d_weight, d_bias

        if not all(isinstance(o, SymbolicZero) for o in others):
            grads = recomputed()
        elif not isinstance(c, SymbolicZero):
            grads = from_kept() if low is None else jax.lax.cond(low, recomputed, from_kept)
        if grads is None:
            grads = (
                jnp.zeros_like(hidden),
                jnp.zeros_like(weight),
                None if bias is None else jnp.zeros_like(bias),
            )
        d_leaves = [None] * len(leaves)
        for i, d in zip(floats, d_floats):
            d_leaves[i] = d
        return grads + (None, None, d_leaves)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    return op(hidden, weight, bias, targets, row_valid, leaves)


def _seed(outs):
    """The cotangent 1 on the first leaf of ``outs`` (the loss), 0 on the others."""
    leaves, tree = jax.tree.flatten(outs)
    seeds = [jnp.ones_like(leaves[0])] + [jnp.zeros_like(x) for x in leaves[1:]]
    return jax.tree.unflatten(tree, seeds)


def _instantiate(cts, outs):
    """``cts`` with every symbolic zero made an array of its output's shape and dtype."""
    return jax.tree.map(
        lambda c, o: jnp.zeros_like(o) if isinstance(c, SymbolicZero) else c,
        cts,
        outs,
        is_leaf=lambda c: isinstance(c, SymbolicZero),
    )
