"""Per-row and per-tile math of the divergences between two LM heads (``linear_distill_loss``)
and of the top-k log-probs (``linear_topk_logprobs``).

Notation, per row: ``a = z_s`` and ``b = z_t`` the student's and the teacher's logits (already
divided by the temperature), ``ls = a − lse_s = log p_s``, ``lt = b − lse_t = log p_t``.

* ``"reverse_kl"``: ``d = Σ p_s (ls − lt) = Σ p_s (a − b) − lse_s + lse_t``;
  ``∂d/∂a = p_s ⊙ ((ls − lt) − d)``.
* ``"forward_kl"``: ``d = Σ p_t (lt − ls) = Σ p_t (b − a) − lse_t + lse_s``;
  ``∂d/∂a = p_s − p_t``.
* ``"jsd"``: ``log m = logaddexp(log β + lt, log(1−β) + ls)``,
  ``KL_t = Σ p_t (lt − log m)``, ``KL_s = Σ p_s (ls − log m)``, ``d = β KL_t + (1−β) KL_s``;
  ``∂d/∂a = (1−β) p_s ⊙ ((ls − log m) − KL_s)``.

Both KLs come out of one pass over the vocabulary: besides each head's online softmax
``(m, s)``, the running sums ``A_s = Σ exp(a − m_s)(a − b)`` and ``A_t = Σ exp(b − m_t)(b − a)``
are rescaled with their own head's maximum as it grows (``a − b`` does not depend on it), so
``Σ p_s (a − b) = A_s / s_s``. ``log m`` needs both normalisers first: the JSD takes a second
pass that sums ``KL_t`` and ``KL_s`` tile by tile once ``lse_s`` and ``lse_t`` are known.
Across vocabulary shards only per-row values cross devices (``pmax`` of the maxima, ``psum`` of
the rescaled sums; the JSD's sums are plain ``psum``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


# -- one pass for both heads: (m_s, s_s, A_s, m_t, s_t, A_t) ------------------------------------


def pair_stats_init(shape):
    m = jnp.full(shape, -jnp.inf, jnp.float32)
    zero = jnp.zeros(shape, jnp.float32)
    return (m, zero, zero, m, zero, zero)


def _rescale(m_old, tile_max):
    m_new = jnp.maximum(m_old, tile_max)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return m_new, m_safe, jnp.exp(m_old - m_safe)


def _per_row(x, like):
    """Row values ``x`` [N] broadcast over the columns of ``like`` [N, C] (in a form Mosaic
    GPU kernels lower too)."""
    return jax.lax.broadcast_in_dim(x, like.shape, (0,))


def pair_stats_update(stats, zs, zt, fresh):
    """Fold tiles ``zs``, ``zt`` [N, C] (float32) into the statistics; ``fresh`` [C] marks the
    columns this tile adds (the others are ignored; ``None``: all of them)."""
    m_s, s_s, a_s, m_t, s_t, a_t = stats
    diff = zs - zt
    if fresh is not None:
        diff = jnp.where(fresh, diff, 0.0)
        zs = jnp.where(fresh, zs, -jnp.inf)
        zt = jnp.where(fresh, zt, -jnp.inf)
    out = []
    for m, s, a, z, sign in ((m_s, s_s, a_s, zs, 1.0), (m_t, s_t, a_t, zt, -1.0)):
        m_new, m_safe, scale = _rescale(m, jnp.max(z, axis=-1))
        e = jnp.exp(z - _per_row(m_safe, z))
        out += [
            m_new,
            s * scale + jnp.sum(e, axis=-1),
            a * scale + sign * jnp.sum(e * diff, axis=-1),
        ]
    return tuple(out)


def _pair_stats_merged(stats, reduce_max, reduce_sum):
    out = []
    for m, s, a in (stats[:3], stats[3:]):
        m_all = reduce_max(m)
        m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
        scale = jnp.exp(m - m_safe)
        out += [m_all, reduce_sum(s * scale), reduce_sum(a * scale)]
    return tuple(out)


def pair_stats_combine(stats, axes):
    """The statistics of the whole vocabulary from each shard's over the mesh ``axes``."""
    if not axes:
        return stats
    return _pair_stats_merged(
        stats, lambda x: jax.lax.pmax(x, axes), lambda x: jax.lax.psum(x, axes)
    )


def pair_stats_merge_splits(stats):
    """The statistics of a vocabulary from those of its consecutive splits, each statistic
    [splits, N] (a kernel's vocabulary splits; the same merge as across shards)."""
    return _pair_stats_merged(stats, lambda x: jnp.max(x, axis=0), lambda x: jnp.sum(x, axis=0))


def pair_stats_finalize(stats):
    """``(lse_s, lse_t, reverse_kl, forward_kl)`` per row."""
    m_s, s_s, a_s, m_t, s_t, a_t = stats
    lse_s, lse_t = m_s + jnp.log(s_s), m_t + jnp.log(s_t)
    reverse = a_s / s_s - (lse_s - lse_t)
    forward = a_t / s_t - (lse_t - lse_s)
    return lse_s, lse_t, reverse, forward


def choose_divergence(divergence, beta, reverse, forward, jsd_sums, axes=()):
    """``(d, kl_s)`` per row from :func:`pair_stats_finalize`'s KLs: the one asked for (and
    ``kl_s`` 0), or for the JSD ``β·KL_t + (1−β)·KL_s`` of ``jsd_sums()`` = ``(KL_t, KL_s)``
    (this device's sums, called only then), summed over the vocabulary shards ``axes``."""
    if divergence == "reverse_kl":
        return reverse, jnp.zeros_like(reverse)
    if divergence == "forward_kl":
        return forward, jnp.zeros_like(forward)
    kl_t, kl_s = jsd_sums()
    if axes:
        kl_t, kl_s = jax.lax.psum((kl_t, kl_s), axes)
    return beta * kl_t + (1.0 - beta) * kl_s, kl_s


# -- the JSD's second pass ------------------------------------------------------------------


def _logaddexp(x, y):
    """``log(eˣ + eʸ)`` in the ops Mosaic GPU kernels lower (``jnp.logaddexp`` is a custom_jvp
    and ``log1p`` has no lowering there): ``max + log(1 + e^−|x−y|)``, within a float32 rounding of it."""
    return jnp.maximum(x, y) + jnp.log(1.0 + jnp.exp(-jnp.abs(x - y)))


def _logs(beta):
    return math.log(beta), math.log1p(-beta)


def jsd_tile_sums(zs, zt, lse_s, lse_t, fresh, beta):
    """``(KL_t, KL_s)`` summed over the fresh columns of the tiles (per row; ``fresh``
    ``None``: every column)."""
    log_b, log_1mb = _logs(beta)
    ls = zs - _per_row(lse_s, zs)
    lt = zt - _per_row(lse_t, zt)
    lm = _logaddexp(log_b + lt, log_1mb + ls)
    pt, ps = jnp.exp(lt), jnp.exp(ls)
    terms_t, terms_s = pt * (lt - lm), ps * (ls - lm)
    keep_t, keep_s = pt > 0, ps > 0
    if fresh is not None:
        keep_t, keep_s = fresh & keep_t, fresh & keep_s
    kl_t = jnp.sum(jnp.where(keep_t, terms_t, 0.0), axis=-1)
    kl_s = jnp.sum(jnp.where(keep_s, terms_s, 0.0), axis=-1)
    return kl_t, kl_s


# -- the student's logit gradient on a tile ------------------------------------------------


def student_grad_tile(divergence, zs, zt, lse_s, lse_t, d, kl_s, g, beta, temperature):
    """``g · ∂d/∂a / T`` on a tile [N, C] (d loss / d (hidden·Wᵀ + b)): ``d`` is the row's raw
    divergence, ``kl_s`` its ``KL(p_s ‖ m)`` (JSD only), ``g`` the row's cotangent."""
    ls = zs - _per_row(lse_s, zs)
    lt = zt - _per_row(lse_t, zt)
    ps = jnp.exp(ls)
    if divergence == "reverse_kl":
        dz = ps * ((ls - lt) - _per_row(d, zs))
    elif divergence == "forward_kl":
        dz = ps - jnp.exp(lt)
    else:
        log_b, log_1mb = _logs(beta)
        lm = _logaddexp(log_b + lt, log_1mb + ls)
        dz = (1.0 - beta) * ps * ((ls - lm) - _per_row(kl_s, zs))
    return dz * _per_row(g / temperature, zs)


def student_grad_bound(divergence, d, aux, beta):
    """``B >= max_v |∂d/∂a|`` per row (a float16 logit gradient divided by ``g B / T`` lies in
    [−1, 1]): 1 for the forward KL (``|p_s − p_t| <= 1``); for the reverse KL ``1/e + R + |d|``
    with ``aux = R >= max_v |lt|`` (``|p_s (ls − lt − d)| <= p_s |ls| + p_s |lt| + |d|`` and
    ``p |log p| <= 1/e``); for the JSD ``(1−β) (max(1/e, −log(1−β)) + |KL_s|)`` with ``aux =
    KL_s`` (``log(1−β) + ls <= log m <= 0`` bounds ``p_s |ls − log m|``)."""
    if divergence == "forward_kl":
        return jnp.ones_like(d)
    if divergence == "reverse_kl":
        return math.exp(-1.0) + jnp.abs(aux) + jnp.abs(d)
    return (1.0 - beta) * (max(math.exp(-1.0), -math.log1p(-beta)) + jnp.abs(aux))


# -- plain jnp on whole rows (the reference backend) -------------------------------------------


def divergence_of_logits(zs, zt, divergence, beta, vocab_axes=()):
    """Per-row ``d`` of float32 logits [N, V_local] (the vocabulary possibly split over
    ``vocab_axes``), in plain jnp that jax differentiates."""
    psum = (lambda x: jax.lax.psum(x, vocab_axes)) if vocab_axes else (lambda x: x)

    def log_softmax(z):
        m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
        if vocab_axes:
            m = jax.lax.pmax(m, vocab_axes)
        shifted = z - m[:, None]
        return shifted - jnp.log(psum(jnp.sum(jnp.exp(shifted), axis=-1)))[:, None]

    ls, lt = log_softmax(zs), log_softmax(zt)
    ps, pt = jnp.exp(ls), jnp.exp(lt)
    if divergence == "reverse_kl":
        return psum(jnp.sum(ps * (ls - lt), axis=-1))
    if divergence == "forward_kl":
        return psum(jnp.sum(pt * (lt - ls), axis=-1))
    log_b, log_1mb = _logs(beta)
    lm = _logaddexp(log_b + lt, log_1mb + ls)
    return psum(jnp.sum(beta * pt * (lt - lm) + (1.0 - beta) * ps * (ls - lm), axis=-1))


# -- top-k ------------------------------------------------------------------------------------


def topk_merge(values, ids, k):
    """The top ``k`` of candidates [N, M] (values float32, ids int32) ordered so that, among
    equal values, lower ids come first; ties keep that order (``lax.top_k`` is stable)."""
    top, where = jax.lax.top_k(values, k)
    return top, jnp.take_along_axis(ids, where, axis=-1)


def topk_across_shards(values, ids, k, axes):
    """Merge each vocabulary shard's top-k [N, k'] into the global top ``k`` (shards hold
    consecutive id ranges, so shard order is id order). The shards' candidates are gathered by
    a ``psum`` of each one placed in its own slot (exact: the other slots hold 0), so that the
    result is the same on every device of ``axes``."""
    if not axes:
        return values, ids
    n_shards = math.prod(jax.lax.axis_size(a) for a in axes)
    at = jax.lax.axis_index(axes)

    def gather(x):
        slots = jnp.zeros((x.shape[0], n_shards, x.shape[1]), x.dtype)
        slots = jax.lax.dynamic_update_slice_in_dim(slots, x[:, None, :], at, axis=1)
        return jax.lax.psum(slots, axes).reshape(x.shape[0], -1)

    return topk_merge(gather(values), gather(ids), k)
