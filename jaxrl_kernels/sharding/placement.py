"""Where one call's work sits on the mesh: a :class:`Placement` of its rows and vocabulary.

``sharding.run`` describes every operand dimension by a role (``r`` a row dimension, ``v``
the vocabulary, ``-`` anything else). From the operands' ``PartitionSpec`` s,
:func:`placement_from_specs` decides which mesh axes split each row dimension and which split
the vocabulary; the :class:`Placement` then gives every operand's layout (``spec``), the axes a
cotangent must be summed over, and this device's first vocabulary id. PartitionSpec algebra
only: the collectives that act on it are in :mod:`.collectives`, the varying-axes types in
:mod:`.vma`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]


def axes_of_entry(entry) -> Axes:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_entry(axes: Axes):
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


@dataclasses.dataclass(frozen=True)
class VocabPiece:
    """Part of this device's vocabulary slice, for a backward run in pieces
    (:mod:`.vocab_pieces`): the slice is ``blocks`` blocks of ``block`` ids, and the piece is
    ids ``[start, stop)`` of every block, in block order (one block unless the head's
    cotangent is scattered over the vocabulary, one block per device it is scattered to)."""

    start: int
    stop: int
    block: int
    blocks: int = 1

    @property
    def size(self) -> int:
        return self.blocks * (self.stop - self.start)

    def local_ids(self, ids):
        """Ids of the device's slice (``[0, block·blocks)``) as ids of the piece, -1 outside it."""
        within, which = ids % self.block, ids // self.block
        inside = (ids >= 0) & (ids < self.block * self.blocks)
        inside &= (within >= self.start) & (within < self.stop)
        mapped = which * (self.stop - self.start) + within - self.start
        return jnp.where(inside, mapped, -1).astype(ids.dtype)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which mesh axes split the rows (per row dimension) and the vocabulary of one call.

    ``piece``: a backward step run on part of this device's vocabulary slice
    (:mod:`.vocab_pieces`), or None for all of it. ``logits_rows``: a step run on the first
    rows of this device's (``engine.row_skip``) lays its results shaped like the logits out at
    this many rows, the rows past its own zero; a kernel that can write them so directly does
    (no padded copy of ``[N, V]``), None otherwise."""

    row_axes: tuple[Axes, ...]
    vocab_axes: Axes = ()
    manual: bool = False  # inside a user's shard_map: cotangent sums follow the vma types
    how: str = "one device"
    piece: VocabPiece | None = None
    logits_rows: int | None = None

    @staticmethod
    def single(n_row_dims: int) -> Placement:
        return Placement(row_axes=((),) * n_row_dims)

    @property
    def work_axes(self) -> frozenset[str]:
        """Every mesh axis the work is split over."""
        return frozenset(a for axes in self.row_axes for a in axes) | frozenset(self.vocab_axes)

    def spec(self, roles: str) -> P:
        """The PartitionSpec of an operand with these roles under this plan."""
        entries, row = [], 0
        for role in roles:
            if role == "r":
                entries.append(spec_entry(self.row_axes[row]))
                row += 1
            elif role == "v":
                entries.append(spec_entry(self.vocab_axes))
            else:
                entries.append(None)
        return P(*entries)

    def axes_of(self, roles: str) -> frozenset[str]:
        return frozenset(a for e in self.spec(roles) for a in axes_of_entry(e))

    def vocab_offset(self, local_vocab: int):
        """First global vocabulary id of this device's slice."""
        if not self.vocab_axes:
            return jnp.int32(0)
        return lax.axis_index(self.vocab_axes).astype(jnp.int32) * local_vocab

    def local_ids(self, ids, local_vocab: int):
        """Global vocabulary ids as ids of the operands this device's step holds
        (``local_vocab`` of them: its slice, or its piece of it, where an id outside is -1)."""
        if self.piece is None:
            return ids - self.vocab_offset(local_vocab)
        full = self.piece.block * self.piece.blocks
        return self.piece.local_ids(ids - self.vocab_offset(full))

    def describe(self) -> str:
        rows = ", ".join(f"dim {i}: {list(a)}" for i, a in enumerate(self.row_axes) if a)
        parts = [
            f"rows split over {rows}" if rows else "rows not split",
            f"vocabulary split over {list(self.vocab_axes)} (vocabulary-parallel)"
            if self.vocab_axes
            else "vocabulary whole on each device",
        ]
        return f"{self.how}: " + "; ".join(parts)


def placement_from_specs(specs: Sequence[P | None], roles: Sequence[str], *, how: str) -> Placement:
    """Rows follow the first operand that shards each row dimension; the vocabulary follows the
    first operand that shards it, minus any axis the rows already use."""
    n_rows = max((r.count("r") for r in roles), default=0)
    row_axes: list[Axes] = [()] * n_rows
    used: set[str] = set()
    for i in range(n_rows):
        for spec, role in zip(specs, roles):
            if spec is None or role.count("r") <= i:
                continue
            dim = [k for k, c in enumerate(role) if c == "r"][i]
            axes = tuple(
                a for a in axes_of_entry(spec[dim] if dim < len(spec) else None) if a not in used
            )
            if axes:
                row_axes[i] = axes
                used.update(axes)
                break
    vocab: Axes = ()
    for spec, role in zip(specs, roles):
        if spec is None or "v" not in role:
            continue
        dim = role.index("v")
        axes = tuple(
            a for a in axes_of_entry(spec[dim] if dim < len(spec) else None) if a not in used
        )
        if axes:
            vocab = axes
            break
    return Placement(row_axes=tuple(row_axes), vocab_axes=vocab, how=how)


def padded(spec, ndim: int) -> tuple:
    spec = tuple(spec) if spec is not None else ()
    return spec + (None,) * (ndim - len(spec))


def grad_spec(plan: Placement, roles: str, operand_spec: P | None) -> P:
    """The layout in which a cotangent leaves the per-device function: the plan's layout of
    its operand, plus every other dimension the operand itself splits (over axes the plan's
    layout does not use), so that it needs no further movement to be sharded like the operand.
    """
    have = padded(plan.spec(roles), len(roles))
    own = padded(operand_spec, len(roles))
    used = {a for e in have for a in axes_of_entry(e)}
    out = []
    for h, o in zip(have, own):
        axes = axes_of_entry(o)
        if h is None and axes and not used & set(axes):
            used.update(axes)
            out.append(o)
        else:
            out.append(h)
    return P(*out)
