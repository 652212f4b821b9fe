"""Where one call's work sits on the mesh: a :class:`Placement` of its rows and vocabulary.

``sharding.run`` describes every operand dimension by a role (``r`` a row dimension, ``v``
the vocabulary, ``-`` anything else). From the operands' ``PartitionSpec`` s,
:func:`placement_from_specs` decides which mesh axes split each row dimension and which split
the vocabulary; the :class:`Placement` then gives every operand's layout (``spec``), this
device's first vocabulary id, and how a cotangent computed from this device's share is summed
and laid out to come back sharded like its operand (``finish_cotangent``). Also here: the
varying-manual-axes (vma) types jax gives values inside ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
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
class Placement:
    """Which mesh axes split the rows (per row dimension) and the vocabulary of one call."""

    row_axes: tuple[Axes, ...]
    vocab_axes: Axes = ()
    manual: bool = False  # inside a user's shard_map: cotangent sums follow the vma types
    how: str = "one device"

    @staticmethod
    def single(n_row_dims: int) -> "Placement":
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

    def output_cotangent(self, g, vocab_operand):
        """The cotangent of an output that is replicated over the vocabulary axes.

        In a user's ``shard_map(check_vma=False)`` jax hands each device a share of it (the
        shares sum to the cotangent, as for the transpose of a psum); with varying-axes types
        (``check_vma=True``, or any plan of ours) it arrives whole."""
        if (g is None or not self.manual or not self.vocab_axes
                or frozenset(self.vocab_axes) <= varying_axes(vocab_operand)):
            return g
        return lax.psum(g, self.vocab_axes)

    def finish_cotangent(self, d_operand, operand, roles: str, want: P | None = None):
        """The cotangent of ``operand`` on this device from this device's share of it.

        In a user's ``shard_map`` the shares are summed over the axes they vary over and the
        operand does not (or, with ``check_vma=False``, over the vocabulary axes). Otherwise
        ``d_operand`` is laid out as :meth:`spec` says for ``roles`` and is summed over the
        axes the work was split over but that layout is not; ``want`` (see :func:`grad_spec`)
        may also split a dimension the plan keeps whole: over axes being summed, that is one
        ``psum_scatter`` (a reduce-scatter instead of an all-reduce); over others, a slice."""
        if d_operand is None:
            return None
        if self.manual:
            axes = varying_axes(d_operand) - varying_axes(operand)
            if not has_vma(d_operand) and "v" not in roles:
                axes = frozenset(self.vocab_axes)  # check_vma=False: only what we know
            return lax.psum(d_operand, tuple(sorted(axes))) if axes else d_operand
        have = padded(self.spec(roles), len(roles))
        want = have if want is None else padded(want, len(roles))
        pending = set(self.work_axes - self.axes_of(roles))
        slices = []
        for dim, (h, w) in enumerate(zip(have, want)):
            if h == w:
                continue
            axes = axes_of_entry(w)  # grad_spec: h is None here, w's axes unused by the plan's layout
            if set(axes) <= pending:
                d_operand = lax.psum_scatter(d_operand, spec_entry(axes), scatter_dimension=dim,
                                             tiled=True)
                pending -= set(axes)
            else:
                slices.append((dim, axes))
        if pending:
            d_operand = lax.psum(d_operand, tuple(sorted(pending)))
        for dim, axes in slices:
            size = d_operand.shape[dim] // math.prod(lax.axis_size(a) for a in axes)
            start = lax.axis_index(spec_entry(axes)) * size
            d_operand = lax.dynamic_slice_in_dim(d_operand, start, size, axis=dim)
        return d_operand

    def describe(self) -> str:
        rows = ", ".join(f"dim {i}: {list(a)}" for i, a in enumerate(self.row_axes) if a)
        parts = [f"rows split over {rows}" if rows else "rows not split",
                 f"vocabulary split over {list(self.vocab_axes)} (vocabulary-parallel)"
                 if self.vocab_axes else "vocabulary whole on each device"]
        return f"{self.how}: " + "; ".join(parts)


def placement_from_specs(specs: Sequence[P | None], roles: Sequence[str], *,
                         how: str) -> Placement:
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
            axes = tuple(a for a in axes_of_entry(spec[dim] if dim < len(spec) else None)
                         if a not in used)
            if axes:
                row_axes[i] = axes
                used.update(axes)
                break
    vocab: Axes = ()
    for spec, role in zip(specs, roles):
        if spec is None or "v" not in role:
            continue
        dim = role.index("v")
        axes = tuple(a for a in axes_of_entry(spec[dim] if dim < len(spec) else None) if a not in used)
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


# -- the types jax gives values inside shard_map (vma: the manual axes a value varies over) ----

def has_vma(x) -> bool:
    aval = jax.typeof(x)
    return hasattr(aval, "vma") or hasattr(aval, "manual_axis_type")


def varying_axes(x) -> frozenset[str]:
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def cast_varying(x, axes: frozenset[str]):
    """``x`` typed as varying over ``axes`` too (inside a ``shard_map`` that checks them)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # jax < 0.12


def varying_like(init, *operands):
    """A loop's initial carry typed as varying over every manual axis the operands vary over
    (inside a ``shard_map`` that checks varying axes; a no-op elsewhere)."""
    axes = frozenset().union(*(varying_axes(x) for x in operands if x is not None))
    return jax.tree.map(lambda y: None if y is None else cast_varying(y, axes), init)
