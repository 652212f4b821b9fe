"""The distribution a sampler draws from: the truncations, their order and their tie rules.

A rollout engine samples each token from ``softmax(z / T)`` truncated to a *kept set* and
renormalised. With ``u = z / T`` per row and ``m = max u``, in the order of vLLM's sampler
(v0.11, ``vllm/v1/sample/sampler.py``: temperature, then the argmax-invariant logits
processors, min-p among them, then ``apply_top_k_top_p``)::

    min-p:  keep u_j >= m + log(min_p)                 (p_j >= min_p · max p)
    top-k:  of those, keep u_j >= the k-th largest      (all values equal to it too)
    top-p:  of those, keep j where S_j < top_p · Z      (Z: their Σ exp(u − m))
            S_j = Σ exp(u_i − m) over kept i with u_i > u_j

Every step keeps an upper set of the row's values, so the kept set is ``{u >= τ}`` for one
per-row threshold ``τ``; the processed distribution is ``q_j = exp(u_j − lse_K)`` on it, with
``lse_K = log Σ_{u >= τ} exp(u)``. Ties at a threshold are all kept: vLLM's top-k keeps every
value equal to the k-th (``logits < kth`` is what it masks); its top-p keeps a token when the
mass sorted above it is below ``top_p``, and among equal values that order is its sort's, so
we keep them all (a superset only where values tie exactly at the nucleus' edge).

The thresholds are found in the order-preserving integer keys of float32 values
(:func:`float_key`), so that a search over keys ends at a value exactly.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

KEY_NONE = -(2**31)
"""The key below every float32 key (no value: a padding column, ``-inf``)."""


@dataclasses.dataclass(frozen=True)
class Truncation:
    """A sampler's truncation of ``softmax(z / T)``; None fields are off."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None


def truncation(top_k=None, top_p=None, min_p=None) -> Truncation | None:
    """The :class:`Truncation` of a call's ``top_k`` / ``top_p`` / ``min_p`` (checked), or
    None when none of them truncates (``top_p = 1`` and ``min_p = 0`` keep everything)."""
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p!r}")
        top_p = None if top_p == 1 else float(top_p)
    if min_p is not None:
        if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
            raise ValueError(f"min_p: expected None or a float in [0, 1], got {min_p!r}")
        min_p = None if min_p == 0 else float(min_p)
    if top_k is None and top_p is None and min_p is None:
        return None
    return Truncation(top_k, top_p, min_p)


def float_key(u):
    """int32 keys of float32 ``u`` in the values' order (``-0.0`` as ``+0.0``; ``-inf`` and
    NaN as :data:`KEY_NONE`)."""
    u = jnp.where(u == 0, 0.0, u).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(u, jnp.int32)
    key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return jnp.where((u == -jnp.inf) | jnp.isnan(u), KEY_NONE, key)


def key_value(key):
    """The float32 value of a key of :func:`float_key` (``-inf`` for :data:`KEY_NONE`)."""
    bits = jnp.where(key < 0, key ^ 0x7FFFFFFF, key)
    value = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(key == KEY_NONE, -jnp.inf, value)


def min_p_floor(m, min_p):
    """The smallest value min-p keeps: ``m + log(min_p)`` (``-inf`` with no min-p)."""
    if min_p is None:
        return jnp.full_like(m, -jnp.inf)
    return m + jnp.float32(math.log(min_p))


def kept_mask(u, trunc: Truncation):
    """Which entries of rows ``u`` [N, V] (float32, ``-inf`` for none) the sampler keeps:
    the definition above, by sorting each row (plain jnp, for the reference backend)."""
    m = jnp.max(u, axis=-1, keepdims=True)
    keep = u > -jnp.inf
    if trunc.min_p is not None:
        keep &= u >= min_p_floor(m, trunc.min_p)
    if trunc.top_k is not None and trunc.top_k < u.shape[-1]:
        kth = jax.lax.top_k(jnp.where(keep, u, -jnp.inf), trunc.top_k)[0][..., -1:]
        keep &= u >= kth
    if trunc.top_p is not None:
        e = jnp.where(keep, jnp.exp(u - m), 0.0)
        order = jnp.argsort(-jnp.where(keep, u, -jnp.inf), axis=-1, stable=True)
        u_sorted = jnp.take_along_axis(u, order, axis=-1)
        e_sorted = jnp.take_along_axis(e, order, axis=-1)
        above = jnp.cumsum(e_sorted, axis=-1) - e_sorted
        # Equal values share the mass above the first of them.
        first = jax.vmap(lambda row: jnp.searchsorted(-row, -row, side="left"))(u_sorted)
        above = jnp.take_along_axis(above, first, axis=-1)
        target = trunc.top_p * jnp.sum(e, axis=-1, keepdims=True)
        keep_sorted = above < target
        keep &= jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    return keep
