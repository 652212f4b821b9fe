"""The collectives of a call's cotangents: what crosses devices on the way back.

Given a call's :class:`~jaxrl_kernels.sharding.placement.Placement`, an output replicated
over the vocabulary axes has its cotangent taken whole (:func:`output_cotangent`), and each
operand's cotangent is summed over the devices that shared the operand and laid out to come
back sharded like it (:func:`finish_cotangent`: ``psum``, ``psum_scatter`` or a slice).
"""

from __future__ import annotations

import math

from jax import lax
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.sharding.placement import Placement, axes_of_entry, padded, spec_entry
from jaxrl_kernels.sharding.vma import has_vma, varying_axes


def output_cotangent(plan: Placement, g, vocab_operand):
    """The cotangent of an output that is replicated over the vocabulary axes.

    In a user's ``shard_map(check_vma=False)`` jax hands each device a share of it (the
    shares sum to the cotangent, as for the transpose of a psum); with varying-axes types
    (``check_vma=True``, or any plan of ours) it arrives whole."""
    if (
        g is None
        or not plan.manual
        or not plan.vocab_axes
        or frozenset(plan.vocab_axes) <= varying_axes(vocab_operand)
    ):
        return g
    return lax.psum(g, plan.vocab_axes)


def finish_cotangent(plan: Placement, d_operand, operand, roles: str, want: P | None = None):
    """The cotangent of ``operand`` on this device from this device's share of it.

    In a user's ``shard_map`` the shares are summed over the axes they vary over and the
    operand does not (or, with ``check_vma=False``, over the vocabulary axes). Otherwise
    ``d_operand`` is laid out as :meth:`Placement.spec` says for ``roles`` and is summed over the
    axes the work was split over but that layout is not; ``want`` (see :func:`grad_spec`)
    may also split a dimension the plan keeps whole: over axes being summed, that is one
    ``psum_scatter`` (a reduce-scatter instead of an all-reduce); over others, a slice."""
    if d_operand is None:
        return None
    if plan.manual:
        axes = varying_axes(d_operand) - varying_axes(operand)
        if not has_vma(d_operand) and "v" not in roles:
            axes = frozenset(plan.vocab_axes)  # check_vma=False: only what we know
        return lax.psum(d_operand, tuple(sorted(axes))) if axes else d_operand
    have = padded(plan.spec(roles), len(roles))
    want = have if want is None else padded(want, len(roles))
    pending = set(plan.work_axes - plan.axes_of(roles))
    slices = []
    for dim, (h, w) in enumerate(zip(have, want)):
        if h == w:
            continue
        axes = axes_of_entry(w)  # grad_spec: h is None here, w's axes unused by the plan's layout
        if set(axes) <= pending:
            d_operand = lax.psum_scatter(
                d_operand, spec_entry(axes), scatter_dimension=dim, tiled=True
            )
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
