"""Log-probs from per-shard softmax statistics: the one ``custom_vjp`` every kernel backend uses.

A kernel backend supplies two pieces of work on one device's data (:class:`Parts`):

``stats(operands, targets, row_valid, *, with_entropy) -> (m, s, a | None, t)``
    per row of ``z`` (this device's vocabulary columns, already divided by the temperature):
    ``m = max z``, ``s = Σ exp(z − m)``, ``a = Σ exp(z − m)(z − m)`` and ``t = z[target] − m``
    wherever ``0 <= target < V_local`` (anything elsewhere). Rows with ``row_valid == False``
    may be skipped (their statistics are never used).
``backward(operands, targets, lse, entropy | None, g, g_ent | None) -> cotangents``
    the cotangent of each operand for per-row cotangents ``g`` (of logp) and ``g_ent`` (of the
    entropy), with ``d logp/dz = onehot − p`` and ``d H/dz = −p (log p + H)`` and
    ``p = exp(z − lse)``. Rows that must get no gradient arrive with ``g = g_ent = 0`` and
    ``lse = +inf`` (so ``p = 0``); a target outside ``[0, V_local)`` adds no one-hot term.

This module does the rest, once for all backends: the global row statistics across a
vocabulary split over devices (``softmax_math.combine_vocab_shards``), the outputs and residuals,
the cotangent sums across devices (each cotangent sharded like its operand), and where the work
runs (``sharding.run``). Targets are global ids; device ``i`` of the vocabulary axes holds ids
``[i·V_local, (i+1)·V_local)``.

A backend whose op jax differentiates itself (``reference``) is a :class:`Whole`: a function
of the local operands and the vocabulary axes, run through ``sharding.run`` as plain jnp.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_kernels import head, sharding, softmax_math


@dataclasses.dataclass(frozen=True)
class Parts:
    """The two per-device pieces of a kernel backend's log-prob op (see the module docstring)."""

    stats: Callable[..., Any]
    backward: Callable[..., Any] | None  # None: ask dispatch for a standalone backward


@dataclasses.dataclass(frozen=True)
class Whole:
    """A log-prob op jax differentiates itself: ``fn(*local operands, targets, row_valid,
    vocab_axes=..., **options) -> outputs``."""

    fn: Callable[..., Any]


# -- per-device forward / backward ------------------------------------------------------------

def _rows_flat(x, n_row_dims):
    return x.reshape((math.prod(x.shape[:n_row_dims]),) + x.shape[n_row_dims:])


def _finish(plan, stats, target_rel, targets_local, local_vocab, row_valid):
    """Global outputs from this device's statistics: (logp, entropy | None, lse, active)."""
    holds = (targets_local >= 0) & (targets_local < local_vocab)
    stats, target_rel, holders = softmax_math.combine_vocab_shards(stats, target_rel, holds,
                                                              plan.vocab_axes)
    return softmax_math.finalize_row_stats(stats, target_rel, holders, row_valid)


def _backward_rows(plan, vocab_operand, local_vocab, targets, lse, entropy, active, g, g_ent):
    """The backward part's per-row inputs, flat: this device's target ids, and no gradient on
    inactive rows (g = g_ent = 0 and lse = +inf there, so p = 0)."""
    flat = lambda x: None if x is None else x.reshape(-1)
    g, g_ent = (flat(plan.output_cotangent(c, vocab_operand)) for c in (g, g_ent))
    active = flat(active)
    g = jnp.where(active, g.astype(jnp.float32), 0.0)
    lse = jnp.where(active, flat(lse), jnp.inf)
    if g_ent is not None:
        g_ent = jnp.where(active, g_ent.astype(jnp.float32), 0.0)
        entropy = jnp.where(active, flat(entropy), 0.0)
    t_local = flat(targets) - plan.vocab_offset(local_vocab)
    return t_local, lse, entropy, g, g_ent


# -- logits [..., V] --------------------------------------------------------------------------

def token_from_parts(parts, logits, targets, row_valid, *, temperature, return_entropy,
                   vocab_axis=None, record=None):
    """``(logp, entropy | None)`` of ``logits`` [..., V] (see ``backend_contract``'s table)."""
    if isinstance(parts, Whole):
        return _whole(parts, (logits,), ("r" * targets.ndim + "v",), targets, row_valid,
                      2 if return_entropy else 1, vocab_axis, record, temperature=temperature,
                      return_entropy=return_entropy)
    k = targets.ndim
    rows = "r" * k
    n_out = 2 if return_entropy else 1

    def local_forward(plan, logits, targets, row_valid):
        shape = targets.shape
        x, t, valid = _rows_flat(logits, k), targets.reshape(-1), row_valid.reshape(-1)
        t_local = t - plan.vocab_offset(x.shape[-1])
        m, s, a, t_rel = sharding.kernel_region(
            lambda x, t, v: parts.stats(x, t, v, temperature=temperature,
                                        with_entropy=return_entropy), x, t_local, valid)
        stats = (m, s) + ((a,) if return_entropy else ())
        logp, ent, lse, active = _finish(plan, stats, t_rel, t_local, x.shape[-1], valid)
        outs = (logp, ent)[:n_out] + (lse, active)
        return tuple(o.reshape(shape) for o in outs)

    @jax.custom_vjp
    def op(logits, targets, row_valid):
        return fwd(logits, targets, row_valid)[0]

    def fwd(logits, targets, row_valid):
        outs = sharding.run(local_forward, (logits, targets, row_valid), (rows + "v", rows, rows),
                            (rows,) * (n_out + 2), vocab_axis=vocab_axis, record=record)
        logp, ent = (outs[0], outs[1] if return_entropy else None)
        lse, active = outs[n_out:]
        return (logp, ent), (logits, targets, lse, ent, active)

    def bwd(res, cot):
        logits, targets, lse, ent, active = res
        g, g_ent = cot
        g_ent = g_ent if return_entropy else None
        d = _token_backward(parts, logits, targets, lse, ent, active, g, g_ent,
                            temperature=temperature, vocab_axis=vocab_axis)
        return d, None, None

    op.defvjp(fwd, bwd)
    return op(logits, targets, row_valid)


def paired_from_parts(parts, policy_logits, ref_logits, targets, row_valid, *, temperature,
                    vocab_axis=None, record=None):
    """``(logp, ref_logp)`` of two logits streams sharing targets; gradient to the policy only."""
    if isinstance(parts, Whole):
        rows = "r" * targets.ndim
        return _whole(parts, (policy_logits, ref_logits), (rows + "v", rows + "v"), targets,
                      row_valid, 2, vocab_axis, record, temperature=temperature)
    k = targets.ndim
    rows = "r" * k

    def local_forward(plan, policy, ref, targets, row_valid):
        shape = targets.shape
        x, y = _rows_flat(policy, k), _rows_flat(ref, k)
        t, valid = targets.reshape(-1), row_valid.reshape(-1)
        t_local = t - plan.vocab_offset(x.shape[-1])
        pol_stats, ref_stats = sharding.kernel_region(
            lambda x, y, t, v: parts.stats(x, y, t, v, temperature=temperature),
            x, y, t_local, valid)
        logp, _, lse, active = _finish(plan, pol_stats[:2], pol_stats[3], t_local,
                                       x.shape[-1], valid)
        ref_logp, _, _, _ = _finish(plan, ref_stats[:2], ref_stats[3], t_local, x.shape[-1],
                                    valid)
        return tuple(o.reshape(shape) for o in (logp, ref_logp, lse, active))

    @jax.custom_vjp
    def op(policy, ref, targets, row_valid):
        return fwd(policy, ref, targets, row_valid)[0]

    def fwd(policy, ref, targets, row_valid):
        logp, ref_logp, lse, active = sharding.run(
            local_forward, (policy, ref, targets, row_valid), (rows + "v", rows + "v", rows, rows),
            (rows,) * 4, vocab_axis=vocab_axis, record=record)
        return (logp, ref_logp), (policy, targets, lse, active, ref)

    def bwd(res, cot):
        policy, targets, lse, active, ref = res
        d = _token_backward(parts, policy, targets, lse, None, active, cot[0], None,
                            temperature=temperature, vocab_axis=vocab_axis)
        return d, None, None, None  # None: a zero cotangent of the reference's own type

    op.defvjp(fwd, bwd)
    return op(policy_logits, jax.lax.stop_gradient(ref_logits), targets, row_valid)


def _token_backward(parts, logits, targets, lse, entropy, active, g, g_ent, *, temperature,
                    vocab_axis):
    k = targets.ndim
    rows = "r" * k

    def local_backward(plan, logits, targets, lse, entropy, active, g, g_ent):
        x = _rows_flat(logits, k)
        t_local, lse, entropy, g, g_ent = _backward_rows(plan, logits, x.shape[-1], targets, lse,
                                                         entropy, active, g, g_ent)
        d = sharding.kernel_region(
            lambda *a: parts.backward(*a, temperature=temperature), x, t_local, lse, entropy,
            g, g_ent)
        return (d.reshape(logits.shape),)

    (d,) = sharding.run(local_backward, (logits, targets, lse, entropy, active, g, g_ent),
                        (rows + "v",) + (rows,) * 6, (rows + "v",), grads_of=(0,),
                        vocab_axis=vocab_axis)
    return d.astype(logits.dtype)


# -- a linear head: hidden [..., D], weight [V, D] ("vd") or [D, V] ("dv") ---------------------

def head_roles(k: int, weight_layout: str) -> tuple[str, str, str]:
    """The sharding roles of (hidden, weight, bias) with ``k`` row dimensions."""
    return "r" * k + "-", head.roles(weight_layout), "v"


def linear_from_parts(parts, hidden, weight, bias, targets, row_valid, *, weight_layout,
                    temperature, return_entropy, backward=None, vocab_axis=None, record=None):
    """``(logp, entropy | None)`` of ``hidden @ Wᵀ + bias`` without materialising the logits.

    ``backward``: where ``parts.backward`` is None (``ffi``), the standalone backward as a
    thunk ``() -> backward function`` (``backend_contract.Choice.backward``), called when the
    backward pass is traced.
    """
    if isinstance(parts, Whole):
        return _whole(parts, (hidden, weight, bias), head_roles(targets.ndim, weight_layout),
                      targets, row_valid, 2 if return_entropy else 1, vocab_axis, record,
                      weight_layout=weight_layout, temperature=temperature,
                      return_entropy=return_entropy)
    k = targets.ndim
    rows = "r" * k
    h_roles, w_roles, b_roles = head_roles(k, weight_layout)
    n_out = 2 if return_entropy else 1

    def local_vocab(weight):
        return head.vocab_size(weight, weight_layout)

    def local_forward(plan, hidden, weight, bias, targets, row_valid):
        shape = targets.shape
        h, t, valid = _rows_flat(hidden, k), targets.reshape(-1), row_valid.reshape(-1)
        t_local = t - plan.vocab_offset(local_vocab(weight))
        m, s, a, t_rel = sharding.kernel_region(
            lambda h, w, b, t, v: parts.stats(h, w, b, t, v, weight_layout=weight_layout,
                                              temperature=temperature,
                                              with_entropy=return_entropy),
            h, weight, bias, t_local, valid)
        stats = (m, s) + ((a,) if return_entropy else ())
        logp, ent, lse, active = _finish(plan, stats, t_rel, t_local, local_vocab(weight), valid)
        outs = (logp, ent)[:n_out] + (lse, active)
        return tuple(o.reshape(shape) for o in outs)

    @jax.custom_vjp
    def op(hidden, weight, bias, targets, row_valid):
        return fwd(hidden, weight, bias, targets, row_valid)[0]

    def fwd(hidden, weight, bias, targets, row_valid):
        outs = sharding.run(local_forward, (hidden, weight, bias, targets, row_valid),
                            (h_roles, w_roles, b_roles, rows, rows), (rows,) * (n_out + 2),
                            vocab_axis=vocab_axis, record=record)
        logp, ent = outs[0], (outs[1] if return_entropy else None)
        lse, active = outs[n_out:]
        return (logp, ent), (hidden, weight, bias, targets, lse, ent, active)

    def bwd(res, cot):
        hidden, weight, bias, targets, lse, ent, active = res
        g, g_ent = cot
        backward_fn = parts.backward or backward()
        kernel = lambda *a: sharding.kernel_region(  # noqa: E731
            lambda *a: backward_fn(*a, weight_layout=weight_layout, temperature=temperature), *a)
        grads = head_backward(kernel, hidden, weight, bias, (), targets, lse, ent, active, g,
                              g_ent if return_entropy else None, weight_layout=weight_layout,
                              vocab_axis=vocab_axis)
        return grads + (None, None)

    op.defvjp(fwd, bwd)
    return op(hidden, weight, bias, targets, row_valid)


def head_backward(local_backward, hidden, weight, bias, kept, targets, lse, entropy, active, g,
                  g_ent, *, weight_layout, vocab_axis):
    """(d_hidden, d_weight, d_bias | None) of a linear-head op from its residuals, each shaped
    and sharded like its operand: the cotangent half of every linear-head custom_vjp.

    Per device, ``local_backward(h [N, D], weight, bias, *kept [N, V_local], t_local, lse,
    entropy, g, g_ent)`` gets flat rows, this device's target ids and no gradient on inactive
    rows (see the module docstring); ``kept`` are residuals laid out like the logits
    (``saved_logits``' kept logits), ``()`` for a backend's backward part.
    """
    k = targets.ndim
    rows = "r" * k
    h_roles, w_roles, b_roles = head_roles(k, weight_layout)

    def local(plan, hidden, weight, bias, *rest):
        kept, (targets, lse, entropy, active, g, g_ent) = rest[:-6], rest[-6:]
        t_local, lse, entropy, g, g_ent = _backward_rows(
            plan, weight, head.vocab_size(weight, weight_layout), targets, lse, entropy, active,
            g, g_ent)
        dh, dw, db = local_backward(_rows_flat(hidden, k), weight, bias,
                                    *(_rows_flat(x, k) for x in kept), t_local, lse, entropy,
                                    g, g_ent)
        return dh.reshape(hidden.shape), dw, db

    grads = sharding.run(
        local, (hidden, weight, bias) + tuple(kept) + (targets, lse, entropy, active, g, g_ent),
        (h_roles, w_roles, b_roles) + (rows + "v",) * len(kept) + (rows,) * 6,
        (h_roles, w_roles) + ((b_roles,) if bias is not None else ()),
        grads_of=(0, 1) + ((2,) if bias is not None else ()), vocab_axis=vocab_axis)
    dh, dw = grads[0], grads[1]
    db = grads[2].astype(bias.dtype) if bias is not None else None
    return dh.astype(hidden.dtype), dw.astype(weight.dtype), db


# -- ops jax differentiates itself (the reference backend) -------------------------------------

def _whole(parts: Whole, operands, roles, targets, row_valid, n_out, vocab_axis, record,
           **options):
    """Run a ``Whole`` op through ``sharding.run`` as plain jnp; returns its first two outputs
    (the second None when it has one)."""
    rows = "r" * targets.ndim

    def local(plan, *args):
        *ops, targets, row_valid = args
        out = parts.fn(*ops, targets, row_valid, vocab_axes=plan.vocab_axes,
                       n_row_dims=targets.ndim, **options)
        return tuple(out)[:n_out]

    outs = sharding.run(local, tuple(operands) + (targets, row_valid), tuple(roles) + (rows, rows),
                        (rows,) * n_out, vocab_axis=vocab_axis, differentiable=True,
                        record=record)
    return outs[0], (outs[1] if n_out == 2 else None)
