"""The reference backend's log-probs (of given logits, of a linear head): plain jnp on the
materialised float32 logits.

These ops are ``logprob_core.Whole``: jax differentiates them itself, and under sharding
they run as plain jnp (XLA's partitioner for Auto mesh axes; ``shard_map`` with collectives
over a split vocabulary otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels.dispatch.contract import Whole
from jaxrl_kernels.formulas import sampler_math, softmax_math
from jaxrl_kernels.head import geometry, vocab_chunks
from jaxrl_kernels.sharding.vma import cast_varying


def _row_softmax(z, vocab_axes, return_entropy):
    """What the log-probs of z [N, V_local] take from each row's softmax, the vocabulary
    possibly split over ``vocab_axes`` (this device holds ids [i·V_local, (i+1)·V_local)):
    ``(offset, psum, shifted, log_s, entropy | None)`` with ``shifted = z − max z`` (the max
    only shifts, so it carries no gradient), ``log_s = log Σ exp(shifted)``, ``psum`` the sum
    over the vocabulary split and ``offset`` this device's first id."""
    offset = jax.lax.axis_index(vocab_axes) * z.shape[-1] if vocab_axes else 0
    psum = (lambda x: jax.lax.psum(x, vocab_axes)) if vocab_axes else (lambda x: x)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
    if vocab_axes:
        m = jax.lax.pmax(m, vocab_axes)
    shifted = z - m[:, None]
    e = jnp.exp(shifted)
    log_s = jnp.log(psum(jnp.sum(e, axis=-1)))
    entropy = None
    if return_entropy:
        p = e / jnp.exp(log_s)[:, None]
        entropy = log_s - psum(jnp.sum(jnp.where(p > 0, p * shifted, 0.0), axis=-1))
    return offset, psum, shifted, log_s, entropy


def _logprobs_from_z(z, targets, row_valid, return_entropy, vocab_axes):
    """Log-probs (and entropies) of z [N, V_local] at one target per row (:func:`_row_softmax`;
    plain jnp: jax differentiates it, collectives included)."""
    offset, psum, shifted, log_s, entropy = _row_softmax(z, vocab_axes, return_entropy)
    is_target = jnp.arange(z.shape[-1])[None, :] == (targets - offset)[:, None]
    target_rel = psum(jnp.sum(jnp.where(is_target, shifted, 0.0), axis=-1))
    holders = psum(jnp.sum(is_target.astype(jnp.int32), axis=-1))
    return softmax_math.finalize_logprob(target_rel, log_s, entropy, holders == 1, row_valid)


def _ids_logprobs_from_z(z, ids, id_valid, return_entropy, vocab_axes):
    """:func:`_logprobs_from_z` with K ids per row (``ids``, ``id_valid`` [N, K]): log-probs
    [N, K] (0 at invalid ids, NaN at ids outside [0, V)) and the entropy of each row with a
    valid id (0 elsewhere)."""
    local_vocab = z.shape[-1]
    offset, psum, shifted, log_s, entropy = _row_softmax(z, vocab_axes, return_entropy)
    local = ids - offset
    holds = (local >= 0) & (local < local_vocab)
    at = jnp.take_along_axis(shifted, jnp.clip(local, 0, local_vocab - 1), axis=-1)
    target_rel = psum(jnp.where(holds, at, 0.0))
    in_range = psum(holds.astype(jnp.int32)) == 1
    logp = jnp.where(id_valid, jnp.where(in_range, target_rel - log_s[:, None], jnp.nan), 0.0)
    if entropy is not None:
        entropy = jnp.where(jnp.any(id_valid, axis=-1), entropy, 0.0)
    return logp, entropy


def _truncated_logprobs_from_z(z, targets, row_valid, return_entropy, vocab_axes, truncation):
    """Log-probs, entropies and whether each target is kept, under a sampler's truncation
    (``sampler_math.kept_mask`` on whole rows: a split vocabulary is gathered first, by a
    ``psum`` of each slice in its place; the kept set carries no gradient)."""
    if vocab_axes:  # the whole rows on every device: each slice in its place, summed
        n_shards = jax.lax.psum(1, vocab_axes)
        whole = jnp.zeros((z.shape[0], n_shards * z.shape[1]), z.dtype)
        offset = jax.lax.axis_index(vocab_axes) * z.shape[1]
        z = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(whole, z, offset, axis=1), vocab_axes)
    keep = jax.lax.stop_gradient(sampler_math.kept_mask(jax.lax.stop_gradient(z), truncation))
    in_range = (targets >= 0) & (targets < z.shape[-1])
    t = jnp.clip(targets, 0, z.shape[-1] - 1)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
    shifted = jnp.where(keep, z - m[:, None], 0.0)
    e = jnp.where(keep, jnp.exp(shifted), 0.0)
    log_s = jnp.log(jnp.sum(e, axis=-1))
    entropy = log_s - jnp.sum(e * shifted, axis=-1) / jnp.exp(log_s) if return_entropy else None
    z_t = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0]
    logp, entropy = softmax_math.finalize_logprob(z_t - m, log_s, entropy, in_range, row_valid)
    inside = row_valid & in_range & jnp.take_along_axis(keep, t[:, None], axis=-1)[:, 0]
    return logp, entropy, inside


def _flat_rows(fn, n_row_dims, targets, row_valid, *operands, **kw):
    flat = [None if x is None else x.reshape((-1,) + x.shape[n_row_dims:]) for x in operands]
    logp, entropy, *inside = fn(
        *flat,
        targets.reshape((-1,) + targets.shape[n_row_dims:]),
        row_valid.reshape((-1,) + targets.shape[n_row_dims:]),
        **kw,
    )
    rows = targets.shape[:n_row_dims]
    return (
        logp.reshape(targets.shape),
        None if entropy is None else entropy.reshape(rows),
    ) + tuple(x.reshape(rows) for x in inside)


def _per_row(targets, n_row_dims, truncation):
    """The log-probs of z [N, V_local] for these targets (one per row, K ids, truncated)."""
    if truncation is not None:
        return lambda *a: _truncated_logprobs_from_z(*a, truncation)
    return _ids_logprobs_from_z if targets.ndim > n_row_dims else _logprobs_from_z


def _in_row_blocks(fn, rows: int | None):
    """``fn(*operands)`` (each [N, ...]) on blocks of ``rows`` rows, the last padded with zeros
    (``lax.map``): one shape whatever N, so that every product and reduction of a row, and of
    its gradient, is the same whatever N and the other rows are (``rows`` None: ``fn``)."""
    if rows is None:
        return fn

    def blocked(*operands):
        n = operands[0].shape[0]
        count = max(1, -(-n // rows))
        split = [
            jnp.pad(x, [(0, count * rows - n)] + [(0, 0)] * (x.ndim - 1)).reshape(
                (count, rows) + x.shape[1:]
            )
            for x in operands
        ]
        # behind barriers: one block, inlined, compiles as each block of a loop does
        barrier = jax.lax.optimization_barrier
        outs = jax.lax.map(lambda xs: barrier(fn(*barrier(xs))), split)
        return jax.tree.map(lambda y: y.reshape((count * rows,) + y.shape[2:])[:n], outs)

    return blocked


def _exact_f32(x):
    """``x`` as float32 where it is a 16-bit float (exact): a constant of a ``lax.map`` body
    accumulates its cotangent over the blocks in its own dtype."""
    return None if x is None else x.astype(jnp.promote_types(x.dtype, jnp.float32))


def split_entry(hidden, vocab_axes):
    """``hidden`` as float32 (exact), typed as varying over the vocabulary split.

    Each device's ``d_hidden`` is its share ``dz_i·W_i`` of a sum over the split, which jax
    takes as the transpose of the point where ``hidden`` (the same on every device) enters the
    split. Entering in float32, the shares are summed in float32 and rounded to hidden's dtype
    once, after the sum (the head's product is then a float32 GEMM of exact 16-bit values);
    entering in 16 bits, every share and every hop of the sum would be rounded. Outside a
    ``shard_map`` that checks varying axes it is the float32 copy alone."""
    return cast_varying(_exact_f32(hidden), frozenset(vocab_axes))


def token_jnp(
    logits,
    targets,
    row_valid,
    *,
    temperature,
    return_entropy,
    vocab_axes=(),
    n_row_dims=1,
    truncation=None,
    row_block=None,
):
    """``row_block``: the rows in blocks of this many (:func:`_in_row_blocks`; batch-invariant)."""
    per_row = _per_row(targets, n_row_dims, truncation)

    def flat(logits, targets, row_valid):
        z = logits.astype(jnp.float32) / temperature
        return per_row(z, targets, row_valid, return_entropy, vocab_axes)

    return _flat_rows(_in_row_blocks(flat, row_block), n_row_dims, targets, row_valid, logits)


def paired_jnp(
    policy_logits, ref_logits, targets, row_valid, *, temperature, vocab_axes=(), n_row_dims=1
):
    kw = dict(
        temperature=temperature, return_entropy=False, vocab_axes=vocab_axes, n_row_dims=n_row_dims
    )
    logp, _ = token_jnp(policy_logits, targets, row_valid, **kw)
    ref, _ = token_jnp(jax.lax.stop_gradient(ref_logits), targets, row_valid, **kw)
    return logp, ref


def linear_jnp(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    return_entropy,
    vocab_axes=(),
    n_row_dims=1,
    truncation=None,
    row_block=None,
):
    """Log-probs at ``targets`` [*rows] or at K ids per row [*rows, K] (``n_row_dims``
    leading dimensions of ``hidden`` are rows); under a ``truncation`` also whether each
    target is in its row's kept set. ``row_block``: the rows in blocks of this many
    (:func:`_in_row_blocks`; batch-invariant), the head's product then in float32.
    ``vocab_axes``: :func:`split_entry`."""
    per_row = _per_row(targets, n_row_dims, truncation)
    if row_block is not None:
        weight, bias = _exact_f32(weight), _exact_f32(bias)
    if vocab_axes:
        hidden = split_entry(hidden, vocab_axes)

    def flat(hidden, targets, row_valid):
        z = geometry.float32_logits(hidden, weight, bias, weight_layout) / temperature
        return per_row(z, targets, row_valid, return_entropy, vocab_axes)

    return _flat_rows(_in_row_blocks(flat, row_block), n_row_dims, targets, row_valid, hidden)


OPS = {
    "token_logprobs": Whole(token_jnp),
    "paired_logprobs": Whole(paired_jnp),
    "linear_logprobs": Whole(linear_jnp),
}

INVARIANT_OPS = {
    "token_logprobs": Whole(functools.partial(token_jnp, row_block=vocab_chunks.TILE_ROWS)),
    "linear_logprobs": Whole(functools.partial(linear_jnp, row_block=vocab_chunks.TILE_ROWS)),
}
"""The same on blocks of ``vocab_chunks.TILE_ROWS`` rows (:func:`_in_row_blocks`): each
row's results bitwise independent of the other rows."""
