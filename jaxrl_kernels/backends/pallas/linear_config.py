"""What tunes the Pallas ``linear_logprobs`` kernels, and what one shape makes of it.

The package's vocabulary (docs/architecture.md): a *Config* is what a caller may set and
holds for every shape (:class:`Config` here, ``ffi.linear.Config``); what
one shape makes of it is a *Launch* for the other Pallas kernels (``pallas.logits.LogitsLaunch``,
``pallas.ppo_kernels.PPOLaunch``) and the C++ ``jaxrl_sm90::Plan`` for the SM90 ones. Here
:func:`fit` plays that part: it shrinks a :class:`TileConfig` to the problem.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel."""

    block_rows: int = 128
    block_vocab: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """What tunes the op; the defaults meet docs/api.md (measured in
    benchmarks/studies/linear_kernels.py ``--sweep``)."""

    forward: TileConfig = TileConfig(128, 256, 64, 8, 4)
    tiles_per_split: int = 4  # vocabulary tiles one forward program walks
    target_rows: int = 16  # rows of one gather-dot program
    target_k: int = 128
    grad: TileConfig = TileConfig()
    chunk_bytes: int = 32 * 2**20  # dz buffers of one backward chunk (head_grad.chunk_columns)
    batch_invariant: bool = False
    """Schedules that do not depend on N: row tiles of ``block_rows`` rows whatever N (not
    shrunk by :func:`fit`), backward chunks of ``head_grad.invariant_chunk_columns`` and
    d_hidden's GEMMs in blocks of ``head_grad.GEMM_ROWS`` rows; each row's results are then
    bitwise independent of the other rows."""


DEFAULT_CONFIG = Config()

INVARIANT_CONFIG = Config(batch_invariant=True)

SMEM_BYTES = 200 * 2**10
"""Shared memory the software pipeline's operand buffers may take (H100: 227 KiB per block)."""


def pow2_block(size: int, extent: int) -> int:
    """``size`` shrunk to the next power of two of ``extent`` but at least 16 (dot minimum)."""
    return max(16, min(size, pl.next_power_of_2(max(extent, 1))))


def fit(
    tiles: TileConfig, n_rows: int, vocab: int, dim: int, itemsize: int, fixed_rows: bool = False
) -> TileConfig:
    """Shrink tiles to the problem, and the pipeline so its num_stages - 1 buffers fit;
    ``fixed_rows``: the row tile stays ``block_rows`` whatever N (batch-invariant)."""
    tiles = dataclasses.replace(
        tiles,
        block_rows=tiles.block_rows if fixed_rows else pow2_block(tiles.block_rows, n_rows),
        block_vocab=pow2_block(tiles.block_vocab, vocab),
        block_k=pow2_block(tiles.block_k, dim),
    )
    per_stage = (tiles.block_rows + tiles.block_vocab) * tiles.block_k * itemsize
    return dataclasses.replace(
        tiles, num_stages=max(1, min(tiles.num_stages, 1 + SMEM_BYTES // per_stage))
    )
