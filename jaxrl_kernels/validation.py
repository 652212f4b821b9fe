"""Argument checks. Every message names the argument, what was expected and what came."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_RANK = 32
"""The most dimensions an op accepts where it takes any leading shape ``[..., X]``."""


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds data we can look at now (not a tracer)."""
    return not isinstance(x, jax.core.Tracer)


def as_array(name: str, x: Any) -> jax.Array:
    if x is None:
        raise ValueError(f"{name}: expected an array, got None")
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from err


def floating(name: str, x: Any, dtypes: Sequence[Any] = FLOAT_DTYPES) -> jax.Array:
    x = as_array(name, x)
    if not any(x.dtype == np.dtype(d) for d in dtypes):
        names = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected a floating dtype ({names}), got {x.dtype}")
    return x


def integer(name: str, x: Any) -> jax.Array:
    x = as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    return x


def mask(name: str, x: Any) -> jax.Array:
    """A bool, float or integer mask whose values are 0 or 1.

    The values are checked only when ``x`` is concrete; under tracing they cannot be,
    and a value outside {0, 1} then simply weights its token by that value.
    """
    x = as_array(name, x)
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.floating)
            or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{name}: expected a bool or float {{0,1}} mask, got {x.dtype}")
    if x.dtype != jnp.bool_ and is_concrete(x):
        values = np.asarray(x)
        bad = (values != 0) & (values != 1)
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: expected values 0 or 1, got {values[pos].item()!r} at "
                             f"position {pos}")
    return x


def rank(name: str, x: jax.Array, ranks: int | Sequence[int], what: str = "") -> None:
    """``x.ndim`` must be one of ``ranks``; a range up to JAX's limit reads "at least k-D"."""
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.ndim not in allowed:
        if isinstance(ranks, range) and ranks.step == 1 and ranks.stop > MAX_RANK:
            want = f"at least {ranks.start}-D"
        else:
            want = "rank " + " or ".join(str(r) for r in allowed)
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected {want}{extra}, got shape {tuple(x.shape)}")


def shape(name: str, x: jax.Array, expected: Sequence[int], what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), "
                         f"got {tuple(x.shape)}")


def option(name: str, value: Any, valid: Sequence[str]) -> str:
    if value not in valid:
        raise ValueError(f"{name}: unknown option {value!r}; valid: {', '.join(valid)}")
    return value


def _number(name: str, value: Any) -> float | None:
    """The Python float of ``value`` when it is concrete, else None (checks are skipped)."""
    if value is None or isinstance(value, jax.core.Tracer):
        return None
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from err


def positive(name: str, value: Any) -> None:
    v = _number(name, value)
    if v is not None and not v > 0:
        raise ValueError(f"{name}: expected a value > 0, got {v}")


def in_range(name: str, value: Any, low: float, high: float, *, high_open: bool) -> None:
    v = _number(name, value)
    if v is None:
        return
    ok = low <= v < high if high_open else low <= v <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name}: expected a value in [{low}, {high}{bracket}, got {v}")


def greater_than(name: str, value: Any, bound: float) -> None:
    v = _number(name, value)
    if v is not None and not v > bound:
        raise ValueError(f"{name}: expected a value > {bound}, got {v}")


def non_negative_int(name: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")


def targets_in_range(name: str, targets: jax.Array, vocab: int, ignore: jax.Array | None) -> None:
    """Concrete targets outside [0, vocab) raise, naming the first bad position.

    ``ignore`` marks positions whose target is never used (ignore_index, mask == 0).
    Traced targets are not checked here: the kernels give NaN there instead.
    """
    if not is_concrete(targets) or (ignore is not None and not is_concrete(ignore)):
        return
    t = np.asarray(targets)
    bad = (t < 0) | (t >= vocab)
    if ignore is not None:
        bad &= ~np.asarray(ignore, dtype=bool)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: value {int(t[pos])} at position {pos} is outside the "
                         f"vocabulary [0, {vocab})")


def clip_options(clip_low: Any, clip_high: Any, dual_clip: Any) -> None:
    in_range("clip_low", clip_low, 0.0, 1.0, high_open=True)
    greater_than("clip_high", clip_high, 0.0)
    if dual_clip is not None:
        greater_than("dual_clip", dual_clip, 1.0)
