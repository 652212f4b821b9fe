"""The ``kept_set`` primitive on whole rows: a CUDA kernel (``csrc/kept_set_kernel.cuh``).

Rows of ``u`` are made in blocks of about :data:`ROW_BLOCK_BYTES` of float32 (``[R, V]``:
the kept logits' rows, or one GEMM of the block's hidden states for a lean head), and one CTA
per row finds its kept set ``{u >= τ}`` (``sampler_math``) in passes over the row. Asked
without ``m`` (a lean head's forward, ``logprob_core``), each block's rows give their own max
and target logit, and the forward runs no statistics pass (what that saves: docs/performance.md,
"Constants and the measurements behind them"). The kernel's passes:

1. min-p only: the row's max (min-p's threshold ``max u + log(min_p)``);
2. per stage (top-k: the count of values ``>= x`` reaches k; top-p: their mass reaches
   ``top_p`` of the mass the stage starts from): a histogram of 2048 bins of the values near
   ``m`` (counts, and masses in 64-bit fixed point, so that the sums do not depend on the
   order of the atomics), then the values of the bin where the target is crossed (with all
   above it where at most 4096) gathered and sorted, which give τ exactly; a bin of more
   values is split again (each split cuts its interval at least 2048-fold);
3. where the gathered values hold the kept set (top-k of a few thousand at most, a nucleus
   inside the gathered ones), its sums come from them; otherwise one pass more sums
   ``exp(u − m)`` and ``exp(u − m)(u − m)`` over ``u >= τ`` (in float64).

So top-k, top-p and both take two passes over a row on most rows (one histogram, one gather),
against the jnp search's candidate pass or ``ceil(32 / 4) + 1`` passes per threshold. The
floor is the midpoint between τ and the largest value below it, as ``kept_set.find``'s.

A vocabulary split over devices (``vocab_axes``) leaves no device a whole row: there the
kept set is ``kept_set.find``'s, its passes' statistics summed across the devices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import sharding
from jaxrl_kernels.formulas.sampler_math import Truncation
from jaxrl_kernels.head import kept_set
from jaxrl_kernels.head.blocks import equal_blocks

TARGET = "jaxrl_kernels_kept_set"  # csrc/ffi_kept_set.cc

MAX_VOCAB = 2**23
"""The most columns of a row the kernel takes (its masses, 2⁴⁰ units each, sum in 64 bits)."""

ROW_BLOCK_BYTES = 256 * 2**20
"""About the float32 bytes of one block of rows of ``u`` (512 rows at V = 131072): larger blocks
mean fewer launches, each waiting for its slowest row, and larger GEMMs (docs/performance.md,
"Constants and the measurements behind them"). The forward holds one block at a time."""


def kept_set_call(u, m, active, trunc: Truncation) -> kept_set.KeptSet:
    """The kernel on rows ``u`` float32 [R, V] (``m`` [R] at least each row's max, ``active``
    [R]): floor, s, a and passes per row, as :class:`kept_set.KeptSet`."""
    n_rows = u.shape[0]
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    call = jax.ffi.ffi_call(
        TARGET,
        (row, row, row, jax.ShapeDtypeStruct((n_rows,), jnp.int32)),
        vmap_method="sequential",
    )
    floor, s, a, passes = call(
        u.astype(jnp.float32),
        m.astype(jnp.float32),
        active.astype(jnp.bool_),
        top_k=np.int64(trunc.top_k or 0),
        top_p=np.float32(1.0 if trunc.top_p is None else trunc.top_p),
        has_min_p=trunc.min_p is not None,
        log_min_p=np.float32(0.0 if trunc.min_p is None else math.log(trunc.min_p)),
    )
    return kept_set.KeptSet(floor, s, a, passes)


@kept_set.finding_row_max
def find_rows(
    logits: kept_set.Logits,
    n_rows: int,
    vocab: int,
    m,
    active,
    trunc: Truncation,
    *,
    vocab_axes=(),
    varying=lambda x: x,
    targets=None,
) -> kept_set.KeptSet:
    """``kept_set.find``'s contract, by :func:`kept_set_call` on blocks of ``logits.rows``.
    ``m=None`` (whole rows, no ``vocab_axes``): each block's max is its rows' own, returned
    with ``targets``' ``u − m`` (``KeptSet.m``, ``KeptSet.target_rel``), so that the caller
    needs no statistics pass for them."""
    if vocab_axes:
        return kept_set.find(
            logits, n_rows, vocab, m, active, trunc, vocab_axes=vocab_axes, varying=varying
        )
    spans = equal_blocks(n_rows, max(1, ROW_BLOCK_BYTES // (4 * vocab)))

    def block(c):
        start = spans.start(c)

        def rows_of(x):
            return jax.lax.dynamic_slice_in_dim(x, start, spans.size)

        u = logits.rows(start, spans.size)
        if m is None:
            found_max = kept_set.row_max_and_target(u, rows_of(targets))
            m_block = found_max[0]
        else:
            m_block, found_max = rows_of(m), ()
        return (
            sharding.kernel_region(
                lambda *a: kept_set_call(*a, trunc).search_fields(), u, m_block, rows_of(active)
            )
            + found_max
        )

    if spans.count == 1:
        return kept_set.KeptSet(*block(0))
    return kept_set.KeptSet(*spans.collect(jax.lax.map(block, jnp.arange(spans.count)), n_rows))


def declines(primitive: str, problem) -> str | None:
    """Rows of at most :data:`MAX_VOCAB` columns (any dtype and layout: the caller makes the
    float32 rows)."""
    if problem.vocab > MAX_VOCAB:
        return f"kept_set: V = {problem.vocab} columns a device, the kernel takes at most 2^23"
    return None


OPS = {"kept_set": find_rows}
