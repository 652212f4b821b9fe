"""The ops' ``segment_ids`` / ``num_segments`` (packed rows, docs/api.md "Packed sequences"),
checked, and the per-sequence inputs that come with them.

``segment_ids`` ``[B, T]`` integers: sequence ``s`` is every position whose id is ``s``;
``-1`` is a position in no sequence, masked whatever ``mask`` says. ``S = num_segments`` is
static (a shape); where an ``[S]`` input (rewards, per-sequence advantages) is given, its
length gives it, and a ``num_segments`` given too must agree. Shapes and options are checked
at trace time; the ids themselves (inside ``[-1, S)``, each sequence in one row: a sequence
never spans rows) when concrete, and under tracing in check mode, as every data check
(:mod:`jaxrl_kernels.validation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import validation as check
from jaxrl_kernels.formulas import segment_math
from jaxrl_kernels.formulas.segment_math import Packing

__all__ = ["Packing", "packing", "mask", "token_advantages", "per_sequence", "max_len"]


def _count(num_segments: Any, sized: Mapping[str, Any]) -> int:
    """S: ``num_segments``, or the length of the first ``[S]`` input of ``sized`` (name ->
    1-D array or None); all must agree."""
    if num_segments is not None and (
        isinstance(num_segments, bool)
        or not isinstance(num_segments, (int, np.integer))
        or num_segments < 0
    ):
        raise ValueError(
            f"num_segments: expected a non-negative int (the number of packed sequences, "
            f"static), got {num_segments!r}"
        )
    count = None if num_segments is None else int(num_segments)
    source = "num_segments"
    for name, x in sized.items():
        if x is None or np.ndim(x) != 1:
            continue
        n = int(np.shape(x)[0])
        if count is None:
            count, source = n, f"{name}.shape[0]"
        elif n != count:
            raise ValueError(
                f"{name}: expected shape ({count},) ([S], S = {source}) with segment_ids, "
                f"got {tuple(np.shape(x))}"
            )
    if count is None:
        raise ValueError(
            "num_segments: required with segment_ids when no [S] input gives the number of "
            "sequences (e.g. aggregate(..., segment_ids=ids, num_segments=S))"
        )
    return count


def _outside(ids, count):
    return (ids < -1) | (ids >= count)


def _in_another_row(ids, count):
    """True where a segment's position lies in a later row than the segment's first one."""
    xp = np if isinstance(ids, np.ndarray) else jnp
    rows = xp.broadcast_to(xp.arange(ids.shape[0])[:, None], ids.shape)
    inside = (ids >= 0) & (ids < count)
    slot = xp.where(inside, ids, count)  # ids outside go to a bucket of their own
    if xp is np:
        first = np.full(count + 1, ids.shape[0])
        np.minimum.at(first, slot.ravel(), rows.ravel())
    else:
        first = jnp.full(count + 1, ids.shape[0]).at[slot].min(rows)
    return inside & (rows != first[slot])


def packing(
    segment_ids: Any,
    num_segments: Any,
    shape: Sequence[int],
    sized: Mapping[str, Any] | None = None,
) -> Packing | None:
    """The call's :class:`Packing` (``None`` without ``segment_ids``): ids ``[B, T]`` =
    ``shape``, S from ``num_segments`` or the ``[S]`` inputs ``sized``."""
    if segment_ids is None:
        if num_segments is not None:
            raise ValueError(
                f"num_segments: given without segment_ids (num_segments={num_segments!r})"
            )
        return None
    ids = check.integer("segment_ids", segment_ids)
    check.shape("segment_ids", ids, shape, "[B, T]")
    count = _count(num_segments, sized or {})
    check.values_check(
        ids,
        lambda g: _outside(g, count),
        f"segment_ids: value {{value}} at position {{position}} is outside [-1, {count}) "
        f"(num_segments = {count})",
    )
    check.values_check(
        ids,
        lambda g: _in_another_row(g, count),
        "segment_ids: segment {value} at position {position} also lies in an earlier row; "
        "a sequence must lie in one row",
    )
    return Packing(ids.astype(jnp.int32), count)


def mask(token_mask: jax.Array, pack: Packing | None) -> jax.Array:
    """``mask`` with the positions of no sequence (id ``-1``) zeroed."""
    if pack is None:
        return token_mask
    return segment_math.masked(token_mask, pack)


def per_sequence(name: str, x: Any, pack: Packing) -> jax.Array:
    """A float ``[S]`` per-sequence input on every token of its sequence (``[B, T]``, 0 off
    any sequence), float32 without gradient."""
    x = check.floating(name, x)
    check.shape(name, x, (pack.count,), "[S] with segment_ids")
    return jax.lax.stop_gradient(segment_math.spread(x.astype(jnp.float32), pack))


def token_advantages(x: Any, shape: Sequence[int], pack: Packing | None) -> jax.Array:
    """``advantages``: ``[B, T]``, or one per sequence (``[B]``; ``[S]`` with segment ids)
    broadcast to its tokens; float32 ``[B, T]`` without gradient."""
    if pack is None:
        return check.token_advantages(x, shape)
    x = check.floating("advantages", x)
    if x.ndim == 1:
        return per_sequence("advantages", x, pack)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"advantages: expected shape {tuple(shape)} or ({pack.count},) ([B, T] or [S] "
            f"with segment_ids), got {tuple(x.shape)}"
        )
    return jax.lax.stop_gradient(x.astype(jnp.float32))


def max_len(mode: str, value: Any, pack: Packing | None, where: str = "config.max_len") -> Any:
    """``max_len``, required under ``segment_ids`` by ``"seq_mean_token_sum_norm"``."""
    if pack is not None and mode == "seq_mean_token_sum_norm" and value is None:
        raise ValueError(
            f"{where}: required with segment_ids and loss_agg_mode='seq_mean_token_sum_norm' "
            "(the packed row length T is no sequence's length)"
        )
    return value
