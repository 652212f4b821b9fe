"""The Pallas statistics kernel with its softmax epilogue cut to a running max (measurement only).

The same grid, tiles and GEMM loop as ``linear_kernels.stats_call`` (``walk_split``), but each
logit tile only updates the row max: no exp, no sums. Timed beside the real kernel
(``studies.linear_kernels --sweep``, ``--profile``), the difference is what the softmax epilogue costs;
its outputs are not log-probs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.backends.pallas import linear_kernels as kernels
from jaxrl_kernels.head import geometry


def _max_kernel(h_ref, w_ref, out_ref, **walk):
    bm = walk["tiles"].block_rows
    row0, split, m = kernels.walk_split(
        lambda m, z: jnp.maximum(m, jnp.max(z, axis=-1)),
        jnp.full((bm,), -jnp.inf, jnp.float32),
        h_ref,
        w_ref,
        None,
        scale=1.0,
        **walk,
    )
    kernels.store_split(out_ref, split, row0, m, n_rows=walk["n_rows"], block_rows=bm)


def max_call(hidden, weight, *, layout, config):
    """[S, N] row maxima of the logits (no bias, temperature 1) per vocabulary split, on the
    statistics kernel's grid and tiles under ``config`` (a ``pallas.linear.Config``)."""
    n_rows, dim = hidden.shape
    tiles, n_splits = kernels.forward_tiles(config, hidden, weight, layout)
    kernel = functools.partial(
        _max_kernel,
        n_rows=n_rows,
        vocab=geometry.vocab_size(weight, layout),
        dim=dim,
        tiles=tiles,
        tiles_per_split=config.tiles_per_split,
        layout=layout,
        compute_dtype=jnp.result_type(hidden, weight),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n_splits, n_rows), jnp.float32),
        grid=(pl.cdiv(n_rows, tiles.block_rows), n_splits),
        compiler_params=common.compiler_params(tiles.num_warps, tiles.num_stages),
        interpret=common.interpret(),
        name="linear_logprobs_stats_max_only",
    )(hidden, weight)


def stats_call(hidden, weight, *, layout, config):
    """The real statistics kernel under the same conditions (logp only, no bias, T = 1)."""
    return kernels.stats_call(
        hidden, weight, None, layout=layout, scale=1.0, with_entropy=False, config=config
    )
