"""No work for rows without a gradient: one device's step run on its kept rows only.

An RL batch is padded (completions end at different lengths) and masked (prompt tokens):
often a third of its rows carry no loss term and no gradient. Their results are fixed by the
contract (0, and a ``d_hidden`` row of exactly 0), so the GEMMs need not see them. A step
whose operands include a per-row keep flag (``row_valid``) is run by :func:`call`:

* the device's rows are put in a stable order, kept rows first (``order``);
* the step runs on the first ``S`` of them, ``S`` the smallest of :func:`bucket_sizes` that
  holds every kept row: one branch of a ``lax.switch`` per size, each with static shapes, so
  the device runs only the chosen branch's kernels (the GEMMs' work falls with the padding,
  in steps of ``1/BUCKETS`` of the rows);
* per-row results come back in the original order, a skipped row's as 0; results laid out
  like the logits (role ``r…v``, ``[N, V_local]``: kept logits, their gradient) stay in the
  kept-first order, zero-padded, and the next step of the same op takes them so (its keep
  flags give the same order). A branch's ``plan.logits_rows`` is N: a kernel that writes such
  a result at N rows itself spares the branch a padded copy (the switch's result is a buffer
  of its own, so a pad would hold two ``[N, V]`` at once).
* operands a step names ``whole`` (laid out like the logits: the fast losses' kept logits
  and their gradient) reach a branch with all N rows, its S rows first: a slice of the first
  S would be a copy, and XLA assigns every branch's copy a buffer when it compiles. So the
  step that writes the logits' gradient over the logits updates the first S rows in place,
  and the backward's GEMMs read them in place (``kept_gemms``).

Skipped rows' contents are never read, so every result is bitwise the same whatever they
hold; where no branch is taken (too few rows, a vocabulary split, batch invariance) the
skipped rows' floating operands are zeroed before the step for the same reason.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BUCKETS = 8
"""Row counts a step may run at: ``ceil(j · N / BUCKETS)`` for ``j = 1 … BUCKETS``, rounded
up to :data:`ROW_QUANTUM` (each is one compiled branch)."""

ROW_QUANTUM = 128
"""A branch's rows are a multiple of this (the GEMM kernels' row tile)."""

MIN_ROWS = 1024
"""Below this many rows per device a step runs on every row (with skipped rows zeroed): the
switch's branches cost compile time and a gather, and the GEMMs there are short."""


def bucket_sizes(n_rows: int) -> tuple[int, ...]:
    """The static row counts a step of ``n_rows`` rows may run at, ascending, the last ``n_rows``."""

    def ceil_div(a, b):
        return -(-a // b)

    sizes = {
        min(n_rows, ceil_div(ceil_div(j * n_rows, BUCKETS), ROW_QUANTUM) * ROW_QUANTUM)
        for j in range(1, BUCKETS + 1)
    }
    return tuple(sorted(sizes))


def _has_rows(role: str) -> bool:
    return role.startswith("r")


def _like_logits(role: str) -> bool:
    """Laid out like the logits: rows and the vocabulary ([N, V_local]), kept in kept-first
    order between the steps of an op."""
    return _has_rows(role) and "v" in role


def _zeroed(x, keep):
    """``x`` [N, ...] with the rows where ``keep`` is False set to 0 (floating ``x`` only)."""
    if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def skips(n_rows: int, plan) -> bool:
    """Whether a step of ``n_rows`` rows on this device runs on its kept rows only."""
    return n_rows >= MIN_ROWS and not plan.vocab_axes


def call(local, plan, operands, roles, out_roles, keep, *, whole=()):
    """``local(plan, *operands)`` (flat rows, ``roles`` as ``vjp.stage``'s) on the rows where
    ``keep`` [N] is True, its present (not None) outputs returned as ``local``'s would be for
    every row (the module docstring); where it :func:`skips` no rows, every row runs, the
    skipped ones zeroed. ``whole``: the indices of operands a branch gets with all N rows (the
    module docstring)."""
    n_rows = keep.shape[0]
    keep = keep.astype(bool)
    if not skips(n_rows, plan):
        ops = [
            x if not _has_rows(r) or _like_logits(r) else _zeroed(x, keep)
            for x, r in zip(operands, roles)
        ]
        return [y for y in local(plan, *ops) if y is not None]
    order = jnp.argsort(~keep, stable=True).astype(jnp.int32)
    count = jnp.sum(keep.astype(jnp.int32))
    # kept rows first; the skipped rows a branch still holds (its size over the count) zeroed
    kept_first = jnp.arange(n_rows) < count
    gathered = [
        x
        if x is None or not _has_rows(r) or _like_logits(r)
        else _zeroed(jnp.take(x, order, axis=0), kept_first)
        for x, r in zip(operands, roles)
    ]

    sizes = bucket_sizes(n_rows)
    # the first size that holds every kept row (no array constant: custom_partitioning,
    # which runs an Auto-sharded step, traces it and takes none)
    branch = sum((count > size).astype(jnp.int32) for size in sizes[:-1])
    branch_plan = dataclasses.replace(plan, logits_rows=n_rows)

    def run_at(size):
        def branch_fn(ops):
            head = [
                x if x is None or not _has_rows(r) or i in whole else _leading(x, size)
                for i, (x, r) in enumerate(zip(ops, roles))
            ]
            outs = [y for y in local(branch_plan, *head) if y is not None]
            return [_padded(y, n_rows) if _has_rows(r) else y for y, r in zip(outs, out_roles)]

        return branch_fn

    outs = jax.lax.switch(branch, [run_at(s) for s in sizes], gathered)
    # per-row results back in the original order; logits-like ones stay kept-first
    inverse = jnp.argsort(order).astype(jnp.int32)
    return [
        jnp.take(y, inverse, axis=0) if _has_rows(r) and not _like_logits(r) else y
        for y, r in zip(outs, out_roles)
    ]


def _padded(y, n_rows):
    """``y`` [S, ...] as [n_rows, ...], zero rows after its own."""
    if y.shape[0] == n_rows:
        return y
    return jnp.pad(y, [(0, n_rows - y.shape[0])] + [(0, 0)] * (y.ndim - 1))


def _leading(x, size):
    """The first ``size`` rows of ``x``."""
    return x[:size]
