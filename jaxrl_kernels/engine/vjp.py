"""The linear-head VJP engine: a per-device forward and backward made one differentiable,
sharded op.

Every op of this package that holds no ``[N, V]`` logits across devices (log-probs lean and
fast, the fused losses, distillation, top-k) is written as two functions on one device's
data, with rows flattened to ``[N, ...]``::

    forward(plan, *operands)                      -> (*outputs, *residuals)
    backward(plan, *operands, *residuals, *cts)   -> one cotangent per differentiable operand

and a role per operand, output and residual (``sharding``: ``r`` a row dimension, ``v`` the
vocabulary, ``-`` anything else). :func:`differentiable` does the rest once for all of them:

* where the work runs (``sharding.run``: inside ``jax.shard_map``, Explicit or Auto mesh axes),
  the layout noted for ``explain``;
* the rows: every operand's leading ``r`` dimensions are flattened into one before the
  per-device function sees it, and outputs, residuals and cotangents get them back;
* the ``custom_vjp``: residuals saved, the cotangent of an output replicated over a vocabulary
  split taken whole (``Placement.output_cotangent``), integer outputs' cotangents dropped
  (``None``), each operand's cotangent summed over the devices that shared it, sharded like the
  operand and cast to its dtype; operands outside ``diff`` get none.

A backward returns ``d_hidden`` in float32, unrounded, on every backend and in both memory
modes: under a vocabulary split each device holds a partial sum over its slice, and the sum
over devices is then a float32 ``psum`` (or reduce-scatter), rounded once to hidden's dtype
after it. Rounded before, each device's share and each hop of the sum would add a rounding
of a 16-bit dtype, an error that grows with the number of devices.

``plan`` (a ``placement.Placement``) gives the vocabulary axes and this device's vocabulary
offset; cross-device statistics inside ``forward`` use them (``softmax_math``).
:func:`stage` is the ``sharding.run`` step alone, for an op with work between two per-device
steps (the fused losses' loss function, over every row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax

from jaxrl_kernels import sharding
from jaxrl_kernels.dispatch import trace_log
from jaxrl_kernels.engine import row_skip
from jaxrl_kernels.sharding import collectives, vocab_pieces


def rows_of(role: str) -> int:
    """How many leading row dimensions a role has."""
    return len(role) - len(role.lstrip("r"))


def flat_rows(x, n_row_dims: int):
    """``x`` [*rows, ...] as [N, ...] (``N`` the product of its ``n_row_dims`` leading dims;
    ``x`` itself for none, or for None)."""
    if x is None or n_row_dims == 0:
        return x
    return x.reshape((math.prod(x.shape[:n_row_dims]),) + x.shape[n_row_dims:])


def _flatten(x, role):
    return flat_rows(x, rows_of(role))


def _unflatten(x, role, lead):
    if x is None or rows_of(role) == 0:
        return x
    return x.reshape(tuple(lead) + x.shape[1:])


def stage(
    local: Callable[..., tuple],
    operands: Sequence,
    roles: Sequence[str],
    out_roles: Sequence[str],
    *,
    grads_of: Sequence[int | None] | None = None,
    vocab_axis=None,
    note: bool = False,
    keep_at: int | None = None,
    whole: Sequence[int] = (),
    pieces: int = 1,
) -> tuple:
    """``local(plan, *operands)`` on flat rows, run where the operands live.

    ``keep_at``: the operand that flags each row kept (``row_valid``): the others cost no
    work and give 0 (``row_skip``; ``whole``: operands a branch gets with all their rows,
    ``row_skip.call``).

    Operands and outputs with leading ``r`` dimensions are flattened / restored around
    ``local``; an output that is the cotangent of operand ``j`` (``grads_of``) gets that
    operand's local shape back. ``local`` may return None for an absent output (a bias's
    cotangent); ``out_roles`` lists the present ones. ``note``: note how the step is
    laid out on the devices for ``explain`` (a forward's first step). ``pieces``: a backward
    step in that many vocabulary pieces, each piece's ``v`` cotangents summed across devices on
    their own (``sharding.vocab_pieces``; ``local`` then gets a piece's ``v`` operands and a
    ``plan`` whose ``local_ids`` maps ids into the piece)."""
    grads_of = tuple(grads_of) if grads_of is not None else (None,) * len(out_roles)
    lead_of = next(
        i for i, (x, r) in enumerate(zip(operands, roles)) if x is not None and rows_of(r)
    )

    def flat_local(plan, *ops):
        lead = ops[lead_of].shape[: rows_of(roles[lead_of])]
        flat = [_flatten(x, r) for x, r in zip(ops, roles)]
        if keep_at is None:
            outs = [y for y in local(plan, *flat) if y is not None]
        else:
            outs = row_skip.call(
                local,
                plan,
                flat,
                roles,
                out_roles,
                flat[keep_at],
                whole=tuple(whole),
            )
        return tuple(
            y.reshape(ops[j].shape) if j is not None else _unflatten(y, r, lead)
            for y, r, j in zip(outs, out_roles, grads_of)
        )

    return sharding.run(
        flat_local,
        tuple(operands),
        tuple(roles),
        tuple(out_roles),
        grads_of=grads_of,
        vocab_axis=vocab_axis,
        record=note_layout if note else None,
        pieces=pieces,
    )


def note_layout(plan) -> None:
    """Note how a step is laid out on the devices, for ``explain`` (``sharding.run``'s
    ``record``)."""
    trace_log.note("layout", plan.describe())


def differentiable(
    forward: Callable[..., tuple],
    backward: Callable[..., tuple],
    operands: Sequence,
    roles: Sequence[str],
    out_roles: Sequence[str],
    res_roles: Sequence[str],
    *,
    diff: Sequence[int],
    unused: Sequence[int] = (),
    vocab_axis=None,
    keep_at: int | None = None,
    pieces: int = 1,
) -> tuple:
    """The outputs of the op ``forward`` / ``backward`` on ``operands`` (see the module
    docstring), differentiable in the operands at positions ``diff``.

    ``forward`` returns its outputs (roles ``out_roles``) then its residuals (``res_roles``),
    none of them None; ``backward`` gets the operands, the residuals and one cotangent per
    output (None for an integer output), and returns the cotangents of ``operands[i]`` for
    ``i`` in ``diff``, in that order (None for an absent operand). ``unused``: operands the
    backward does not read (it gets None), which are then not kept for it. ``keep_at``:
    as :func:`stage`'s, for both halves (the operand must not be unused). ``pieces``: the
    backward's, as :func:`stage`'s (the forward runs whole)."""
    operands, roles = tuple(operands), tuple(roles)
    out_roles, res_roles, diff = tuple(out_roles), tuple(res_roles), tuple(diff)
    n_out, n_ops = len(out_roles), len(operands)
    assert not set(diff) & set(unused), "a differentiable operand marked unused"
    vocab_at = next((i for i, r in enumerate(roles) if "v" in r), None)

    def run_forward(ops):
        outs = stage(
            forward,
            ops,
            roles,
            out_roles + res_roles,
            vocab_axis=vocab_axis,
            note=True,
            keep_at=keep_at,
        )
        return outs[:n_out], outs[n_out:]

    @jax.custom_vjp
    def op(*ops):
        return run_forward(ops)[0]

    def fwd(*ops):
        outs, res = run_forward(ops)
        kept = tuple(None if i in unused else x for i, x in enumerate(ops))
        return outs, (kept, res)

    def bwd(saved, cts):
        ops, res = saved
        cts = tuple(None if c is None or c.dtype == jax.dtypes.float0 else c for c in cts)
        present = tuple(i for i in diff if ops[i] is not None)

        def local(plan, *args):
            n_in = n_ops + len(res)
            ops_l, res_l, cts_l = args[:n_ops], args[n_ops:n_in], args[n_in:]
            vocab_operand = None if vocab_at is None else ops_l[vocab_at]
            cts_l = tuple(
                c if "v" in r else collectives.output_cotangent(plan, c, vocab_operand)
                for c, r in zip(cts_l, out_roles)
            )
            grads = dict(zip(diff, backward(plan, *ops_l, *res_l, *cts_l)))
            return tuple(grads[i] for i in present)

        grads = stage(
            local,
            ops + res + cts,
            roles + res_roles + out_roles,
            tuple(roles[i] for i in present),
            grads_of=present,
            vocab_axis=vocab_axis,
            keep_at=keep_at,
            pieces=pieces,
        )
        by_position = dict(zip(present, grads))
        return tuple(
            by_position[i].astype(ops[i].dtype) if i in by_position else None for i in range(n_ops)
        )

    op.defvjp(fwd, bwd)
    return op(*operands)


def head_grad_pieces() -> int:
    """The vocabulary pieces of a linear head's backward in force
    (``sharding.vocab_pieces.requested``), noted for ``explain`` where there are several."""
    pieces, source = vocab_pieces.requested_with_source()
    if pieces > 1:
        trace_log.note(
            "pieces",
            f"the head's gradient in {pieces} vocabulary pieces where rows are split across "
            f"devices ({source})",
        )
    return pieces
