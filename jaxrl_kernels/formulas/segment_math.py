"""Packed rows: several sequences per row, the per-sequence sums taken per segment (float32).

A packed batch has per-token arrays ``[B, T]`` and segment ids ``g [B, T]`` with
``g_bt ∈ {-1, 0, ..., S-1}``: sequence ``s`` is every position with ``g_bt = s``, wherever it
lies; ``-1`` marks a position in no sequence, whose mask is 0 (the ops zero it). The
aggregation and the PPO math read a batch through per-sequence sums only
(:mod:`aggregation_math`, :mod:`ppo_math`); packed, they are

    Sum_s = Σ_{g_bt = s} m_bt·x_bt,   C_s = Σ_{g_bt = s} m_bt        ([S]: :func:`sums`)

and a per-sequence value ``v_s`` (GSPO's ℓ_s, the sequence TIS log-weight, an advantage)
reaches a token as ``v_{g_bt}`` (0 where ``g_bt = -1``: :func:`spread`). Every formula is then
the padded layout's with the ``S`` sequences in place of its ``B`` rows: ``token_mean``
divides by ``Σ_s C_s``, ``seq_mean_token_mean`` averages over the sequences with ``C_s > 0``,
``seq_mean_token_sum`` divides by ``S`` and ``seq_mean_token_sum_norm`` by ``S · max_len``
(``max_len`` given: the packed row length ``T`` is no sequence's length). So a packed call
equals the ``[S, max_len]`` padded call up to float32 summation order.

The sums are deterministic (docs/api.md "Determinism"): a scatter-add of every token into
``[S]`` would add in the order a GPU's atomics happen to run. Instead each row is sorted by
segment id (stable, within the row: a sequence lies in one row), a segmented scan along the
row sums each run of equal ids in a fixed tree order, and only the run's last position is
added into ``[S]``: one addend per slot, so no order is left to chance (:func:`sums`). Their
gradient is the spread, ``∂Sum_s/∂x_bt = [g_bt = s]``. The spread is a gather. Under an
``Explicit`` mesh both name their output's sharding, as jax requires there: the ``[S]`` sums
replicated (each device adds its own rows, then an all-reduce of one nonzero addend per
sequence), the spread value sharded like the tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.formulas import aggregation_math, ppo_math
from jaxrl_kernels.formulas.aggregation_math import aggregate_sequence_sums
from jaxrl_kernels.formulas.kl_math import kl_penalty


class Packing(NamedTuple):
    """The segments of a packed batch: ``ids`` ``[B, T]`` integers in ``[-1, S)`` and the
    static number of sequences ``count`` = S."""

    ids: jax.Array
    count: int


def _explicit(x) -> bool:
    """``x`` lives on a mesh with an ``Explicit`` axis (where scatters and gathers must name
    their output's sharding)."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return mesh is not None and not mesh.empty and explicit in getattr(mesh, "axis_types", ())


def masked(mask, packing: Packing) -> jax.Array:
    """``mask`` with 0 where no sequence lies (``g < 0``). Under Explicit axes the ids are
    first placed as ``mask`` is (replicated ids against row-split tokens: a local slice)."""
    inside = packing.ids >= 0
    want = jax.typeof(mask).sharding
    if _explicit(mask) and jax.typeof(inside).sharding != want:
        inside = jax.reshard(inside, want)
    return jnp.where(inside, mask, jnp.zeros_like(mask))


def _slots(packing: Packing) -> jax.Array:
    """The ids with -1 moved to S, out of bounds (a negative index would wrap around)."""
    return jnp.where(packing.ids < 0, packing.count, packing.ids)


def segment_sum(x, packing: Packing) -> jax.Array:
    """``[S]``: Σ of ``x [B, T]`` over each segment's positions (``-1`` dropped), in a fixed
    order (module docstring)."""
    return segment_sums({"x": x}, packing)["x"]


def segment_sums(values: dict, packing: Packing) -> dict:
    """:func:`segment_sum` of each ``[B, T]`` entry of ``values``, one sort for them all."""
    keys = list(values)
    if not keys:
        return {}
    ids, stacked = packing.ids, jnp.stack([values[k].astype(jnp.float32) for k in keys])
    if _explicit(stacked):
        out = _per_device_run_sums(stacked, ids, packing.count)
    else:
        out = _run_sums(stacked, ids, packing.count)
    return {k: out[i] for i, k in enumerate(keys)}


def sums(values: dict, mask, packing: Packing) -> dict:
    """Σ_{g = s} m·v per sequence (``[B, T]`` -> ``[S]``) for each entry of ``values``: the
    packed form of ``aggregation_math.masked_row_sums``."""
    mask = mask.astype(jnp.float32)
    return segment_sums({k: mask * v.astype(jnp.float32) for k, v in values.items()}, packing)


def _replicated(x) -> dict:
    """The ``out_sharding`` that replicates a result on ``x``'s own mesh under Explicit axes (a
    bare P() needs a mesh context, which a user's jit of Explicit-sharded arrays need not
    have)."""
    return {"out_sharding": jax.typeof(x).sharding.update(spec=P())} if _explicit(x) else {}


def _per_device_run_sums(x, ids, count):
    """:func:`_run_sums` under Explicit axes: each device sums its own ``[B, T]`` block (a
    sort needs an unsplit axis, and gathering the tokens would cost more than the ``[K, S]``
    sums), then one all-reduce adds the blocks' sums: a sequence split between devices (a
    ``T`` split) gets one addend per device, in the collective's fixed order."""
    tokens = jax.typeof(x).sharding
    spec = tuple(tokens.spec) + (None,) * (3 - len(tokens.spec))
    ids = jax.reshard(ids, tokens.update(spec=P(*spec[1:])))
    axes = tuple(
        name
        for entry in spec
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    )

    def local(x, ids):
        out = _run_sums(x, ids, count)
        return lax.psum(out, axes) if axes else out

    return jax.shard_map(local, mesh=tokens.mesh, in_specs=(P(*spec), P(*spec[1:])), out_specs=P())(
        x, ids
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _run_sums(x, ids, count):
    """``[K, S]`` sums of ``x [K, B, T]`` per segment: rows sorted by id, a segmented scan
    per row, each run's total added once at its last position."""
    key = jnp.where(ids < 0, count, ids)  # no sequence: sorted last, dropped below
    order = jnp.argsort(key, axis=-1, stable=True)
    key = jnp.take_along_axis(key, order, axis=-1)
    x = jnp.take_along_axis(x, jnp.broadcast_to(order, x.shape), axis=-1)
    change = key[:, 1:] != key[:, :-1]
    edge = jnp.ones_like(key[:, :1], bool)
    starts = jnp.broadcast_to(jnp.concatenate([edge, change], axis=-1), x.shape)

    def combine(a, b):  # (run starts here, sum since the run's start)
        return a[0] | b[0], jnp.where(b[0], b[1], a[1] + b[1])

    _, running = lax.associative_scan(combine, (starts, x), axis=-1)
    last = jnp.concatenate([change, edge], axis=-1) & (key < count)
    out = jnp.zeros((x.shape[0], count), jnp.float32)
    return out.at[:, jnp.where(last, key, count)].add(running, mode="drop", **_replicated(x))


def _run_sums_fwd(x, ids, count):
    return _run_sums(x, ids, count), (ids, x)


def _run_sums_bwd(count, res, g):
    ids, x = res
    slots = jnp.where(ids < 0, count, ids)
    options = {"out_sharding": jax.typeof(x).sharding} if _explicit(x) else {}
    return g.at[:, slots].get(mode="fill", fill_value=0, **options), None


_run_sums.defvjp(_run_sums_fwd, _run_sums_bwd)


def spread(seq_values, packing: Packing, like=None) -> jax.Array:
    """``v_{g_bt}`` ``[B, T]`` from per-sequence ``seq_values`` ``[S]``, 0 where ``g = -1``;
    sharded like ``like`` (``[B, T]``) under Explicit axes."""
    ref = packing.ids if like is None else like
    options = {"out_sharding": jax.typeof(ref).sharding} if _explicit(ref) else {}
    return seq_values.at[_slots(packing)].get(mode="fill", fill_value=0, **options)


def aggregate(values, mask, packing: Packing | None, mode: str, max_len=None):
    """``aggregation_math.aggregate`` with sequence ``s`` = segment ``s`` (module docstring);
    ``max_len`` is required for ``"seq_mean_token_sum_norm"`` (the ops check it). Without
    ``packing``, ``aggregation_math.aggregate`` itself (one sequence per row)."""
    if packing is None:
        return aggregation_math.aggregate(values, mask, mode, max_len)
    totals = sums({"x": values, "count": jnp.ones_like(values)}, mask, packing)
    return aggregate_sequence_sums(totals["x"], totals["count"], mode, max_len, max_len)


def _sequence_terms(x: ppo_math.PPOInputs, cfg, packing: Packing) -> ppo_math.SequenceTerms:
    """``ppo_math.sequence_terms`` per segment, spread to every token of its segment
    (``[B, T]``: ``ppo_math`` takes per-token terms as they are, per-row ones broadcast)."""
    seq = ppo_math.sequence_terms(sums(ppo_math.sequence_summands(x, cfg), x.mask, packing), cfg)
    return ppo_math.SequenceTerms(*(None if v is None else spread(v, packing, x.logp) for v in seq))


def ppo_loss(x: ppo_math.PPOInputs, cfg, packing: Packing):
    """(loss, metrics) of ``ppo_math.ppo_loss`` with sequences = segments: the same per-token
    terms, their sums per segment, the same aggregation of the ``[S]`` sums."""
    seq = _sequence_terms(x, cfg, packing)
    totals = sums(ppo_math.token_summands(x, cfg, seq), x.mask, packing)
    return ppo_math.loss_and_metrics(totals, cfg, cfg.max_len)


def grpo_loss(x: ppo_math.PPOInputs, cfg, packing: Packing):
    """(loss, policy_loss, kl) of ``ppo_math.grpo_loss`` with sequences = segments."""
    seq = _sequence_terms(x, cfg, packing)
    pg, _ = ppo_math.policy_surrogate(x, cfg, seq)
    kl = (
        jnp.zeros_like(pg)
        if x.ref_logp is None
        else kl_penalty(x.logp, x.ref_logp, cfg.kl_estimator)
    )
    totals = sums(
        {"loss": pg + cfg.kl_coef * kl, "pg": pg, "kl": kl, "count": jnp.ones_like(pg)},
        x.mask,
        packing,
    )

    def agg(key):
        return aggregate_sequence_sums(
            totals[key], totals["count"], cfg.loss_agg_mode, cfg.max_len, cfg.max_len
        )

    return agg("loss"), agg("pg"), agg("kl")
