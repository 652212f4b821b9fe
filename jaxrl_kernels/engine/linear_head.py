"""The lean linear-head pipeline: a linear head's log-probs as one engine op over a backend's halves.

``linear_from_parts`` turns a backend's :class:`~jaxrl_kernels.dispatch.contract.Parts` (row
statistics and a backward on one device's rows) into a differentiable, sharded op through
``linear_head_op`` (one target per row, or K ids per row: ``_linear_ids_op``); the fast mode
(``saved_logits``) uses the same op with halves that keep the logits. ``head_backward`` is the
backward half alone, for the fused losses' own ``custom_vjp``. Every function takes the call's
options as one :class:`HeadCall`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_kernels import sharding
from jaxrl_kernels.dispatch.contract import Whole
from jaxrl_kernels.engine import logprob_core, vjp
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.formulas.sampler_math import Truncation
from jaxrl_kernels.head import geometry, head_ids, kept_set, vocab_chunks
from jaxrl_kernels.sharding import collectives
from jaxrl_kernels.sharding.vma import varying_like

AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class HeadCall:
    """The options of one call of a linear head, as every layer below the public ops takes them.

    Attributes:
      weight_layout: ``"vd"`` (weight ``[V, D]``) or ``"dv"`` (``[D, V]``).
      temperature: the log-probs are of ``softmax((h·Wᵀ + b) / temperature)``.
      return_entropy: the entropy of each row's distribution too.
      vocab_axis: inside ``jax.shard_map``, the mesh axes splitting the vocabulary, or None.
      truncation: a sampler's truncation (``sampler_math.Truncation``), or None.
      batch_invariant: each row's results independent of the batch (dispatch's choice).
    """

    weight_layout: str = "vd"
    temperature: float = 1.0
    return_entropy: bool = False
    vocab_axis: AxisName | None = None
    truncation: Truncation | None = None
    batch_invariant: bool = False


def head_roles(k: int, weight_layout: str) -> tuple[str, str, str]:
    """The sharding roles of (hidden, weight, bias) with ``k`` row dimensions."""
    return "r" * k + "-", geometry.roles(weight_layout), "v"


def linear_head_op(
    stats,
    backward,
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    call: HeadCall,
    *,
    n_kept=0,
    logits_of=None,
    find_kept=None,
):
    """``(logp, entropy | None)`` of a linear head as an :mod:`engine` op, from its halves on
    one device's flat rows:

    ``stats(plan, h [N, D], weight, bias, t_local [N], valid [N]) -> ((m, s[, a]), t_rel,
    *kept)``: this device's row statistics (the module docstring), and ``n_kept`` residuals
    ``[N, V_local]`` (the logits, for ``memory="fast"``);
    ``backward(h, weight, bias, *kept, t_local, lse, entropy, g, g_ent[, floor=]) ->
    (d_hidden, d_weight, d_bias | None)``, with no gradient on inactive rows
    (:func:`backward_rows`); d_hidden float32, rounded after its sum over a vocabulary split
    (``engine.vjp``).

    ``truncation`` (a ``sampler_math.Truncation``): the log-probs and entropy of the
    sampler's processed distribution, each row's kept set found by ``find_kept`` (the
    ``kept_set`` primitive) on ``logits_of(h, weight, bias, *kept, t_local=)``, a ``kept_set.Logits``
    (default: the head's float32 logits, recomputed: ``vocab_chunks.linear_chunk`` /
    ``linear_rows``); the backward gets the kept set's lse and entropy and its ``floor``.
    Returns ``(logp, entropy | None, inside)`` then, ``inside`` whether each row's target is
    in its kept set.

    ``targets`` [..., K] (as many dimensions as ``hidden``, ``row_valid`` per id): K ids per
    row, see :func:`_linear_ids_op` (``call.temperature``: the one ``stats`` divides by)."""
    weight_layout, with_entropy = call.weight_layout, call.return_entropy
    temperature, truncation = call.temperature, call.truncation
    if targets.ndim == hidden.ndim:
        if truncation is not None:
            raise ValueError("top_k, top_p and min_p take one target per position, not K ids")
        return _linear_ids_op(
            stats, backward, hidden, weight, bias, targets, row_valid, call, n_kept=n_kept
        )
    if targets.ndim == 0:  # one row
        return logprob_core.first_row(
            linear_head_op(
                stats,
                backward,
                hidden[None],
                weight,
                bias,
                targets[None],
                row_valid[None],
                call,
                n_kept=n_kept,
                logits_of=logits_of,
                find_kept=find_kept,
            )
        )
    rows = "r" * targets.ndim
    n_out = 2 if with_entropy else 1
    truncated = truncation is not None
    if logits_of is None:

        def logits_of(h, w, b, *kept, t_local=None):
            del t_local
            return kept_set.Logits(
                vocab_chunks.linear_chunk(h, w, b, weight_layout, temperature),
                vocab_chunks.linear_rows(h, w, b, weight_layout, temperature),
            )

    def local_forward(plan, h, w, b, t, valid):
        local_vocab = geometry.vocab_size(w, weight_layout)
        t_local = t - plan.vocab_offset(local_vocab)
        if truncated and logprob_core.stats_from_kept_set(plan, find_kept, n_kept):
            return logprob_core.finished_truncated(
                plan,
                None,
                None,
                t_local,
                local_vocab,
                valid,
                n_out,
                with_entropy,
                truncation,
                logits_of(h, w, b),
                lambda x: varying_like(x, h, w, b),
                find_kept,
            )
        stats_, t_rel, *kept = stats(plan, h, w, b, t_local, valid)
        if truncated:
            return logprob_core.finished_truncated(
                plan,
                stats_,
                t_rel,
                t_local,
                local_vocab,
                valid,
                n_out,
                with_entropy,
                truncation,
                logits_of(h, w, b, *kept, t_local=t_local),
                lambda x: varying_like(x, h, w, b),
                find_kept,
            ) + tuple(kept)
        return logprob_core.finished(
            plan, stats_, t_rel, t_local, local_vocab, valid, n_out, with_entropy
        ) + tuple(kept)

    def local_backward(plan, h, w, b, t, _valid, *rest):
        lse, ent, active, rest = logprob_core.row_residuals(rest, with_entropy)
        floor, rest = (rest[0], rest[1:]) if truncated else (None, rest)
        kept, (g, *g_ent) = rest[:n_kept], rest[n_kept:]
        t_local, lse, ent, g, g_ent = logprob_core.backward_rows(
            plan,
            geometry.vocab_size(w, weight_layout),
            t,
            lse,
            ent,
            active,
            g,
            g_ent[0] if with_entropy else None,
        )
        extra = dict(floor=floor) if truncated else {}
        return backward(h, w, b, *kept, t_local, lse, ent, g, g_ent, **extra)

    out_roles = (rows,) * (n_out + truncated)
    res_roles = (rows,) * (n_out + 1 + truncated) + (rows + "v",) * n_kept
    outs = vjp.differentiable(
        local_forward,
        local_backward,
        (hidden, weight, bias, targets, row_valid),
        head_roles(targets.ndim, weight_layout) + (rows, rows),
        out_roles,
        res_roles,
        diff=(0, 1, 2),
        vocab_axis=call.vocab_axis,
        # batch-invariant: every row as it is (each row's results are its own by construction)
        keep_at=None if call.batch_invariant else 4,
        pieces=vjp.head_grad_pieces(),
    )
    entropy = outs[1] if with_entropy else None
    return (outs[0], entropy, outs[n_out]) if truncated else (outs[0], entropy)


def _linear_ids_op(stats, backward, hidden, weight, bias, ids, id_valid, call: HeadCall, *, n_kept):
    """:func:`linear_head_op` with K ids per row: ``(logp [..., K], entropy [...] | None)``.

    One statistics pass per row (``stats`` with no target), the K logits at the ids from
    ``head_ids.id_logits``; the backward is the halves' ``backward`` with the ids [N, K] as
    targets and their cotangents [N, K] (``head_ids.split_targets``). A row counts (entropy,
    gradient) when one of its ids is valid; an invalid id gives 0 and no gradient, an id
    outside ``[0, V)`` NaN."""
    weight_layout, with_entropy = call.weight_layout, call.return_entropy
    if ids.ndim == 1:  # one row
        return logprob_core.first_row(
            _linear_ids_op(
                stats,
                backward,
                hidden[None],
                weight,
                bias,
                ids[None],
                id_valid[None],
                call,
                n_kept=n_kept,
            )
        )
    rows = "r" * (ids.ndim - 1)
    n_out = 2 if with_entropy else 1
    opts = dict(weight_layout=weight_layout, temperature=call.temperature)

    def local_ids(plan, w, i):
        local_vocab = geometry.vocab_size(w, weight_layout)
        i = plan.local_ids(i, local_vocab)
        return i, (i >= 0) & (i < local_vocab)

    def local_forward(plan, h, w, b, i, valid):
        i, holds = local_ids(plan, w, i)
        row_valid = jnp.any(valid, axis=-1)
        no_target = jnp.full(row_valid.shape, -1, jnp.int32)
        stats_, _, *kept = stats(plan, h, w, b, no_target, row_valid)
        stats_, _, _ = softmax_math.combine_vocab_shards(
            stats_,
            jnp.zeros(row_valid.shape, jnp.float32),
            jnp.zeros(row_valid.shape, bool),
            plan.vocab_axes,
        )
        z = head_ids.id_logits(h, w, b, i, holds, **opts)
        holders = holds.astype(jnp.int32)
        if plan.vocab_axes:
            z, holders = jax.lax.psum((z, holders), plan.vocab_axes)
        log_s = jnp.log(stats_[1])
        lse = stats_[0] + log_s
        in_range = holders == 1
        logp = jnp.where(
            valid, jnp.where(in_range, (z - stats_[0][:, None]) - log_s[:, None], jnp.nan), 0.0
        )
        outs = (logp,)
        if with_entropy:
            outs += (jnp.where(row_valid, log_s - stats_[2] / stats_[1], 0.0),)
        return outs + (lse,) + outs[1:] + (row_valid, valid & in_range) + tuple(kept)

    def local_backward(plan, h, w, b, i, _valid, *rest):
        lse, ent, row_valid, rest = logprob_core.row_residuals(rest, with_entropy)
        active, kept, (g, *g_ent) = rest[0], rest[1 : 1 + n_kept], rest[1 + n_kept :]
        g = jnp.where(active, g.astype(jnp.float32), 0.0)
        lse = jnp.where(row_valid, lse, jnp.inf)
        g_ent = jnp.where(row_valid, g_ent[0].astype(jnp.float32), 0.0) if with_entropy else None
        ent = jnp.where(row_valid, ent, 0.0) if with_entropy else None
        i, holds = local_ids(plan, w, i)
        return backward(h, w, b, *kept, jnp.where(holds, i, -1), lse, ent, g, g_ent)

    outs = vjp.differentiable(
        local_forward,
        local_backward,
        (hidden, weight, bias, ids, id_valid),
        head_roles(ids.ndim - 1, weight_layout) + (rows + "-", rows + "-"),
        (rows + "-",) + (rows,) * (n_out - 1),
        (rows,) * n_out + (rows, rows + "-") + (rows + "v",) * n_kept,
        diff=(0, 1, 2),
        vocab_axis=call.vocab_axis,
        pieces=vjp.head_grad_pieces(),
    )
    return outs[0], (outs[1] if with_entropy else None)


def linear_from_parts(
    parts,
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    call: HeadCall,
    *,
    backward=None,
    find_kept=None,
):
    """``(logp, entropy | None)`` of ``hidden @ Wᵀ + bias`` without materialising the logits
    (``truncation``: ``(logp, entropy | None, inside)``, see :func:`linear_head_op`).

    ``backward``: where ``parts.backward`` is None (``ffi``), the standalone backward as a
    thunk ``() -> backward function`` (``contract.Choice.backward``), called when the
    backward pass is traced.
    """
    weight_layout, temperature = call.weight_layout, call.temperature
    return_entropy, truncation = call.return_entropy, call.truncation
    if isinstance(parts, Whole):
        n_rows = hidden.ndim - 1
        return logprob_core.whole(
            parts,
            (hidden, weight, bias),
            head_roles(n_rows, weight_layout),
            targets,
            row_valid,
            2 if return_entropy else 1,
            call.vocab_axis,
            n_row_dims=n_rows,
            truncation=truncation,
            weight_layout=weight_layout,
            temperature=temperature,
            return_entropy=return_entropy,
        )
    options = dict(weight_layout=weight_layout, temperature=temperature)

    def stats(plan, h, w, b, t_local, valid):
        m, s, a, t_rel = sharding.kernel_region(
            lambda h, w, b, t, v: parts.stats(
                h, w, b, t, v, with_entropy=return_entropy, **options
            ),
            h,
            w,
            b,
            t_local,
            valid,
        )
        return (m, s) + ((a,) if return_entropy else ()), t_rel

    def local_backward(*args, floor=None):
        backward_fn = parts.backward or backward()
        if floor is None:
            return sharding.kernel_region(lambda *a: backward_fn(*a, **options), *args)
        return sharding.kernel_region(
            lambda f, *a: backward_fn(*a, floor=f, **options), floor, *args
        )

    return linear_head_op(
        stats, local_backward, hidden, weight, bias, targets, row_valid, call, find_kept=find_kept
    )


def head_backward(
    local_backward,
    hidden,
    weight,
    bias,
    kept,
    targets,
    lse,
    entropy,
    active,
    row_valid,
    g,
    g_ent,
    call: HeadCall,
    *,
    whole_kept: bool = False,
):
    """(d_hidden, d_weight, d_bias | None) of a linear head from per-token cotangents, each
    shaped, sharded and typed like its operand: the backward half of an op whose custom_vjp
    is not the engine's own (the fused losses).

    Per device, ``local_backward(h [N, D], weight, bias, *kept [N, V_local], t_local, lse,
    entropy, g, g_ent)`` gets flat rows as :func:`linear_head_op`'s backward does; ``kept``
    are residuals laid out like the logits (in ``row_skip``'s kept-first order of
    ``row_valid``, as the forward left them), all their rows in each branch if ``whole_kept``."""
    weight_layout = call.weight_layout
    rows = "r" * targets.ndim
    roles = head_roles(targets.ndim, weight_layout)
    present = (0, 1) + ((2,) if bias is not None else ())

    def local(plan, h, w, b, *rest):
        kept_l, (t, lse, ent, active, _valid, g, g_ent) = rest[:-7], rest[-7:]
        g, g_ent = (collectives.output_cotangent(plan, c, w) for c in (g, g_ent))
        t_local, lse, ent, g, g_ent = logprob_core.backward_rows(
            plan, geometry.vocab_size(w, weight_layout), t, lse, ent, active, g, g_ent
        )
        return local_backward(h, w, b, *kept_l, t_local, lse, ent, g, g_ent)

    operands = (hidden, weight, bias) + tuple(kept)
    operands += (targets, lse, entropy, active, row_valid, g, g_ent)
    grads = vjp.stage(
        local,
        operands,
        roles + (rows + "v",) * len(kept) + (rows,) * 7,
        tuple(roles[i] for i in present),
        grads_of=present,
        vocab_axis=call.vocab_axis,
        keep_at=len(operands) - 3,
        whole=tuple(range(3, 3 + len(kept))) if whole_kept else (),
        pieces=vjp.head_grad_pieces(),
    )
    dh, dw = grads[0].astype(hidden.dtype), grads[1].astype(weight.dtype)
    return dh, dw, (grads[2].astype(bias.dtype) if bias is not None else None)
