"""A linear head at a few vocabulary ids per row: their logits, and those logits' backward.

For ids ``i`` [N, K] (this device's columns; ``holds`` says which ids this device has)::

    z[n, k]  = (h_n · W[i_nk] + b[i_nk]) / T                  (float32, exact products)
    d_hidden[n]   += Σ_k g[n, k] · W[i_nk] / T
    d_weight[i_nk] += g[n, k] · h_n / T                        (ids repeat: their terms add)
    d_bias[i_nk]   += g[n, k] / T

``N·K·D`` work: the K-id log-probs (``logprob_core.linear_head_op`` with ids) take the row
statistics from a backend's pass over the whole vocabulary and these K logits from here, and
add this backward's terms (the one-hot part of ``d logp_k / dz``) to the backend's dense
backward (the ``−p`` part). Rows are walked in blocks of at most :data:`ID_BLOCK_BYTES` of
gathered weight rows, so no ``[N, K, D]`` array is ever whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import head

ID_BLOCK_BYTES = 64 * 2**20
"""About the most bytes of float32 gathered weight rows ``[rows, K, D]`` one block holds."""


def _block_rows(n_rows: int, k: int, dim: int) -> int:
    return max(1, min(n_rows, ID_BLOCK_BYTES // (4 * k * dim)))


def _gathered(weight, ids, layout):
    """``W[ids]`` as float32 [..., D] (``ids`` any shape)."""
    rows = weight[ids] if layout == "vd" else jnp.moveaxis(weight[:, ids], 0, -1)
    return rows.astype(jnp.float32)


def _row_blocks(n_rows, k, dim, *row_args):
    """``row_args`` (each [N, ...]) as [count, rows, ...] blocks, padded with zeros."""
    size = _block_rows(n_rows, k, dim)
    count = -(-n_rows // size)
    pad = count * size - n_rows
    return [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((count, size) + x.shape[1:])
            for x in row_args]


def _rows_back(blocks, n_rows):
    return blocks.reshape((-1,) + blocks.shape[2:])[:n_rows]


def id_logits(hidden, weight, bias, ids, holds, *, weight_layout, temperature):
    """``z`` [N, K] float32 at ``ids`` [N, K] (0 where not ``holds``)."""
    n_rows, k = ids.shape
    safe = jnp.where(holds, ids, 0)

    def block(args):
        h, i = args
        z = jnp.sum(h.astype(jnp.float32)[:, None, :] * _gathered(weight, i, weight_layout),
                    axis=-1)
        return z if bias is None else z + bias[i].astype(jnp.float32)

    z = _rows_back(jax.lax.map(block, _row_blocks(n_rows, k, hidden.shape[-1], hidden, safe)),
                   n_rows)
    return jnp.where(holds, z if temperature == 1.0 else z / temperature, 0.0)


def id_backward(hidden, weight, bias, ids, holds, g, d_hidden, d_weight, d_bias, *,
                weight_layout, temperature):
    """``(d_hidden, d_weight, d_bias)`` with the terms of cotangents ``g`` [N, K] of the logits
    at ``ids`` added (see the module docstring), in float32; ids not ``holds`` add nothing."""
    n_rows, k = ids.shape
    dim = hidden.shape[-1]
    g = jnp.where(holds, g.astype(jnp.float32), 0.0) / temperature
    safe = jnp.where(holds, ids, 0)
    column = weight_layout == "dv"

    def step(carry, args):
        d_w, d_b = carry
        gb, ib, hb = args
        d_h = jnp.sum(gb[:, :, None] * _gathered(weight, ib, weight_layout), axis=1)
        update = (gb[:, :, None] * hb.astype(jnp.float32)[:, None, :]).reshape(-1, dim)
        flat = ib.reshape(-1)
        d_w = d_w.at[:, flat].add(update.T) if column else d_w.at[flat].add(update)
        if d_b is not None:
            d_b = d_b.at[flat].add(gb.reshape(-1))
        return (d_w, d_b), d_h

    init = (d_weight.astype(jnp.float32),
            None if d_bias is None else d_bias.astype(jnp.float32))
    (d_weight, d_bias), d_h = jax.lax.scan(step, init, _row_blocks(n_rows, k, dim, g, safe,
                                                                   hidden))
    return d_hidden.astype(jnp.float32) + _rows_back(d_h, n_rows), d_weight, d_bias
