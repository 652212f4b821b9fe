"""The types jax gives values inside ``shard_map``: the manual axes a value varies over (vma).

A loop carry or a kernel's output must be typed as varying over the same axes as the operands
it is combined with when ``shard_map`` checks them; these helpers read and set those types
(no-ops outside a ``shard_map``).
"""

from __future__ import annotations

import jax
from jax import lax


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
