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

The sums are taken in a fixed order, the same bits on every run (:mod:`ordered_sums`: rows
sorted by segment id, a segmented scan, one addend per ``[S]`` slot); their gradient is the
spread, a gather. Under an
``Explicit`` mesh both name their output's sharding, as jax requires there: the ``[S]`` sums
replicated (each device adds its own rows, then an all-reduce of one nonzero addend per
sequence), the spread value sharded like the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_kernels.formulas import aggregation_math, ordered_sums, ppo_math
from jaxrl_kernels.formulas.aggregation_math import aggregate_sequence_sums
from jaxrl_kernels.formulas.kl_math import kl_penalty


class Packing(NamedTuple):
    """The segments of a packed batch: ``ids`` ``[B, T]`` integers in ``[-1, S)`` and the
    static number of sequences ``count`` = S."""

    ids: jax.Array
    count: int


def masked(mask, packing: Packing) -> jax.Array:
    """``mask`` with 0 where no sequence lies (``g < 0``). Under Explicit axes the ids are
    first placed as ``mask`` is (replicated ids against row-split tokens: a local slice)."""
    inside = packing.ids >= 0
    want = jax.typeof(mask).sharding
    if ordered_sums.explicit(mask) and jax.typeof(inside).sharding != want:
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
    if ordered_sums.explicit(stacked):
        out = ordered_sums.per_device_run_sums(stacked, ids, packing.count)
    else:
        out = ordered_sums.run_sums(stacked, ids, packing.count)
    return {k: out[i] for i, k in enumerate(keys)}


def sums(values: dict, mask, packing: Packing) -> dict:
    """Σ_{g = s} m·v per sequence (``[B, T]`` -> ``[S]``) for each entry of ``values``: the
    packed form of ``aggregation_math.masked_row_sums``."""
    mask = mask.astype(jnp.float32)
    return segment_sums({k: mask * v.astype(jnp.float32) for k, v in values.items()}, packing)


def spread(seq_values, packing: Packing, like=None) -> jax.Array:
    """``v_{g_bt}`` ``[B, T]`` from per-sequence ``seq_values`` ``[S]``, 0 where ``g = -1``;
    sharded like ``like`` (``[B, T]``) under Explicit axes."""
    ref = packing.ids if like is None else like
    options = {"out_sharding": jax.typeof(ref).sharding} if ordered_sums.explicit(ref) else {}
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
