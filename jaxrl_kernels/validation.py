"""Argument checks. Every message names the argument, what was expected and what came.

Checks of shapes, dtypes and options run at trace time. Checks of the data itself (targets
inside the vocabulary, masks of 0 and 1, finite inputs) run on concrete arrays (eager calls);
on traced arrays (inside ``jax.jit``, ``jax.grad``, ``jax.vmap``) they run only in check mode:
``JAXRL_KERNELS_CHECKS=1`` or ``with jaxrl_kernels.checks():`` (see :func:`checks`). Check mode
adds each check to the traced computation as a reduction and a host callback
(``jax.debug.callback``) that raises the eager call's ``ValueError`` when the check fails.
With check mode off, nothing is added to the computation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.formulas import aggregation_math
from jaxrl_kernels.head import geometry

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
    """A floating array; in check mode, also finite (no NaN or infinity)."""
    x = as_array(name, x)
    if not any(x.dtype == np.dtype(d) for d in dtypes):
        names = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}: expected a floating dtype ({names}), got {x.dtype}")
    if checks_enabled():
        values_check(
            x,
            lambda v: ~jnp.isfinite(v) if isinstance(v, jax.Array) else ~np.isfinite(v),
            f"{name}: expected finite values, got {{value}} at position {{position}}",
        )
    return x


def integer(name: str, x: Any) -> jax.Array:
    x = as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")
    return x


def mask(name: str, x: Any) -> jax.Array:
    """A bool, float or integer mask whose values are 0 or 1.

    The values are checked when ``x`` is concrete, and when traced in check mode; otherwise
    a traced value outside {0, 1} simply weights its token by that value.
    """
    x = as_array(name, x)
    if not (
        x.dtype == jnp.bool_
        or jnp.issubdtype(x.dtype, jnp.floating)
        or jnp.issubdtype(x.dtype, jnp.integer)
    ):
        raise TypeError(f"{name}: expected a bool or float {{0,1}} mask, got {x.dtype}")
    if x.dtype != jnp.bool_:
        values_check(
            x,
            lambda m: (m != 0) & (m != 1),
            f"{name}: expected values 0 or 1, got {{value}} at position {{position}}",
        )
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
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(x.shape)}")


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


def targets_in_range(
    name: str,
    targets: jax.Array,
    vocab: int,
    ignore: jax.Array | None = None,
    *,
    mask: jax.Array | None = None,
) -> None:
    """Targets outside [0, vocab) raise, naming the first bad position.

    ``ignore`` marks positions whose target is never used (ignore_index); so do the zeros of
    ``mask``. Concrete targets are always checked; traced ones only in check mode (else the
    kernels give NaN there).
    """

    def bad(t, ignored, m):
        out = (t < 0) | (t >= vocab)
        if ignored is not None:
            out &= ~ignored.astype(bool)
        if m is not None:
            out &= m != 0
        return out

    values_check(
        targets,
        bad,
        f"{name}: value {{value}} at position {{position}} is outside the vocabulary [0, {vocab})",
        ignore,
        mask,
    )


def boundaries(name: str, bounds: jax.Array, total: int) -> None:
    """``bounds`` must be ``[0, ..., total]``, strictly increasing; names the first entry that
    breaks it. Concrete boundaries are checked by the caller; traced ones here, in check mode."""

    def bad(b):
        xp = np if isinstance(b, np.ndarray) else jnp
        i = xp.arange(b.shape[0])
        prev = xp.concatenate([b[:1] - 1, b[:-1]])
        return (b <= prev) | ((i == 0) & (b != 0)) | ((i == b.shape[0] - 1) & (b != total))

    values_check(
        bounds,
        bad,
        f"{name}: expected strictly increasing values starting at 0 and "
        f"ending at B = {total}, got {{value}} at position {{position}}",
    )


def clip_options(clip_low: Any, clip_high: Any, dual_clip: Any) -> None:
    in_range("clip_low", clip_low, 0.0, 1.0, high_open=True)
    greater_than("clip_high", clip_high, 0.0)
    if dual_clip is not None:
        greater_than("dual_clip", dual_clip, 1.0)


# -- the per-token inputs and options of the losses ------------------------------------------


def per_token(name: str, x: Any, expected: Sequence[int] | None = None) -> jax.Array:
    """A float [B, T] per-token input (of shape ``expected`` when given)."""
    x = floating(name, x)
    if expected is None:
        rank(name, x, 2, "[B, T]")
    else:
        shape(name, x, expected, "[B, T]")
    return x


def optional_per_token(name: str, x: Any, expected: Sequence[int]) -> jax.Array | None:
    """:func:`per_token` as float32, or None."""
    return None if x is None else per_token(name, x, expected).astype(jnp.float32)


def token_mask(x: Any, expected: Sequence[int]) -> jax.Array:
    """The {0, 1} [B, T] ``mask``, as float32."""
    x = mask("mask", x)
    shape("mask", x, expected, "[B, T]")
    return x.astype(jnp.float32)


def token_advantages(x: Any, expected: Sequence[int]) -> jax.Array:
    """``advantages`` [B, T] or [B], as float32 [B, T] without a gradient."""
    x = floating("advantages", x)
    expected = tuple(expected)
    if x.shape == expected[:1]:
        x = jnp.broadcast_to(x[:, None], expected)
    elif x.shape != expected:
        raise ValueError(
            f"advantages: expected shape {expected} or {expected[:1]} ([B, T] or "
            f"[B]), got {tuple(x.shape)}"
        )
    return jax.lax.stop_gradient(x.astype(jnp.float32))


def max_len(value: Any) -> int | None:
    """``max_len``: a positive int or None."""
    if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
        raise ValueError(f"max_len: expected a positive int or None, got {value!r}")
    return value


def agg_mode(mode: Any) -> str:
    """``loss_agg_mode`` checked, and canonical (an alias replaced by its mode): the one place
    the aggregation mode is checked; ``aggregation_math`` takes canonical modes."""
    aliases = aggregation_math.AGGREGATION_ALIASES
    option("loss_agg_mode", mode, aggregation_math.AGGREGATION_MODES + tuple(aliases))
    return aliases.get(mode, mode)


def linear_head(hidden: Any, weight: Any, bias: Any, weight_layout: Any):
    """Validate an LM head; return (hidden, weight, bias, vocab)."""
    hidden = floating("hidden", hidden)
    weight = floating("weight", weight)
    option("weight_layout", weight_layout, geometry.LAYOUTS)
    rank("hidden", hidden, range(1, MAX_RANK + 1), "[..., D]")
    rank("weight", weight, 2, geometry.SHAPES[weight_layout])
    dim = hidden.shape[-1]
    vocab, w_dim = (
        geometry.vocab_size(weight, weight_layout),
        geometry.hidden_dim(weight, weight_layout),
    )
    if w_dim != dim:
        # Read in the other layout, this weight's D is our ``vocab`` and its V is ``w_dim``.
        other = "dv" if weight_layout == "vd" else "vd"
        hint = (
            f"; it fits weight_layout={other!r} ({geometry.SHAPES[other]} with V = {w_dim})"
            if vocab == dim
            else ""
        )
        raise ValueError(
            f"weight: expected shape {geometry.SHAPES[weight_layout]} with D = {dim} "
            f"(hidden.shape[-1]) for weight_layout={weight_layout!r}, got "
            f"{tuple(weight.shape)}{hint}"
        )
    if vocab == 0:
        raise ValueError("weight: expected a non-empty vocabulary axis, got V = 0")
    if bias is not None:
        bias = floating("bias", bias)
        shape("bias", bias, (vocab,), "[V]")
    return hidden, weight, bias, vocab


# -- check mode: the data checks on traced arrays ----------------------------------------------

CHECKS_ENV = "JAXRL_KERNELS_CHECKS"
_checks: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "jaxrl_kernels_checks", default=None
)


def checks_enabled() -> bool:
    """Check mode: ``with checks():`` where one is active, else ``JAXRL_KERNELS_CHECKS``."""
    scoped = _checks.get()
    if scoped is not None:
        return scoped
    return os.environ.get(CHECKS_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def checks(enabled: bool = True) -> Iterator[None]:
    """Check mode within this scope: every op also checks the data of traced inputs.

    Eager calls always check their data; traced ones (inside ``jax.jit``, ``jax.grad``,
    ``jax.vmap``) do so only in check mode. Checked: targets / actions inside ``[0, V)``
    (except where ignored or masked), masks of 0 and 1, and every floating input (hidden
    states, weights, logits, old / reference / sampler log-probs, advantages) finite. In
    check mode eager calls also check that floating inputs are finite. A failed traced check
    raises the eager call's ``ValueError`` from a host callback; JAX reports it as a
    ``jax.errors.JaxRuntimeError`` whose message ends with the eager one (on a GPU, when the
    result is next waited for). Each check costs a reduction and a host round trip: a
    debugging aid. Off by default; ``JAXRL_KERNELS_CHECKS=1`` turns it on for the whole
    process. The mode is read when an op is traced: enter the scope before the first call of
    a jitted function (``jax.jit`` reuses earlier traces).

    Args:
      enabled: ``True`` to check; ``False`` turns check mode off within the scope.

    Returns:
      A context manager.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits, targets = jnp.zeros((2, 5)), jnp.array([1, 7])
      >>> with jk.checks():
      ...     jax.jit(jk.token_logprobs)(logits, targets)  # doctest: +SKIP
      JaxRuntimeError: ... ValueError: targets: value 7 at position (1,) is outside the vocabulary [0, 5)
    """
    token = _checks.set(bool(enabled))
    try:
        yield
    finally:
        _checks.reset(token)


def values_check(x: jax.Array, bad_fn, message: str, *extra: Any) -> None:
    """Raise ``ValueError(message)`` where ``bad_fn(x, *extra)`` (a bool array shaped like ``x``)
    holds anywhere. ``message`` has ``{value}`` (repr of x at the first bad position) and
    ``{position}`` (its index tuple). Concrete inputs are checked now; traced ones in check mode.
    """
    if is_concrete(x) and all(e is None or is_concrete(e) for e in extra):
        values = np.asarray(x)
        bad = np.asarray(
            bad_fn(values, *(None if e is None else np.asarray(e) for e in extra)), dtype=bool
        )
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(message.format(value=repr(values[pos].item()), position=pos))
        return
    if not checks_enabled() or x.size == 0:
        return
    bad = jnp.broadcast_to(bad_fn(x, *extra), x.shape).reshape(-1)
    first = jnp.argmax(bad)
    position = jnp.unravel_index(first, x.shape) if x.ndim else ()
    _traced_check(jnp.any(bad), x.reshape(-1)[first], tuple(position), message)


def _traced_check(failed: jax.Array, value: jax.Array, position: tuple, message: str) -> None:
    """A host callback that raises ``ValueError`` when ``failed`` holds. (``checkify.check``
    would need every caller to wrap their function in ``checkify.checkify``; a plain
    ``jax.jit`` of it fails to lower. The callback raises wherever the op runs.)"""
    jax.debug.callback(functools.partial(_raise_from_host, message), failed, value, *position)


def _raise_from_host(message: str, failed, value, *position) -> None:
    if bool(np.asarray(failed)):
        pos = tuple(int(np.asarray(p)) for p in position)
        raise ValueError(message.format(value=repr(np.asarray(value).item()), position=pos))
