"""The chunked backend's log-probs (of given logits, of a linear head): jnp walking the
vocabulary in chunks.

No float32 [N, V] buffer is ever live: the forward scans vocabulary chunks of
about :data:`CHUNK_BYTES` with the online softmax of ``softmax_math``; the backward scans
them again, recomputing each chunk's softmax from the saved per-row lse. These
are the two ``logprob_core.Parts`` of each op; ``logprob_core`` holds the
custom_vjp and the sharding. ``vocab_chunks`` says how chunks cover the vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import head, head_ids, softmax_math, vocab_chunks
from jaxrl_kernels.logprob_core import Parts

CHUNK_BYTES = 4 * 2**20
"""Target size of one float32 [N, chunk] tile."""


def _scan_chunks(body, init, n_rows: int, vocab: int):
    """``vocab_chunks.scan_chunks`` in chunks of :data:`CHUNK_BYTES`."""
    return vocab_chunks.scan_chunks(body, init, n_rows, vocab, CHUNK_BYTES)


def _softmax_stats(z_chunks, n_rows, vocab, targets, with_entropy):
    """One pass over the vocabulary for several logit streams sharing ``targets``.

    ``z_chunks(start, size)`` gives a tuple of float32 [N, size] tiles.
    Returns, per stream, ``(stats, lse, entropy | None, target_z)``.
    """
    n_streams = len(jax.eval_shape(lambda: z_chunks(0, 1)))
    init = tuple((softmax_math.online_softmax_init((n_rows,), with_entropy),
                  jnp.zeros((n_rows,), jnp.float32)) for _ in range(n_streams))

    def body(carry, start, cols, fresh, size):
        is_target = (cols[None, :] == targets[:, None]) & fresh
        out = []
        for (stats, target_z), z in zip(carry, z_chunks(start, size)):
            z = jnp.where(fresh, z, -jnp.inf)
            stats = softmax_math.online_softmax_update(stats, z)
            target_z = target_z + jnp.sum(jnp.where(is_target, z, 0.0), axis=-1)
            out.append((stats, target_z))
        return tuple(out)

    final = _scan_chunks(body, init, n_rows, vocab)
    return [(stats, *softmax_math.online_softmax_finalize(stats), target_z) for stats, target_z in final]


def _relative(stats, target_z):
    """``(m, s, a | None, z_target − m)``: the per-row statistics of ``logprob_core``."""
    a = stats[2] if len(stats) == 3 else None
    return stats[0], stats[1], a, target_z - stats[0]


# -- log-probs from logits ---------------------------------------------------------------

def _logits_chunk(logits, temperature):
    def chunk(start, size):
        tile = jax.lax.dynamic_slice_in_dim(logits, start, size, axis=1)
        return tile.astype(jnp.float32) / temperature
    return chunk


def token_stats(logits, targets, row_valid, *, temperature, with_entropy):
    n_rows, vocab = logits.shape
    [(stats, _, _, target_z)] = _softmax_stats(
        lambda s, n: (_logits_chunk(logits, temperature)(s, n),), n_rows, vocab, targets,
        with_entropy)
    return _relative(stats, target_z)


def paired_stats(policy_logits, ref_logits, targets, row_valid, *, temperature):
    n_rows, vocab = policy_logits.shape
    policy_chunk = _logits_chunk(policy_logits, temperature)
    ref_chunk = _logits_chunk(ref_logits, temperature)
    streams = _softmax_stats(lambda s, n: (policy_chunk(s, n), ref_chunk(s, n)), n_rows, vocab,
                             targets, False)
    return tuple(_relative(stats, target_z) for stats, _, _, target_z in streams)


def token_backward(logits, targets, lse, entropy, g_logp, g_ent, *, temperature, floor=None):
    """d loss / d logits, written chunk by chunk into one buffer of the logits' dtype
    (``floor``: the kept set's, ``softmax_math.logprob_grad_tile``)."""
    n_rows, vocab = logits.shape
    z_chunk = _logits_chunk(logits, temperature)

    def body(d_logits, start, cols, fresh, size):
        is_target = cols[None, :] == targets[:, None]
        dz = softmax_math.logprob_grad_tile(z_chunk(start, size), lse, entropy, is_target, g_logp,
                                            g_ent, temperature, floor).astype(d_logits.dtype)
        old = jax.lax.dynamic_slice_in_dim(d_logits, start, size, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(d_logits, jnp.where(fresh, dz, old), start, 1)

    return _scan_chunks(body, jnp.zeros_like(logits), n_rows, vocab)


# -- log-probs of a linear head -----------------------------------------------------------

def linear_stats(hidden, weight, bias, targets, row_valid, *, weight_layout, temperature,
                 with_entropy):
    n_rows = hidden.shape[0]
    vocab = head.vocab_size(weight, weight_layout)
    z_chunk = vocab_chunks.linear_chunk(hidden, weight, bias, weight_layout, temperature)
    [(stats, _, _, target_z)] = _softmax_stats(lambda s, n: (z_chunk(s, n),), n_rows, vocab,
                                               targets, with_entropy)
    return _relative(stats, target_z)


def linear_backward(hidden, weight, bias, targets, lse, entropy, g_logp, g_ent, *,
                    weight_layout, temperature, floor=None):
    """(d_hidden, d_weight, d_bias | None) from per-row cotangents, chunk by chunk.

    For each vocabulary chunk: dz = d loss/d logits (float32), then
    d_hidden += dz · W_c, d_W_c = dzᵀ · hidden, d_b_c = Σ_rows dz, in float32. ``targets``
    and ``g_logp`` [N, K]: K ids per row (``head_ids.split_targets``); ``floor``: the kept
    set's (``softmax_math.logprob_grad_tile``).
    """
    targets, g_logp, ids, g_ids = head_ids.split_targets(targets, g_logp)
    n_rows, vocab = hidden.shape[0], head.vocab_size(weight, weight_layout)
    z_chunk = vocab_chunks.linear_chunk(hidden, weight, bias, weight_layout, temperature)
    hidden32 = hidden.astype(jnp.float32)
    hi = head.matmul_precision(jnp.float32)

    def body(carry, start, cols, fresh, size):
        d_hidden, d_weight, d_bias = carry
        is_target = cols[None, :] == targets[:, None]
        dz = softmax_math.logprob_grad_tile(z_chunk(start, size), lse, entropy, is_target, g_logp,
                                            g_ent, temperature, floor)
        if ids is not None:
            dz = head_ids.add_id_grads(dz, ids, g_ids / temperature, start)
        dz = jnp.where(fresh, dz, 0.0)
        w = head.vocab_slice(weight, start, size, weight_layout).astype(jnp.float32)
        d_hidden = d_hidden + head.hidden_grad(dz, w, weight_layout, precision=hi)
        d_w = head.weight_grad(dz, hidden32, weight_layout, precision=hi)
        d_weight, d_bias = vocab_chunks.accumulate_chunk(d_weight, d_bias, d_w, dz, start,
                                                         fresh, size, weight_layout)
        return d_hidden, d_weight, d_bias

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros_like(weight),
            None if bias is None else jnp.zeros((vocab,), jnp.float32))
    d_hidden, d_weight, d_bias = _scan_chunks(body, init, n_rows, vocab)
    return (d_hidden.astype(hidden.dtype), d_weight,
            None if bias is None else d_bias.astype(bias.dtype))


OPS = {
    "token_logprobs": Parts(token_stats, token_backward),
    "paired_logprobs": Parts(paired_stats, token_backward),
    "linear_logprobs": Parts(linear_stats, linear_backward),
    "linear_logprobs_backward": linear_backward,
}
