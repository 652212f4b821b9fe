"""Log-probs from per-shard softmax statistics: the engine halves every kernel backend's op uses.

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
    A linear head's backward also takes K ids per row, ``targets`` and ``g`` [N, K]
    (``d logp_k / dz = onehot_k − p``, ``head_ids.split_targets``).

This module turns them into the per-device halves of an :mod:`engine` op: the global row
statistics across a vocabulary split over devices (``softmax_math.combine_vocab_shards``,
:func:`finish_rows`), the outputs and residuals, and the backward's per-row inputs
(:func:`backward_rows`); the engine does the rest (where the work runs, the rows, the
``custom_vjp``, the cotangent sums across devices). Targets are global ids; device ``i`` of the
vocabulary axes holds ids ``[i·V_local, (i+1)·V_local)``.

A backend whose op jax differentiates itself (``reference``) is a :class:`Whole`: a function
of the local operands and the vocabulary axes, run through ``sharding.run`` as plain jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import sharding
from jaxrl_kernels.dispatch.contract import Whole
from jaxrl_kernels.engine import vjp
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import kept_set
from jaxrl_kernels.sharding.vma import varying_like

# -- per-device pieces ---------------------------------------------------------------------


def finish_rows(plan, stats, target_rel, targets_local, local_vocab, row_valid):
    """Global outputs from this device's statistics: (logp, entropy | None, lse, active)."""
    holds = (targets_local >= 0) & (targets_local < local_vocab)
    stats, target_rel, holders = softmax_math.combine_vocab_shards(
        stats, target_rel, holds, plan.vocab_axes
    )
    return softmax_math.finalize_row_stats(stats, target_rel, holders, row_valid)


def backward_rows(plan, local_vocab, targets, lse, entropy, active, g, g_ent):
    """A backward's per-row inputs on flat rows: this device's target ids, and no gradient on
    inactive rows (g = g_ent = 0 and lse = +inf there, so p = 0)."""
    g = jnp.where(active, g.astype(jnp.float32), 0.0)
    lse = jnp.where(active, lse, jnp.inf)
    if g_ent is not None:
        g_ent = jnp.where(active, g_ent.astype(jnp.float32), 0.0)
        entropy = jnp.where(active, entropy, 0.0)
    return plan.local_ids(targets, local_vocab), lse, entropy, g, g_ent


def finished(plan, stats, t_rel, t_local, local_vocab, valid, n_out, with_entropy):
    """A log-prob forward's outputs, then its residuals (lse, entropy if kept, active)."""
    logp, ent, lse, active = finish_rows(plan, stats, t_rel, t_local, local_vocab, valid)
    return (logp, ent)[:n_out] + (lse,) + ((ent,) if with_entropy else ()) + (active,)


def finished_truncated(
    plan,
    stats,
    t_rel,
    t_local,
    local_vocab,
    valid,
    n_out,
    with_entropy,
    truncation,
    logits,
    varying,
    find_kept,
):
    """:func:`finished` under a sampler's truncation (``truncation``: a
    ``sampler_math.Truncation``): the outputs over each row's kept set (``find_kept``, the
    ``kept_set`` primitive dispatch chose, on ``logits``: a ``kept_set.Logits``), then whether
    the row's target is in it; residuals: lse, entropy if kept, active, and the gradient's
    floor. ``stats`` None (:func:`stats_from_kept_set`): ``find_kept`` takes each row's max
    and target logit from the rows it makes."""
    if find_kept is None:
        raise TypeError("a truncation needs its kept_set primitive (dispatch.resolve)")
    holds = (t_local >= 0) & (t_local < local_vocab)
    found = None
    if stats is None:  # whole rows, no vocabulary split: the search's own max and target
        found = find_kept(
            logits,
            t_local.shape[0],
            local_vocab,
            None,
            valid,
            truncation,
            varying=varying,
            targets=t_local,
        )
        stats, t_rel = (found.m,), found.target_rel
    stats, target_rel, holders = softmax_math.combine_vocab_shards(
        stats, t_rel, holds, plan.vocab_axes
    )
    m = stats[0]
    if found is None:
        found = find_kept(
            logits,
            t_local.shape[0],
            local_vocab,
            m,
            valid,
            truncation,
            vocab_axes=plan.vocab_axes,
            varying=varying,
        )
    logp, ent, lse, active = softmax_math.finalize_row_stats(
        (m, found.s, found.a), target_rel, holders, valid
    )
    inside = active & (target_rel + m >= found.floor)
    floor = jnp.where(active, found.floor, -jnp.inf)
    return (logp, ent)[:n_out] + (inside, lse) + ((ent,) if with_entropy else ()) + (active, floor)


def stats_from_kept_set(plan, find_kept, n_kept: int) -> bool:
    """Whether a truncated forward skips its statistics pass: the kept-set search makes
    whole rows of this device (no vocabulary split) and finds their max and target itself
    (``kept_set.finds_row_max``), and no logits are kept for the backward."""
    return not plan.vocab_axes and n_kept == 0 and kept_set.finds_row_max(find_kept)


def first_row(outs):
    """An op's outputs on a single row added in front, that row's."""
    return tuple(None if o is None else o[0] for o in outs)


def row_residuals(rest, with_entropy):
    """``(lse, entropy | None, active, rest)`` from a backward's residuals and cotangents."""
    lse, rest = rest[0], rest[1:]
    ent, rest = (rest[0], rest[1:]) if with_entropy else (None, rest)
    return lse, ent, rest[0], rest[1:]


# -- logits [..., V] --------------------------------------------------------------------------


def _logits_backward(parts, n_logits, with_entropy, temperature, truncated=False):
    """The backward half of the logits ops: the gradient to the first logits operand (with
    the kept set's floor among the residuals when ``truncated``)."""

    def backward(plan, logits, *args):
        t, rest = args[n_logits - 1], args[n_logits + 1 :]
        lse, ent, active, cts = row_residuals(rest, with_entropy)
        floor, cts = (cts[0], cts[1:]) if truncated else (None, cts)
        g, g_ent = cts[0], (cts[1] if with_entropy else None)
        t_local, lse, ent, g, g_ent = backward_rows(
            plan, logits.shape[-1], t, lse, ent, active, g, g_ent
        )
        if floor is None:
            return (
                sharding.kernel_region(
                    lambda *a: parts.backward(*a, temperature=temperature),
                    logits,
                    t_local,
                    lse,
                    ent,
                    g,
                    g_ent,
                ),
            )
        return (
            sharding.kernel_region(
                lambda f, *a: parts.backward(*a, temperature=temperature, floor=f),
                floor,
                logits,
                t_local,
                lse,
                ent,
                g,
                g_ent,
            ),
        )

    return backward


def token_from_parts(
    parts,
    logits,
    targets,
    row_valid,
    *,
    temperature,
    return_entropy,
    vocab_axis=None,
    truncation=None,
    find_kept=None,
):
    """``(logp, entropy | None)`` of ``logits`` [..., V] (see ``contract``'s table);
    with a ``truncation``, ``(logp, entropy | None, inside)`` as :func:`linear_head_op`
    (``find_kept``: the ``kept_set`` primitive)."""
    rows = "r" * targets.ndim
    n_out = 2 if return_entropy else 1
    truncated = truncation is not None
    if isinstance(parts, Whole):
        return whole(
            parts,
            (logits,),
            (rows + "v",),
            targets,
            row_valid,
            n_out,
            vocab_axis,
            truncation=truncation,
            temperature=temperature,
            return_entropy=return_entropy,
        )
    if targets.ndim == 0:  # one row
        return first_row(
            token_from_parts(
                parts,
                logits[None],
                targets[None],
                row_valid[None],
                temperature=temperature,
                return_entropy=return_entropy,
                vocab_axis=vocab_axis,
                truncation=truncation,
                find_kept=find_kept,
            )
        )

    def forward(plan, x, t, valid):
        t_local = t - plan.vocab_offset(x.shape[-1])
        m, s, a, t_rel = sharding.kernel_region(
            lambda x, t, v: parts.stats(
                x, t, v, temperature=temperature, with_entropy=return_entropy
            ),
            x,
            t_local,
            valid,
        )
        stats = (m, s) + ((a,) if return_entropy else ())
        if truncated:
            return finished_truncated(
                plan,
                stats,
                t_rel,
                t_local,
                x.shape[-1],
                valid,
                n_out,
                return_entropy,
                truncation,
                kept_set.Logits.of_array(x, temperature),
                lambda y: varying_like(y, x),
                find_kept,
            )
        return finished(plan, stats, t_rel, t_local, x.shape[-1], valid, n_out, return_entropy)

    outs = vjp.differentiable(
        forward,
        _logits_backward(parts, 1, return_entropy, temperature, truncated),
        (logits, targets, row_valid),
        (rows + "v", rows, rows),
        (rows,) * (n_out + truncated),
        (rows,) * (n_out + 1 + truncated),
        diff=(0,),
        vocab_axis=vocab_axis,
    )
    entropy = outs[1] if return_entropy else None
    return (outs[0], entropy, outs[n_out]) if truncated else (outs[0], entropy)


def paired_from_parts(
    parts, policy_logits, ref_logits, targets, row_valid, *, temperature, vocab_axis=None
):
    """``(logp, ref_logp)`` of two logits streams sharing targets; gradient to the policy only."""
    rows = "r" * targets.ndim
    if isinstance(parts, Whole):
        return whole(
            parts,
            (policy_logits, ref_logits),
            (rows + "v", rows + "v"),
            targets,
            row_valid,
            2,
            vocab_axis,
            temperature=temperature,
        )
    if targets.ndim == 0:  # one row
        return first_row(
            paired_from_parts(
                parts,
                policy_logits[None],
                ref_logits[None],
                targets[None],
                row_valid[None],
                temperature=temperature,
                vocab_axis=vocab_axis,
            )
        )

    def forward(plan, x, y, t, valid):
        t_local = t - plan.vocab_offset(x.shape[-1])
        pol, ref = sharding.kernel_region(
            lambda x, y, t, v: parts.stats(x, y, t, v, temperature=temperature),
            x,
            y,
            t_local,
            valid,
        )
        logp, _, lse, active = finish_rows(plan, pol[:2], pol[3], t_local, x.shape[-1], valid)
        ref_logp = finish_rows(plan, ref[:2], ref[3], t_local, x.shape[-1], valid)[0]
        return logp, ref_logp, lse, active

    return vjp.differentiable(
        forward,
        _logits_backward(parts, 2, False, temperature),
        (policy_logits, jax.lax.stop_gradient(ref_logits), targets, row_valid),
        (rows + "v", rows + "v", rows, rows),
        (rows, rows),
        (rows, rows),
        diff=(0,),
        vocab_axis=vocab_axis,
    )


# -- a linear head: hidden [..., D], weight [V, D] ("vd") or [D, V] ("dv") ---------------------

# -- ops jax differentiates itself (the reference backend) -------------------------------------


def whole(
    parts: Whole,
    operands,
    roles,
    targets,
    row_valid,
    n_out,
    vocab_axis,
    *,
    n_row_dims=None,
    truncation=None,
    **options,
):
    """Run a ``Whole`` op through ``sharding.run`` as plain jnp; returns its first two outputs
    (the second None when it has one), and with a ``truncation`` (passed on to the op, which
    returns ``(logp, entropy | None, inside)`` then) the third. ``targets`` may have one
    dimension more than the ``n_row_dims`` row dimensions (default: all of its own): K ids
    per row."""
    n_row_dims = targets.ndim if n_row_dims is None else n_row_dims
    rows = "r" * n_row_dims
    per_id = rows + "-" * (targets.ndim - n_row_dims)
    if truncation is not None:
        options["truncation"] = truncation

    def local(plan, *args):
        *ops, targets, row_valid = args
        out = parts.fn(
            *ops, targets, row_valid, vocab_axes=plan.vocab_axes, n_row_dims=n_row_dims, **options
        )
        return tuple(out)[:n_out] + ((out[2],) if truncation is not None else ())

    out_roles = (per_id,) + (rows,) * (n_out - 1) + ((rows,) if truncation is not None else ())
    outs = sharding.run(
        local,
        tuple(operands) + (targets, row_valid),
        tuple(roles) + (per_id, per_id),
        out_roles,
        vocab_axis=vocab_axis,
        differentiable=True,
        record=vjp.note_layout,
    )
    entropy = outs[1] if n_out == 2 else None
    return (outs[0], entropy, outs[-1]) if truncation is not None else (outs[0], entropy)
