"""Each row's kept set under a sampler's truncation, found in passes over the vocabulary.

The kept set is ``{u >= τ}`` (``sampler_math``); ``τ`` is found without an ``[N, V]``
buffer. This module is the ``kept_set`` primitive in plain jnp (the reference backend's; the
ffi backend's is a CUDA kernel on whole rows, ``backends/ffi/kept_set.py``), on a device's
:class:`Logits`. Each pass walks the vocabulary in chunks of ``u`` (recomputed, or read from
kept logits) and takes, per row and for each of ``P + 1`` pivot keys ``x`` (``sampler_math.
float_key``)::

    count(x) = #{u >= x},   mass(x) = Σ_{u >= x} e,   ent(x) = Σ_{u >= x} e·(u − m)
    below(x) = the largest key < x, with the count, mass and ent of the entries equal to it

(``e = exp(u − m)``, ``m`` at least the row max), summed over a vocabulary split. A threshold is "the
largest value ``x`` with ``F(x) >= target``" for ``F`` the count (top-k, target k) or the
mass (top-p, target ``top_p · mass(τ_k)``), searched in an interval of keys ``[lo, hi)``
with ``F(lo) >= target > F(hi)``: the pivots split it into ``P`` parts; the last pivot ``x_q``
with ``F(x_q) >= target`` and the next one ``x_{q+1}`` bound it anew, and the largest value
below ``x_{q+1}`` is the threshold when ``F`` reaches the target there (found in this pass),
else its key is the new ``hi``. A pass cuts the interval ``P``-fold or ends the search, so a
row takes at most ``ceil(32 / log2 P) + 1`` passes per threshold (a few on a peaked row).
One pass more, at ``τ`` itself, gives the kept set's ``mass`` and ``ent`` and the largest
value below ``τ``: the gradient's floor is the midpoint between the two, so that a backward
recomputing the logits with other rounding keeps the same tokens.

Stages of a row: top-k (if asked), top-p (if asked), the pass at ``τ``, done. min-p needs no
search: its threshold is ``max u + log(min_p)`` (the max from a pass of its own), where
top-k's search starts.

With top-k (the usual sampler), one pass does it all: each row's ``k + 1 + 32`` largest
values (``lax.top_k`` per chunk, merged) hold the max (min-p's threshold), the k-th value,
every value top-p can keep, the value below the kept set and so the floor, exactly; only a
row whose candidates are all kept (values tied with the last may lie beyond them) goes
through the pivot search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_kernels.formulas import divergence_math, sampler_math
from jaxrl_kernels.formulas.sampler_math import Truncation
from jaxrl_kernels.head import vocab_chunks

# The pivot search and the kept set's type, shared with the entry below and re-exported
# (``kept_set.KeptSet``, ``kept_set.search``): kept_set_search's docstring.
from jaxrl_kernels.head.kept_set_search import KeptSet, search
from jaxrl_kernels.sharding.vma import varying_like


@dataclasses.dataclass(frozen=True)
class Logits:
    """One device's float32 ``u`` [N, V_local] (the logits divided by the temperature), made
    on demand and never held whole: ``columns(start, size)`` -> [N, size] and
    ``rows(start, size)`` -> [size, V_local]."""

    columns: Callable[..., jax.Array]
    rows: Callable[..., jax.Array]

    @staticmethod
    def of_array(x, temperature: float = 1.0) -> Logits:
        """float32 ``x / temperature`` of an array ``x`` [N, V_local] (columns or rows of it)."""

        def part(axis):
            def slice_(start, size):
                y = jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)
                return y.astype(jnp.float32) / temperature

            return slice_

        return Logits(columns=part(1), rows=part(0))


def finding_row_max(find):
    """Marks a ``kept_set`` implementation on whole rows that also takes ``m=None`` with
    ``targets=``: it then takes each row's max and target from the rows it makes
    (``KeptSet.m``, ``KeptSet.target_rel``), and a truncated forward needs no statistics pass
    of its own."""
    find.finds_row_max = True
    return find


def finds_row_max(find) -> bool:
    """Whether ``find`` (a ``kept_set`` implementation) was marked by :func:`finding_row_max`."""
    return getattr(find, "finds_row_max", False)


def row_max_and_target(u, targets):
    """Each row's max of whole rows ``u`` [R, V] and ``u − max`` at its target ``targets`` [R]
    (``KeptSet.m``, ``KeptSet.target_rel``; ids outside ``[0, V)`` read a clipped column: the
    caller masks them)."""
    m = jnp.max(u, axis=1)
    t = jnp.clip(targets, 0, u.shape[1] - 1)
    return m, jnp.take_along_axis(u, t[:, None], axis=1)[:, 0] - m


def find(
    logits: Logits,
    n_rows: int,
    vocab: int,
    m,
    active,
    trunc: Truncation,
    *,
    vocab_axes=(),
    varying=lambda x: x,
) -> KeptSet:
    """The kept set of each row of ``u`` (this device's columns, read by
    ``logits.columns``); ``m`` [N] any value ``>= max u`` over the whole vocabulary (the max,
    or a backend's lse); rows not ``active`` get no search (their results are unused).
    ``varying``: gives a pass's carry the device variance of the operands
    (``vma.varying_like``) inside ``shard_map``.

    With top-k (k below the vocabulary and at most :data:`MAX_CANDIDATES`): one pass for each
    row's ``k + 1 +`` :data:`CANDIDATE_SLACK` largest values (:func:`_from_candidates`), the
    pivot search (:func:`search`) only for rows it leaves open; else the pivot search."""
    u_chunks = logits.columns
    shards = jax.lax.psum(1, vocab_axes) if vocab_axes else 1
    k = trunc.top_k
    if k is None or k >= vocab * shards or k > MAX_CANDIDATES:
        return search(
            u_chunks, n_rows, vocab, m, active, trunc, vocab_axes=vocab_axes, varying=varying
        )
    values = _candidates(
        u_chunks, n_rows, vocab, min(k + 1 + CANDIDATE_SLACK, vocab * shards), vocab_axes, varying
    )
    found, open_rows = _from_candidates(values, m, trunc)
    open_rows = open_rows & active

    # both branches typed with the per-row values' device variance (a shard_map's cond
    # needs equal types; a constant field would otherwise be invariant in one branch only)
    def typed(xs):
        return tuple(varying_like(x, m, open_rows) for x in xs)

    fields = found.search_fields()

    def searched(_):
        other = search(
            u_chunks, n_rows, vocab, m, open_rows, trunc, vocab_axes=vocab_axes, varying=varying
        )
        return typed(jnp.where(open_rows, b, a) for a, b in zip(fields, other.search_fields()))

    return KeptSet(*jax.lax.cond(jnp.any(open_rows), searched, lambda _: typed(fields), None))


MAX_CANDIDATES = 1024
"""The largest top-k whose kept set comes from a pass of candidates (``lax.top_k``)."""

CANDIDATE_SLACK = 32
"""Candidates beyond ``k + 1``: room for values tied with the k-th (16-bit kept logits tie
often), whose rows would otherwise go through the pivot search."""

CANDIDATE_CHUNK_BYTES = 128 * 2**20
"""About the float32 bytes of one ``[N, chunk]`` tile of the candidates' pass."""


def _candidates(u_chunks, n_rows, vocab, c, vocab_axes, varying):
    """Each row's ``c`` largest values over the whole vocabulary, in decreasing order (one
    pass: each chunk's ``lax.top_k`` merged into the running ones; shards' merged after)."""
    c_local = min(c, vocab)

    def body(top, start, cols, fresh, size):
        chunk = jnp.where(fresh, u_chunks(start, size), -jnp.inf)
        best = jax.lax.top_k(chunk, min(c_local, size))[0]
        return jax.lax.top_k(jnp.concatenate([top, best], axis=1), c_local)[0]

    init = varying(jnp.full((n_rows, c_local), -jnp.inf, jnp.float32))
    top = vocab_chunks.scan_chunks(body, init, n_rows, vocab, CANDIDATE_CHUNK_BYTES)
    if vocab_axes:
        top, _ = divergence_math.topk_across_shards(
            top, jnp.zeros(top.shape, jnp.int32), c, vocab_axes
        )
    return top


def _from_candidates(v, m, trunc):
    """The kept set of each row from its ``c > k`` largest values ``v`` [N, c] (sorted,
    decreasing), and which rows they leave open (every candidate kept: values equal to the
    last may lie beyond them)."""
    c = v.shape[1]
    keep = v >= v[:, trunc.top_k - 1 : trunc.top_k]
    if trunc.min_p is not None:
        keep &= v >= sampler_math.min_p_floor(v[:, :1], trunc.min_p)
    shifted = v - m[:, None]
    e = jnp.where(keep, jnp.exp(shifted), 0.0)
    if trunc.top_p is not None:
        above = jnp.cumsum(e, axis=-1) - e
        # Equal values share the mass above the first of them.
        first = jax.vmap(lambda row: jnp.searchsorted(-row, -row, side="left"))(v)
        above = jnp.take_along_axis(above, first, axis=-1)
        keep &= above < trunc.top_p * jnp.sum(e, axis=-1, keepdims=True)
        e = jnp.where(keep, e, 0.0)
    n_kept = jnp.sum(keep, axis=-1)
    rows = jnp.arange(v.shape[0])
    tau = v[rows, n_kept - 1]
    gap = v[rows, jnp.minimum(n_kept, c - 1)]
    mid = gap + (tau - gap) * 0.5
    mid = jnp.where(mid > gap, mid, tau)  # adjacent floats: τ itself
    floor = jnp.where(gap == -jnp.inf, -jnp.inf, mid)
    found = KeptSet(
        floor,
        jnp.sum(e, axis=-1),
        jnp.sum(jnp.where(keep, e * shifted, 0.0), axis=-1),
        jnp.ones(n_kept.shape, jnp.int32),
    )
    return found, n_kept >= c
