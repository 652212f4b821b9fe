"""The pivot search of a sampler's kept set, in passes over the vocabulary (the plain-jnp
``kept_set`` primitive's core; :mod:`.kept_set` holds the entry and the top-k shortcut).

Each pass walks ``u`` in chunks and takes, per row and for each of ``P + 1`` pivot keys, the
count, mass and entropy sums of the entries at or above it (:func:`_pivot_stats`), summed over
a vocabulary split; a search cuts each row's interval of keys ``P``-fold a pass
(:func:`search`, :func:`_advance`). The method in full: :mod:`.kept_set`'s docstring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_kernels.formulas import sampler_math
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
