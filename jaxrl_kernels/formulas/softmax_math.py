"""The softmax statistics of log-probs, written once for tiles and whole arrays.

Everything here is elementwise or a reduction over the last axis, in float32, so the Pallas
kernels call the same functions on tiles that the jnp backends call on whole arrays.

Per row of ``z = logits / T`` (online, tile by tile):

* ``m``  running max,
* ``s = Σ exp(z - m)``,
* ``a = Σ exp(z - m) · (z - m)`` (only for entropy),

so that ``lse = m + log s`` and ``entropy = log s - a / s`` (no cancellation even for
|z| ~ 1e4); ``logp = z_target − lse``. Across a vocabulary split over devices the per-device
statistics combine exactly (:func:`combine_vocab_shards`). The gradient of a tile of logits
is ``g (onehot − p) − g_H p (log p + H)`` with ``p = exp(z − lse)``
(:func:`logprob_grad_tile`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def online_softmax_init(shape, with_entropy: bool):
    m = jnp.full(shape, -jnp.inf, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return (m, zero, zero) if with_entropy else (m, zero)


def online_softmax_update(stats, z):
    """Fold a tile ``z[..., tile]`` (float32, -inf where masked) into ``stats``."""
    m_old = stats[0]
    m_new = jnp.maximum(m_old, jnp.max(z, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all -inf so far: keep exps at 0
    scale = jnp.exp(m_old - m_safe)
    shifted = z - m_safe[..., None]
    e = jnp.exp(shifted)
    s = stats[1] * scale + jnp.sum(e, axis=-1)
    if len(stats) == 2:
        return (m_new, s)
    # a' = scale·(a + s·(m_old - m_new)); where nothing was seen yet, s = a = 0.
    a_carry = jnp.where(stats[1] > 0, stats[2] + stats[1] * (m_old - m_safe), 0.0)
    a = a_carry * scale + jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1)
    return (m_new, s, a)


def online_softmax_merge(x, y):
    """Combine the statistics of two disjoint column sets (the split-V combine)."""
    m = jnp.maximum(x[0], y[0])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    cx, cy = jnp.exp(x[0] - m_safe), jnp.exp(y[0] - m_safe)
    s = x[1] * cx + y[1] * cy
    if len(x) == 2:
        return (m, s)
    ax = jnp.where(x[1] > 0, x[2] + x[1] * (x[0] - m_safe), 0.0)
    ay = jnp.where(y[1] > 0, y[2] + y[1] * (y[0] - m_safe), 0.0)
    return (m, s, ax * cx + ay * cy)


def online_softmax_finalize(stats):
    """``(lse, entropy or None)`` from the running statistics."""
    log_s = jnp.log(stats[1])
    lse = stats[0] + log_s
    entropy = log_s - stats[2] / stats[1] if len(stats) == 3 else None
    return lse, entropy


def combine_vocab_shards(stats, target_rel, holds_target, axes):
    """Row statistics of the whole vocabulary from those of each device's slice of it.

    ``stats = (m, s[, a])`` over this device's columns, ``target_rel = z_target − m`` where
    ``holds_target`` (this slice holds the target column). Over the mesh ``axes`` (none: one
    slice, returned as is) only these per-row values cross devices:
    ``m* = max m``, ``s* = Σ s·e``, ``a* = Σ e·(a + s·(m − m*))`` with ``e = exp(m − m*)``, and
    the target's ``z_t − m* = target_rel + m − m*`` from the one slice that holds it.
    Returns ``(stats*, target_rel*, holders)``: holders counts the slices that hold the target
    (1 for a target inside [0, V), 0 outside).
    """
    holders = holds_target.astype(jnp.int32)
    if not axes:
        return tuple(stats), jnp.where(holds_target, target_rel, 0.0), holders
    m = stats[0]
    m_all = jax.lax.pmax(m, axes)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    shift = jnp.where(m == -jnp.inf, 0.0, m - m_safe)
    scale = jnp.exp(m - m_safe)
    out = (m_all, jax.lax.psum(stats[1] * scale, axes))
    if len(stats) == 3:
        a = jnp.where(stats[1] > 0, stats[2] + stats[1] * shift, 0.0) * scale
        out += (jax.lax.psum(a, axes),)
    target = jax.lax.psum(jnp.where(holds_target, target_rel + shift, 0.0), axes)
    return out, target, jax.lax.psum(holders, axes)


def finalize_row_stats(stats, target_rel, holders, row_valid):
    """(logp, entropy | None, lse, active) per row from whole-vocabulary statistics.

    ``logp = (z_t − m) − log s`` (exact even where |z| ~ 1e4), ``entropy = log s − a/s``,
    ``lse = m + log s``. ``active`` rows (valid, target inside the vocabulary) are the ones
    with a gradient; invalid rows give 0, out-of-range targets NaN.
    """
    log_s = jnp.log(stats[1])
    entropy = log_s - stats[2] / stats[1] if len(stats) == 3 else None
    in_range = holders == 1
    logp, entropy = finalize_logprob(target_rel, log_s, entropy, in_range, row_valid)
    return logp, entropy, stats[0] + log_s, row_valid & in_range


def logprob_grad_tile(z, lse, entropy, is_target, g_logp, g_entropy, temperature, floor=None):
    """d loss / d logits on a tile, from per-row cotangents of logp and entropy.

    With p = exp(z - lse):  d logp/d logits = (onehot - p) / T and
    d entropy/d logits = -p · (z - Σ p z) / T = -p · (log p + H) / T.
    ``g_entropy``/``entropy`` may be None (no entropy output). ``floor`` (per row, None: no
    truncation): the distribution keeps only ``z >= floor`` (``lse`` and ``entropy`` are the
    kept set's), so ``p = 0`` below it; the one-hot term is the target's wherever it lies.
    """
    logp_all = z - lse[..., None]
    p = jnp.exp(logp_all)
    if floor is not None:
        p = jnp.where(z >= floor[..., None], p, 0.0)
    dz = g_logp[..., None] * (jnp.where(is_target, 1.0, 0.0) - p)
    if g_entropy is not None:
        dz = dz - g_entropy[..., None] * p * jnp.where(p > 0, logp_all + entropy[..., None], 0.0)
    return dz / temperature


def finalize_logprob(target_z, lse, entropy, target_in_range, row_valid):
    """Per-row outputs: 0 on invalid rows, NaN where the target is out of range.

    ``target_z`` and ``lse`` may carry the same shift (e.g. both taken relative
    to the row max, which keeps logp exact when |z| is large).
    """
    nan = jnp.float32(jnp.nan)
    logp = jnp.where(row_valid, jnp.where(target_in_range, target_z - lse, nan), 0.0)
    if entropy is not None:
        entropy = jnp.where(row_valid, jnp.where(target_in_range, entropy, nan), 0.0)
    return logp, entropy
