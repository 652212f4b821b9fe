"""A linear head's backward in vocabulary pieces, each piece's head cotangent summed on its own.

Under a rows split (data parallel: each device holds some rows and the whole head, or an
FSDP shard of it) a device's backward makes its whole ``d_weight`` [V, D] (and ``d_bias``)
and only then sums it over the devices (``collectives.finish_cotangent``: an all-reduce, or a
reduce-scatter for an FSDP head), with nothing left to run beside that collective. In
``P`` pieces, the step runs ``P`` times on consecutive parts of this device's vocabulary
slice (the head's rows ``[p·V/P, (p+1)·V/P)``, the kept logits' columns likewise; the row
statistics are the forward's, over the whole vocabulary), each piece's ``d_weight`` /
``d_bias`` summed across devices by its own collective as soon as it is made, and
``d_hidden`` the float32 sum of the pieces' shares, rounded once after it as before.
XLA's scheduler may then run piece ``p``'s collective while piece ``p + 1``'s GEMMs run.

A piece is a vocabulary slice with an offset (``Placement.piece``, ``Placement.local_ids``).
Where the head's cotangent is scattered over its vocabulary (an FSDP head split on V), piece
``p`` is part ``p`` of each device's final block, so that the pieces' reduce-scatters
together give each device its block. ``V / P`` need not be whole: pieces start on multiples
of 128 ids (else 8, else 1: :func:`piece_bounds`) and the last takes the rest.

The number of pieces is an option (:func:`head_grad_pieces`, ``JAXRL_KERNELS_HEAD_GRAD_PIECES``),
read when a linear-head op is traced; 1 (the default) is one backward call, as before. It
applies only where the head's cotangent is summed across devices (rows split); elsewhere the
step runs once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Iterator

import numpy as np
from jax import lax

from jaxrl_kernels.sharding import collectives
from jaxrl_kernels.sharding.placement import Placement, VocabPiece, axes_of_entry, padded
from jaxrl_kernels.sharding.vma import varying_axes

ENV_VAR = "JAXRL_KERNELS_HEAD_GRAD_PIECES"

_scoped: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jaxrl_kernels_head_grad_pieces", default=None
)


def check(pieces, what: str = "pieces") -> int:
    """``pieces`` as an int >= 1, else a ``ValueError`` whose message starts with ``what``."""
    if isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer)) or pieces < 1:
        raise ValueError(f"{what}: expected an int >= 1 (vocabulary pieces), got {pieces!r}")
    return int(pieces)


def requested_with_source() -> tuple[int, str]:
    """The pieces in force and where they came from: the innermost :func:`head_grad_pieces`
    scope (``"jk.head_grad_pieces"``), else the variable ``JAXRL_KERNELS_HEAD_GRAD_PIECES``
    (its name), else 1 (``"default"``)."""
    scoped = _scoped.get()
    if scoped is not None:
        return scoped, "jk.head_grad_pieces"
    env = os.environ.get(ENV_VAR, "").strip()
    if not env:
        return 1, "default"
    return check(int(env) if env.isdecimal() else env, ENV_VAR), ENV_VAR


def requested() -> int:
    """The pieces in force (:func:`requested_with_source`)."""
    return requested_with_source()[0]


@contextlib.contextmanager
def head_grad_pieces(pieces: int | None) -> Iterator[None]:
    """Within this scope, the linear-head ops' backward runs in ``pieces`` vocabulary pieces
    where rows are split across devices (docs/api.md, "The head's gradient in pieces").

    Each piece's ``d_weight`` / ``d_bias`` is summed across devices by its own collective as
    soon as it is made, so that XLA may overlap it with the next piece's GEMMs; values and
    gradients are those of one piece up to float32 rounding. Read when an op is traced (as
    ``jk.memory_mode``). ``None``: as outside every scope (``JAXRL_KERNELS_HEAD_GRAD_PIECES``,
    else 1).

    Args:
      pieces: an int >= 1, or None. Anything else is a ``ValueError`` on entry.

    Returns:
      A context manager.

    Example:
      >>> import jaxrl_kernels as jk
      >>> with jk.head_grad_pieces(4):
      ...     pass  # ops traced here split their backward in 4 where rows are split
      >>> with jk.head_grad_pieces(0):
      ...     pass
      Traceback (most recent call last):
      ...
      ValueError: ...
    """
    token = _scoped.set(None if pieces is None else check(pieces))
    try:
        yield
    finally:
        _scoped.reset(token)


# -- the step in pieces -----------------------------------------------------------------------


def _vocab_dim(role: str) -> int:
    return role.index("v")


def _scattered(plan: Placement, role: str, want) -> int:
    """Over how many devices the cotangent of an operand with ``role`` leaves split on V."""
    if want is None:
        return 1
    dim = _vocab_dim(role)
    have, wanted = padded(plan.spec(role), len(role))[dim], padded(want, len(role))[dim]
    if have == wanted:
        return 1
    return math.prod(lax.axis_size(a) for a in axes_of_entry(wanted))


def _summed(plan: Placement, operands, roles, js) -> bool:
    """Whether the cotangents of the operands at ``js`` are summed across devices."""
    if plan.manual:
        rows = frozenset().union(
            *(varying_axes(x) for x, r in zip(operands, roles) if x is not None and "r" in r)
        )
        return any(rows - varying_axes(operands[j]) for j in js)
    return any(plan.work_axes - plan.axes_of(roles[j]) for j in js)


def plan_pieces(plan, operands, roles, grads_of, wants, pieces: int) -> list[VocabPiece] | None:
    """The pieces of a backward step, or None where it runs once (one piece asked for,
    an output that is not a cotangent, no head cotangent summed across devices)."""
    if pieces <= 1 or plan.piece is not None or any(j is None for j in grads_of):
        return None
    js = [j for j in grads_of if "v" in roles[j] and operands[j] is not None]
    if not js or not _summed(plan, operands, roles, js):
        return None
    local_vocab = operands[js[0]].shape[_vocab_dim(roles[js[0]])]
    counts = [_scattered(plan, roles[j], None if wants is None else wants[j]) for j in js]
    blocks = max(counts)
    if any(blocks % c for c in counts) or local_vocab % blocks:
        return None
    block = local_vocab // blocks
    n = min(pieces, block)
    if n <= 1:
        return None
    bounds = piece_bounds(block, n)
    return [VocabPiece(a, b, block, blocks) for a, b in zip(bounds[:-1], bounds[1:])]


ALIGN = (128, 8)
"""A piece starts at a multiple of the first of these that leaves every piece at least that
many ids (a kernel's vocabulary tile; TMA's 16-byte strides of a "dv" slice), else anywhere."""


def piece_bounds(block: int, n: int) -> list[int]:
    """Where ``n`` pieces of a block of ``block`` ids start, then ``block``: as equal as
    :data:`ALIGN` allows (the last piece takes the rest)."""
    q = next((a for a in ALIGN if block >= a * n), 1)
    return [p * block // (n * q) * q for p in range(n)] + [block]


def _slice(x, dim: int, piece: VocabPiece):
    """The piece of ``x``'s vocabulary dimension ``dim``."""
    if piece.blocks == 1:
        return lax.slice_in_dim(x, piece.start, piece.stop, axis=dim)
    shape = x.shape[:dim] + (piece.blocks, piece.block) + x.shape[dim + 1 :]
    part = lax.slice_in_dim(x.reshape(shape), piece.start, piece.stop, axis=dim + 1)
    return part.reshape(x.shape[:dim] + (piece.size,) + x.shape[dim + 1 :])


def _joined(parts, dim: int, pieces: list[VocabPiece]):
    """The pieces' finished cotangents as one: each holds ``m`` of its piece's blocks."""
    m = parts[0].shape[dim] // (pieces[0].stop - pieces[0].start)
    if m == 1:
        return lax.concatenate(parts, dim)
    split = [y.reshape(y.shape[:dim] + (m, -1) + y.shape[dim + 1 :]) for y in parts]
    whole = lax.concatenate(split, dim + 1)
    return whole.reshape(whole.shape[:dim] + (-1,) + whole.shape[dim + 2 :])


def run(local_fn, plan, operands, roles, grads_of, wants, pieces: list[VocabPiece]) -> tuple:
    """A backward step's cotangents, finished (``collectives.finish_cotangent``), from
    ``local_fn`` run once per piece: each head cotangent finished piece by piece, the others
    summed over the pieces (in float32, as a backward returns ``d_hidden``) then finished.

    Piece ``p + 1``'s head cotangents enter their collective together with piece ``p``'s
    finished ones (``lax.optimization_barrier``): the collectives run one after the other, each
    free to overlap the next piece's GEMMs, and XLA's collective combiners cannot merge them
    into one collective after the last piece (on CPU they did)."""
    want = [None if wants is None else wants[j] for j in grads_of]
    heads = [i for i, j in enumerate(grads_of) if "v" in roles[j]]
    head_parts: dict[int, list] = {i: [] for i in heads}
    sums: dict[int, object] = {}
    for piece in pieces:
        plan_p = dataclasses.replace(plan, piece=piece)
        ops = [
            x if x is None or "v" not in r else _slice(x, _vocab_dim(r), piece)
            for x, r in zip(operands, roles)
        ]
        outs = [y for y in local_fn(plan_p, *ops) if y is not None]
        raw = [outs[i] for i in heads]
        if head_parts[heads[0]]:
            last = [head_parts[i][-1] for i in heads]
            last, raw = lax.optimization_barrier((last, raw))
            for i, y in zip(heads, last):
                head_parts[i][-1] = y
        for i, y in zip(heads, raw):
            j = grads_of[i]
            head_parts[i].append(collectives.finish_cotangent(plan, y, ops[j], roles[j], want[i]))
        for i, (y, j) in enumerate(zip(outs, grads_of)):
            if i not in head_parts:
                sums[i] = y if i not in sums else sums[i] + y
    out = []
    for i, j in enumerate(grads_of):
        if i in head_parts:
            out.append(_joined(head_parts[i], _vocab_dim(roles[j]), pieces))
        else:
            out.append(collectives.finish_cotangent(plan, sums[i], operands[j], roles[j], want[i]))
    return tuple(out)
