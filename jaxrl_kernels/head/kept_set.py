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
from jaxrl_kernels.formulas.sampler_math import KEY_NONE, Truncation, float_key, key_value
from jaxrl_kernels.head import vocab_chunks
from jaxrl_kernels.sharding.vma import varying_like

PIVOTS = 16
"""Pivots per pass (P): each pass cuts a row's interval of keys 16-fold."""

CHUNK_BYTES = 16 * 2**20
"""About the float32 bytes of one ``[N, chunk]`` tile of ``u`` per pass."""

MAX_PASSES = 3 * (32 // 4 + 2) + 2
"""More passes than two searches (one restarted), the max and the final pass can take (a
guard, never reached)."""

TOP_K, TOP_P, AT_TAU, DONE = 0, 1, 2, 3


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


@dataclasses.dataclass(frozen=True)
class KeptSet:
    """Per row: the gradient's ``floor`` (the kept set is ``u >= floor``), ``s = Σ e`` and
    ``a = Σ e·(u − m)`` over the kept set (``e = exp(u − m)``), and the number of passes;
    from an implementation called with ``m=None`` (:func:`finds_row_max`), also ``m``, each
    row's max, and ``target_rel``, ``u − m`` at the row's target (where it is in ``[0, V)``)."""

    floor: jax.Array
    s: jax.Array
    a: jax.Array
    passes: jax.Array
    m: jax.Array | None = None
    target_rel: jax.Array | None = None

    def search_fields(self) -> tuple[jax.Array, ...]:
        """``(floor, s, a, passes)``: what every implementation returns."""
        return self.floor, self.s, self.a, self.passes


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


def _pivot_stats(u_chunk, m, pivots, fresh):
    """One chunk's ``(count, mass, ent, below, t_count, t_mass, t_ent)`` [N, P + 1] at
    ``pivots`` [N, P + 1] (the module docstring)."""
    key = jnp.where(fresh, float_key(u_chunk), KEY_NONE)
    shifted = u_chunk - m[:, None]
    e = jnp.where(key != KEY_NONE, jnp.exp(shifted), 0.0)
    ee = jnp.where(e > 0, e * shifted, 0.0)
    at_or_above = key[:, None, :] >= pivots[:, :, None]
    count = jnp.sum(at_or_above, axis=-1, dtype=jnp.int32)
    mass = jnp.sum(jnp.where(at_or_above, e[:, None, :], 0.0), axis=-1)
    ent = jnp.sum(jnp.where(at_or_above, ee[:, None, :], 0.0), axis=-1)
    below = jnp.max(jnp.where(at_or_above, KEY_NONE, key[:, None, :]), axis=-1)
    tie = (key[:, None, :] == below[:, :, None]) & (below[:, :, None] != KEY_NONE)
    t_count = jnp.sum(tie, axis=-1, dtype=jnp.int32)
    t_mass = jnp.sum(jnp.where(tie, e[:, None, :], 0.0), axis=-1)
    t_ent = jnp.sum(jnp.where(tie, ee[:, None, :], 0.0), axis=-1)
    return count, mass, ent, below, t_count, t_mass, t_ent


def _merge_below(x, y):
    """Combine two ``(below, t_count, t_mass, t_ent)`` of disjoint column sets."""
    below = jnp.maximum(x[0], y[0])
    return (below,) + tuple(
        jnp.where(x[0] == below, a, 0) + jnp.where(y[0] == below, b, 0)
        for a, b in zip(x[1:], y[1:])
    )


def _across(stats, vocab_axes):
    """Pivot statistics of the whole vocabulary from this device's slice."""
    if not vocab_axes:
        return stats
    count, mass, ent = jax.lax.psum(stats[:3], vocab_axes)
    below = jax.lax.pmax(stats[3], vocab_axes)
    ties = jax.lax.psum(tuple(jnp.where(stats[3] == below, t, 0) for t in stats[4:]), vocab_axes)
    return (count, mass, ent, below) + ties


def _pass(u_chunks, n_rows, vocab, m, pivots, vocab_axes, varying):
    def body(carry, start, cols, fresh, size):
        new = _pivot_stats(u_chunks(start, size), m, pivots, fresh)
        sums = tuple(a + b for a, b in zip(carry[:3], new[:3]))
        return sums + _merge_below(carry[3:], new[3:])

    shape = pivots.shape
    zero_i, zero_f = jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    init = varying(
        (zero_i, zero_f, zero_f, jnp.full(shape, KEY_NONE, jnp.int32), zero_i, zero_f, zero_f)
    )
    stats = vocab_chunks.scan_chunks(body, init, n_rows, vocab, CHUNK_BYTES)
    return _across(stats, vocab_axes)


def _spread(lo, hi):
    """``P + 1`` pivot keys from ``lo`` to ``hi`` (first and last), non-decreasing: evenly
    spaced values where the interval spans more than two binades (keys crowd near zero),
    else evenly spaced keys (within a binade the same thing), in int32 without overflow."""
    span = hi.astype(jnp.uint32) - lo.astype(jnp.uint32)
    step, rest = span // PIVOTS, span % PIVOTS
    j = jnp.arange(PIVOTS + 1, dtype=jnp.uint32)
    offset = step[:, None] * j + (rest[:, None] * j) // PIVOTS
    by_key = (lo.astype(jnp.uint32)[:, None] + offset).astype(jnp.int32)
    lo_v, hi_v = key_value(lo)[:, None], key_value(hi)[:, None]
    frac = jnp.arange(PIVOTS + 1, dtype=jnp.float32) / PIVOTS
    by_value = jnp.clip(float_key(lo_v + (hi_v - lo_v) * frac), lo[:, None], hi[:, None])
    by_value = by_value.at[:, 0].set(lo).at[:, -1].set(hi)
    # (values near float32's limits: keys, which halve their magnitude's exponent each pass)
    wide = (span > 2**24) & (jnp.abs(lo_v[:, 0]) < 2.0**64) & (jnp.abs(hi_v[:, 0]) < 2.0**64)
    return jnp.where(wide[:, None], by_value, by_key)


def row_max(u_chunks, n_rows: int, vocab: int, vocab_axes=(), varying=lambda x: x):
    """``max u`` per row over the whole vocabulary: one pass."""

    def body(m, start, cols, fresh, size):
        return jnp.maximum(m, jnp.max(jnp.where(fresh, u_chunks(start, size), -jnp.inf), -1))

    m = vocab_chunks.scan_chunks(
        body, varying(jnp.full((n_rows,), -jnp.inf, jnp.float32)), n_rows, vocab, CHUNK_BYTES
    )
    return jax.lax.pmax(m, vocab_axes) if vocab_axes else m


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


def search(
    u_chunks,
    n_rows: int,
    vocab: int,
    m,
    active,
    trunc: Truncation,
    *,
    vocab_axes=(),
    varying=lambda x: x,
) -> KeptSet:
    """:func:`find` by the pivot search of the module docstring, for every ``active`` row
    (min-p's threshold takes the max from a pass of its own)."""
    top_value = m if trunc.min_p is None else row_max(u_chunks, n_rows, vocab, vocab_axes, varying)
    min_floor = sampler_math.min_p_floor(top_value, trunc.min_p)
    lowest = jnp.where(
        min_floor == -jnp.inf, float_key(jnp.float32(-3.4028235e38)), float_key(min_floor)
    )
    # Where the searches start: top-p's below m − 104, where exp(u − m) is 0 in float32, has
    # no mass to count; top-k's k-th value lies above m − 64 on any real row (else the search
    # starts again from the lowest value).
    near = {TOP_K: float_key(m - 64.0), TOP_P: float_key(m - 104.0)}
    top = float_key(m) + 1
    first = TOP_K if trunc.top_k is not None else TOP_P if trunc.top_p is not None else AT_TAU
    stage = jnp.where(active, first, DONE).astype(jnp.int32)
    zeros = jnp.zeros_like(m)
    start_lo = jnp.maximum(lowest, near[first]) if first in near else lowest
    state = dict(
        stage=stage,
        lo=start_lo,
        hi=top,
        lowest=lowest,
        p_start=near[TOP_P],
        target=jnp.full_like(m, trunc.top_k or 0.0),
        tau=start_lo,
        exact=jnp.zeros(m.shape, bool),
        floor=jnp.full_like(m, -jnp.inf),
        s=zeros,
        a=zeros,
        passes=jnp.zeros(m.shape, jnp.int32),
    )
    if first == TOP_P:
        state["target"] = jnp.full_like(m, jnp.nan)  # set by the first pass (mass at lo)

    def step(state):
        searching = state["stage"] <= TOP_P
        at_tau = jnp.broadcast_to(state["tau"][:, None], (n_rows, PIVOTS + 1))
        pivots = jnp.where(searching[:, None], _spread(state["lo"], state["hi"]), at_tau)
        count, mass, ent, below, t_count, t_mass, t_ent = _pass(
            u_chunks, n_rows, vocab, m, pivots, vocab_axes, varying
        )
        return _advance(state, trunc, pivots, count, mass, ent, below, t_count, t_mass, t_ent, top)

    def more(state):
        return jnp.any(state["stage"] != DONE) & (jnp.max(state["passes"]) < MAX_PASSES)

    state = jax.lax.while_loop(more, step, varying_like(state, m, active))
    return KeptSet(state["floor"], state["s"], state["a"], state["passes"])


def _advance(state, trunc, pivots, count, mass, ent, below, t_count, t_mass, t_ent, top):
    """One pass's pivot statistics applied to every row's search (the module docstring)."""
    stage, lo, hi, target = state["stage"], state["lo"], state["hi"], state["target"]
    rows = jnp.arange(stage.shape[0])
    is_k, is_p = stage == TOP_K, stage == TOP_P
    # top-p's target on its first pass: top_p times the mass at its lower end.
    if trunc.top_p is not None:
        fresh_p = is_p & jnp.isnan(target)
        target = jnp.where(fresh_p, trunc.top_p * mass[:, 0], target)
    f = jnp.where(is_k[:, None], count.astype(jnp.float32), mass)
    t_f = jnp.where(is_k[:, None], t_count.astype(jnp.float32), t_mass)
    reached = f[:, :-1] >= target[:, None]
    q = jnp.sum(reached, axis=-1) - 1  # the last pivot with F >= target (-1: none)
    nxt = jnp.clip(q + 1, 0, pivots.shape[1] - 1)
    x_star = below[rows, nxt]
    f_star = f[rows, nxt] + t_f[rows, nxt]
    found = (q >= 0) & (x_star != KEY_NONE) & (f_star >= target)
    # Fewer than k values above min-p's floor: top-k keeps them all (τ = lo, not a value);
    # above a start nearer the max: the search starts again from the lowest value.
    short = is_k & (q < 0)
    no_op = short & (lo == state["lowest"])
    restart = short & ~no_op
    searching = is_k | is_p
    done_search = searching & (found | no_op)
    tau = jnp.where(found, x_star, jnp.where(no_op, lo, state["tau"]))
    exact = jnp.where(done_search, found, state["exact"])
    tau = jnp.where(searching, tau, state["tau"])
    new_lo = jnp.where(searching & ~done_search, pivots[rows, jnp.clip(q, 0, None)], lo)
    new_hi = jnp.where(searching & ~done_search, x_star, hi)
    new_lo = jnp.where(restart, state["lowest"], new_lo)
    new_hi = jnp.where(restart, lo, new_hi)
    # What follows a search: top-k is followed by top-p (from τ up), top-p by the pass at τ.
    then = jnp.where(is_k & (trunc.top_p is not None), TOP_P, AT_TAU)
    next_stage = jnp.where(done_search, then, stage)
    into_p = done_search & (then == TOP_P)
    new_lo = jnp.where(into_p, tau, new_lo)
    new_hi = jnp.where(into_p, top, new_hi)
    target = jnp.where(into_p, jnp.nan, target)
    # The pass at τ: the kept set's sums, and the floor between τ and the value below it.
    fin = stage == AT_TAU
    tau_value = key_value(state["tau"])
    gap = key_value(below[:, 0])
    mid = gap + (tau_value - gap) * 0.5
    mid = jnp.where(mid > gap, mid, tau_value)  # adjacent floats: τ itself
    floor = jnp.where(state["exact"], jnp.where(below[:, 0] == KEY_NONE, -jnp.inf, mid), tau_value)
    return dict(
        stage=jnp.where(fin, DONE, next_stage),
        lo=new_lo,
        hi=new_hi,
        lowest=state["lowest"],
        p_start=state["p_start"],
        target=target,
        tau=tau,
        exact=exact,
        floor=jnp.where(fin, floor, state["floor"]),
        s=jnp.where(fin, mass[:, 0], state["s"]),
        a=jnp.where(fin, ent[:, 0], state["a"]),
        passes=state["passes"] + (stage != DONE),
    )
