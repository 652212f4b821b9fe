"""The chunked backend's log-probs (of given logits, of a linear head): jnp walking the
vocabulary in chunks.

No float32 [N, V] buffer is ever live: the forward scans vocabulary chunks of
about :data:`CHUNK_BYTES` with the online softmax of ``softmax_math``; the backward scans
them again, recomputing each chunk's softmax from the saved per-row lse. These
are the two ``logprob_core.Parts`` of each op; ``logprob_core`` holds the
custom_vjp and the sharding. ``vocab_chunks`` says how tiles cover the rows and the
vocabulary: by default all rows at once in chunks sized by N; batch-invariant
(:data:`INVARIANT_OPS`), blocks of ``vocab_chunks.TILE_ROWS`` rows in chunks sized by V and D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry, head_ids, vocab_chunks

CHUNK_BYTES = 4 * 2**20
"""Target size of one float32 tile: [N, chunk], or [TILE_ROWS, chunk] when batch-invariant
(``vocab_chunks.tiling``)."""


def _tiling(n_rows: int, vocab: int, batch_invariant: bool, dim: int = 0):
    return vocab_chunks.tiling(n_rows, vocab, CHUNK_BYTES, dim=dim, batch_invariant=batch_invariant)


def _softmax_stats(z_tiles, n_streams, targets, tiles, with_entropy):
    """One pass over the vocabulary for several logit streams sharing ``targets`` (padded to
    ``tiles.rows.n``), tile by tile.

    ``z_tiles(r0, start, size)`` gives a tuple of float32 [rows, size] tiles, one per stream,
    of the row block at ``r0``. Returns, per stream, ``(stats, target_z)`` over
    ``tiles.rows.n`` rows.
    """
    init = tuple(
        (
            softmax_math.online_softmax_init((tiles.rows.n,), with_entropy),
            jnp.zeros((tiles.rows.n,), jnp.float32),
        )
        for _ in range(n_streams)
    )

    def tile(carry, _, r0, fresh_rows, start, cols, fresh_cols, size):
        inputs = (
            z_tiles(r0, start, size),
            tiles.read(targets, r0),
            jax.tree.map(lambda x: tiles.read(x, r0), carry),
        )
        z_all, t, states = tiles.isolate(inputs)
        is_target = (cols[None, :] == t[:, None]) & fresh_cols
        new = []
        for (stats, target_z), z in zip(states, z_all):
            z = jnp.where(fresh_cols, z, -jnp.inf)
            stats = softmax_math.online_softmax_update(stats, z)
            new.append((stats, target_z + jnp.sum(jnp.where(is_target, z, 0.0), axis=-1)))
        new = tiles.isolate(tuple(new))
        return jax.tree.map(lambda x, y: tiles.write(x, y, r0, fresh_rows), carry, new), None

    return vocab_chunks.scan_tiles(tile, init, tiles)


def _relative(stats, target_z, n_rows):
    """``(m, s, a | None, z_target − m)`` of the first ``n_rows`` rows: the per-row statistics
    of ``logprob_core``."""
    stats, target_z = jax.tree.map(lambda x: x[:n_rows], (stats, target_z))
    a = stats[2] if len(stats) == 3 else None
    return stats[0], stats[1], a, target_z - stats[0]


# -- log-probs from logits ---------------------------------------------------------------


def _logits_tile(logits, temperature, rows: int):
    """``tile(r0, start, size)``: float32 ``logits[r0:r0 + rows, start:start + size] / T``."""

    def tile(r0, start, size):
        x = jax.lax.dynamic_slice(logits, (r0, start), (rows, size))
        return x.astype(jnp.float32) / temperature

    return tile


def token_stats(logits, targets, row_valid, *, temperature, with_entropy, batch_invariant=False):
    n_rows, vocab = logits.shape
    tiles = _tiling(n_rows, vocab, batch_invariant)
    z_tile = _logits_tile(tiles.pad(logits), temperature, tiles.rows.size)
    [(stats, target_z)] = _softmax_stats(
        lambda *a: (z_tile(*a),), 1, tiles.pad(targets), tiles, with_entropy
    )
    return _relative(stats, target_z, n_rows)


def paired_stats(
    policy_logits, ref_logits, targets, row_valid, *, temperature, batch_invariant=False
):
    n_rows, vocab = policy_logits.shape
    tiles = _tiling(n_rows, vocab, batch_invariant)
    policy_tile = _logits_tile(tiles.pad(policy_logits), temperature, tiles.rows.size)
    ref_tile = _logits_tile(tiles.pad(ref_logits), temperature, tiles.rows.size)
    streams = _softmax_stats(
        lambda *a: (policy_tile(*a), ref_tile(*a)), 2, tiles.pad(targets), tiles, False
    )
    return tuple(_relative(stats, target_z, n_rows) for stats, target_z in streams)


def token_backward(
    logits, targets, lse, entropy, g_logp, g_ent, *, temperature, floor=None, batch_invariant=False
):
    """d loss / d logits, written tile by tile into one buffer of the logits' dtype
    (``floor``: the kept set's, ``softmax_math.logprob_grad_tile``)."""
    n_rows, vocab = logits.shape
    tiles = _tiling(n_rows, vocab, batch_invariant)
    logits, targets, lse = tiles.pad(logits), tiles.pad(targets), tiles.pad(lse, jnp.inf)
    entropy, g_logp, g_ent, floor = map(tiles.pad, (entropy, g_logp, g_ent, floor))
    z_tile = _logits_tile(logits, temperature, tiles.rows.size)

    def tile(d_logits, _, r0, fresh_rows, start, cols, fresh_cols, size):
        z, t, lse_, ent, g, g_e, floor_ = tiles.isolate(
            (z_tile(r0, start, size),)
            + tuple(tiles.read(x, r0) for x in (targets, lse, entropy, g_logp, g_ent, floor))
        )
        dz = softmax_math.logprob_grad_tile(
            z, lse_, ent, cols[None, :] == t[:, None], g, g_e, temperature, floor_
        ).astype(d_logits.dtype)
        dz = tiles.isolate(dz)
        old = jax.lax.dynamic_slice(d_logits, (r0, start), dz.shape)
        dz = jnp.where(fresh_rows[:, None] & fresh_cols[None, :], dz, old)
        return jax.lax.dynamic_update_slice(d_logits, dz, (r0, start)), None

    return vocab_chunks.scan_tiles(tile, jnp.zeros_like(logits), tiles)[:n_rows]


# -- log-probs of a linear head -----------------------------------------------------------


def _head_tile(hidden, weight, bias, weight_layout, temperature, tiles):
    """``tile(r0, start, size)``: the float32 logits [rows, size] of the row block of
    ``hidden`` at ``r0`` and the head's columns ``[start, start + size)``."""

    def tile(r0, start, size):
        chunk = vocab_chunks.linear_chunk(
            tiles.read(hidden, r0), weight, bias, weight_layout, temperature
        )
        return chunk(start, size)

    return tile


def linear_stats(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    with_entropy,
    batch_invariant=False,
):
    n_rows, dim = hidden.shape
    tiles = _tiling(n_rows, geometry.vocab_size(weight, weight_layout), batch_invariant, dim)
    z_tile = _head_tile(tiles.pad(hidden), weight, bias, weight_layout, temperature, tiles)
    [(stats, target_z)] = _softmax_stats(
        lambda *a: (z_tile(*a),), 1, tiles.pad(targets), tiles, with_entropy
    )
    return _relative(stats, target_z, n_rows)


def linear_backward(
    hidden,
    weight,
    bias,
    targets,
    lse,
    entropy,
    g_logp,
    g_ent,
    *,
    weight_layout,
    temperature,
    floor=None,
    batch_invariant=False,
):
    """(d_hidden, d_weight, d_bias | None) from per-row cotangents, tile by tile.

    For each vocabulary chunk and in it each row block: dz = d loss/d logits (float32),
    d_hidden[rows] += dz · W_c, and the chunk's d_W_c += dzᵀ · hidden[rows] and
    d_b_c += Σ_rows dz, in float32, written into d_weight and d_bias after the chunk's last
    row block. ``targets`` and ``g_logp`` [N, K]: K ids per row (``head_ids.split_targets``);
    ``floor``: the kept set's (``softmax_math.logprob_grad_tile``).
    """
    targets, g_logp, ids, g_ids = head_ids.split_targets(targets, g_logp)
    n_rows, dim = hidden.shape
    vocab = geometry.vocab_size(weight, weight_layout)
    tiles = _tiling(n_rows, vocab, batch_invariant, dim)
    targets, lse = tiles.pad(targets), tiles.pad(lse, jnp.inf)
    entropy, g_logp, g_ent, floor, ids, g_ids = map(
        tiles.pad, (entropy, g_logp, g_ent, floor, ids, g_ids)
    )
    hidden32 = tiles.pad(hidden.astype(jnp.float32))
    z_tile = _head_tile(tiles.pad(hidden), weight, bias, weight_layout, temperature, tiles)
    hi = geometry.matmul_precision(jnp.float32)

    def open_chunk(start, size):
        w = geometry.vocab_slice(weight, start, size, weight_layout).astype(jnp.float32)
        return w, jnp.zeros(w.shape, jnp.float32), jnp.zeros((size,), jnp.float32)

    def tile(carry, acc, r0, fresh_rows, start, cols, fresh_cols, size):
        (d_hidden, *rest), (w, d_w, d_b) = carry, acc
        row = functools.partial(tiles.read, r0=r0)
        z, t, lse_, ent, g, g_e, floor_ = tiles.isolate(
            (z_tile(r0, start, size),)
            + tuple(map(row, (targets, lse, entropy, g_logp, g_ent, floor)))
        )
        dz = softmax_math.logprob_grad_tile(
            z, lse_, ent, cols[None, :] == t[:, None], g, g_e, temperature, floor_
        )
        if ids is not None:
            dz = head_ids.add_id_grads(dz, row(ids), row(g_ids) / temperature, start)
        dz = tiles.isolate(jnp.where(fresh_rows[:, None] & fresh_cols[None, :], dz, 0.0))
        d_h = row(d_hidden) + geometry.hidden_grad(dz, w, weight_layout, precision=hi)
        d_w = d_w + geometry.weight_grad(dz, row(hidden32), weight_layout, precision=hi)
        return (
            (tiles.write(d_hidden, d_h, r0, fresh_rows), *rest),
            (w, d_w, d_b + jnp.sum(dz, axis=0)),
        )

    def close_chunk(carry, acc, start, fresh_cols, size):
        d_hidden, d_weight, d_bias = carry
        _, d_w, d_b = acc
        old = geometry.vocab_slice(d_weight, start, size, weight_layout)
        d_w = jnp.where(
            geometry.per_column(fresh_cols, weight_layout), d_w.astype(d_weight.dtype), old
        )
        d_weight = geometry.vocab_update(d_weight, d_w, start, weight_layout)
        if d_bias is not None:
            old_b = jax.lax.dynamic_slice_in_dim(d_bias, start, size)
            d_bias = jax.lax.dynamic_update_slice_in_dim(
                d_bias, jnp.where(fresh_cols, d_b, old_b), start, 0
            )
        return d_hidden, d_weight, d_bias

    init = (
        jnp.zeros(hidden32.shape, jnp.float32),
        jnp.zeros_like(weight),
        None if bias is None else jnp.zeros((vocab,), jnp.float32),
    )
    d_hidden, d_weight, d_bias = vocab_chunks.scan_tiles(
        tile, init, tiles, open_chunk=open_chunk, close_chunk=close_chunk
    )
    return (
        d_hidden[:n_rows],
        d_weight,
        None if bias is None else d_bias.astype(bias.dtype),
    )


OPS = {
    "token_logprobs": Parts(token_stats, token_backward),
    "paired_logprobs": Parts(paired_stats, token_backward),
    "linear_logprobs": Parts(linear_stats, linear_backward),
    "linear_logprobs_backward": linear_backward,
}


def _invariant(fn):
    return functools.partial(fn, batch_invariant=True)


INVARIANT_OPS = {
    "token_logprobs": Parts(_invariant(token_stats), _invariant(token_backward)),
    "linear_logprobs": Parts(_invariant(linear_stats), _invariant(linear_backward)),
    "linear_logprobs_backward": _invariant(linear_backward),
}
"""The same in [TILE_ROWS, chunk] tiles whose shape does not depend on N
(``vocab_chunks.tiling``): each row's results are bitwise independent of the other rows."""
