"""Per-token values to one loss, and rewards to group advantages (float32).

The aggregation of docs/api.md, from a mask m [B, T] and values x [B, T], written on the
per-sequence sums S_b = Σ_t m·x and C_b = Σ_t m so that a kernel can hand over [B] sums:

* ``"token_mean"``: Σ_b S_b / max(Σ_b C_b, 1);
* ``"seq_mean_token_mean"``: the mean of S_b / C_b over the sequences with C_b > 0 (0 if none);
* ``"seq_mean_token_sum"``: Σ_b S_b / B;
* ``"seq_mean_token_sum_norm"``: Σ_b S_b / (B · max_len), max_len = T by default.

Each is linear in S, aggregate = Σ_b w_b · S_b (:func:`aggregation_weights` gives w).
Group advantages: adv = r − mean_g, divided by (std_g + eps) when normalised. Modes arrive
canonical (``validation.agg_mode`` resolves :data:`AGGREGATION_ALIASES`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_kernels.formulas import ordered_sums

AGGREGATION_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
AGGREGATION_ALIASES = {"sequence_mean": "seq_mean_token_mean"}


def masked_row_sums(values: dict, mask) -> dict:
    """Σ_t m·v per sequence ([B, T] -> [B]) for each entry of ``values``."""
    mask = mask.astype(jnp.float32)
    return {k: jnp.sum(mask * v.astype(jnp.float32), axis=-1) for k, v in values.items()}


def aggregate_sequence_sums(seq_sum, seq_count, mode: str, seq_len: int, max_len=None):
    """The aggregation ``mode`` (one of :data:`AGGREGATION_MODES`, formulas above) from the
    per-sequence sums S_b = ``seq_sum`` ([B]) and C_b = ``seq_count`` ([B]); T = ``seq_len``."""
    batch = seq_sum.shape[0]
    if mode == "token_mean":
        return jnp.sum(seq_sum) / jnp.maximum(jnp.sum(seq_count), 1.0)
    if mode == "seq_mean_token_sum":
        return jnp.sum(seq_sum) / batch
    if mode == "seq_mean_token_sum_norm":
        length = seq_len if max_len is None else max_len
        return jnp.sum(seq_sum) / (batch * length)
    has_tokens = seq_count > 0
    per_seq = jnp.where(has_tokens, seq_sum / jnp.where(has_tokens, seq_count, 1.0), 0.0)
    return jnp.sum(per_seq) / jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)


def aggregation_weights(seq_count, mode: str, seq_len: int, max_len=None):
    """w [B] with aggregate(x) = Σ_b w_b · Σ_t m·x_bt: the derivative of the aggregation
    with respect to each valid token's value, one per sequence."""
    batch = seq_count.shape[0]
    if mode == "token_mean":
        return jnp.broadcast_to(1.0 / jnp.maximum(jnp.sum(seq_count), 1.0), (batch,))
    if mode == "seq_mean_token_sum":
        return jnp.full((batch,), 1.0 / batch, jnp.float32)
    if mode == "seq_mean_token_sum_norm":
        length = seq_len if max_len is None else max_len
        return jnp.full((batch,), 1.0 / (batch * length), jnp.float32)
    has_tokens = seq_count > 0
    per_seq = jnp.where(has_tokens, 1.0 / jnp.where(has_tokens, seq_count, 1.0), 0.0)
    return per_seq / jnp.maximum(jnp.sum(has_tokens.astype(jnp.float32)), 1.0)


def aggregate(values, mask, mode: str = "token_mean", max_len=None):
    """Reduce per-token [B, T] values to a scalar under ``mask`` (see docs/api.md)."""
    sums = masked_row_sums({"x": values, "count": jnp.ones_like(values)}, mask)
    return aggregate_sequence_sums(sums["x"], sums["count"], mode, values.shape[-1], max_len)


def group_advantages(
    rewards, segment_ids, num_groups: int, *, normalize_std=True, std_ddof=0, eps=1e-6
):
    """adv = r - mean_g (÷ (std_g + eps)); a group of one gets 0."""
    rewards = rewards.astype(jnp.float32)
    # sums in a fixed order (ordered_sums), not jax.ops.segment_sum's atomics: the same bits on
    # every run
    count, total = ordered_sums.group_sums(
        jnp.stack([jnp.ones_like(rewards), rewards]), segment_ids, num_groups
    )
    mean = total / jnp.maximum(count, 1.0)
    centred = rewards - mean[segment_ids]
    if normalize_std:
        (sq,) = ordered_sums.group_sums((centred * centred)[None], segment_ids, num_groups)
        var = sq / jnp.maximum(count - std_ddof, 1.0)
        std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)  # finite grad at 0
        centred = centred / (std[segment_ids] + eps)
    return jnp.where(count[segment_ids] > 1, centred, 0.0)
