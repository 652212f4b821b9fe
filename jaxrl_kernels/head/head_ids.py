"""A linear head at K vocabulary ids per row: their logits, and their one-hot gradient.

For ids ``i`` [N, K] (this device's columns; ``holds`` says which ids this device has)::

    z[n, k] = (h_n · W[i_nk] + b[i_nk]) / T            (float32, exact products)

is ``N·K·D`` work, walked in row blocks of at most :data:`ID_BLOCK_BYTES` of gathered weight
rows (no ``[N, K, D]`` array is ever whole). The K-id log-probs
(``engine.linear_head.linear_head_op`` with ids) take each row's statistics from a backend's pass
over the whole vocabulary and these K logits from here. Their backward is the backend's, with
``d logp_k / dz = onehot_k − p``: the ``−p`` part with the row coefficient ``Σ_k g_k``
(:func:`split_targets`), the one-hot part added to each vocabulary chunk's logit gradient
before its GEMMs (:func:`add_id_grads`; the SM90 backward in its own kernel), so the K ids
cost no GEMM and no pass over the weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    return [
        jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((count, size) + x.shape[1:])
        for x in row_args
    ]


def _rows_back(blocks, n_rows):
    return blocks.reshape((-1,) + blocks.shape[2:])[:n_rows]


def id_logits(hidden, weight, bias, ids, holds, *, weight_layout, temperature):
    """``z`` [N, K] float32 at ``ids`` [N, K] (0 where not ``holds``)."""
    n_rows, k = ids.shape
    safe = jnp.where(holds, ids, 0)

    def block(args):
        h, i = args
        z = jnp.sum(
            h.astype(jnp.float32)[:, None, :] * _gathered(weight, i, weight_layout), axis=-1
        )
        return z if bias is None else z + bias[i].astype(jnp.float32)

    z = _rows_back(
        jax.lax.map(block, _row_blocks(n_rows, k, hidden.shape[-1], hidden, safe)), n_rows
    )
    return jnp.where(holds, z if temperature == 1.0 else z / temperature, 0.0)


def split_targets(targets, g):
    """A backward's targets and cotangents as ``(row_targets [N], row_g [N], ids, g_ids)``:
    one target per row (``targets`` [N]): themselves and ``ids = g_ids = None``; K ids per
    row (``targets``, ``g`` [N, K]): no row target (−1), ``row_g = Σ_k g_k`` (the ``−p``
    part of ``d logp_k / dz = onehot_k − p``) and the ids with their cotangents (the one-hot
    part, :func:`add_id_grads`)."""
    if targets.ndim == 1:
        return targets, g, None, None
    return (jnp.full(targets.shape[:1], -1, jnp.int32), jnp.sum(g, axis=-1), targets, g)


def add_id_grads(dz, ids, coef, start):
    """``dz`` [N, size], the logit gradient of the columns ``[start, start + size)``, with
    ``coef`` [N, K] added at the columns ``ids`` [N, K] (ids outside the chunk add nothing; an
    id listed twice adds twice), in ``dz``'s dtype."""
    size = dz.shape[1]
    at = ids - start
    at = jnp.where((at >= 0) & (at < size), at, size)  # size: out of bounds, dropped
    rows = jnp.broadcast_to(jnp.arange(dz.shape[0])[:, None], ids.shape)
    return dz.at[rows, at].add(coef.astype(dz.dtype), mode="drop")
