"""Packing a step's completions into rows of a fixed token budget (``--pack``), on the host.

Completion ``i`` (a rollout: prompt ``x_i`` of ``P`` tokens, answer ``y_i``) is the sequence the
model saw, ``s_i = x_i ++ y_i[:n_i]`` with ``n_i = Σ_k mask[i, k]`` answer tokens (up to and
including the first EOS), ``ℓ_i = P + n_i`` tokens. The padded layout holds each in its own
row of ``P + max_new`` tokens; the packed one lays them end to end in rows of ``C`` tokens
(``budget``), first-fit decreasing: longest first, each into the first row with room.

Padding fraction of a layout = 1 − Σ_i ℓ_i / (rows · row length): the share of the token
slots the model runs on that belong to no completion.

The packed arrays follow the usual one-token shift over a row ``r`` of tokens ``z[r, 0:C]``
(docs/api.md, "Packed sequences"): the model reads ``z[:, :-1]``, position ``t`` predicts
``actions[:, t] = z[:, t + 1]``, and

* ``segment_ids[r, t] = i`` where token ``z[r, t]`` belongs to ``s_i``, ``-1`` on padding;
* ``mask[r, t] = mask[i, k]`` where ``z[r, t + 1]`` is answer token ``k`` of ``s_i`` and
  ``z[r, t]`` is of ``s_i`` too; 0 elsewhere: on prompt positions, and on the last position
  of each ``s_i``, which would predict the next sequence's first token;
* ``rollout_logp`` likewise, the sampler's log-prob of that answer token.

The segment id of a completion is its rollout index, so the per-sequence inputs (GRPO's
``rewards`` ``[S]``, ``S = B``) keep the padded batch's order and its groups of
``group_size`` consecutive rollouts.
"""

from __future__ import annotations

import numpy as np

from jaxrl_kernels.demo.task import PAD


def first_fit_decreasing(lengths: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row[S], offset[S])``: where each sequence of ``lengths`` starts, rows of ``budget``.

    First-fit decreasing (at most 11/9 of the fewest rows, plus 6/9); ties keep the order.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > budget:
        raise ValueError(f"pack_len: a completion of {lengths.max()} tokens exceeds {budget}")
    row = np.zeros(lengths.shape, np.int64)
    offset = np.zeros(lengths.shape, np.int64)
    used: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        r = next((r for r, u in enumerate(used) if u + lengths[i] <= budget), len(used))
        if r == len(used):
            used.append(0)
        row[i], offset[i] = r, used[r]
        used[r] += int(lengths[i])
    return row, offset


def padding_fraction(lengths, rows: int, row_len: int) -> float:
    """1 − Σ lengths / (rows · row_len)."""
    return 1.0 - float(np.sum(lengths)) / (rows * row_len)


def pack(prompts, actions, mask, rollout_logp, budget: int) -> dict[str, np.ndarray]:
    """The packed layout (module docstring) of a padded rollout batch.

    ``prompts[S, P]``, ``actions[S, M]``, ``mask[S, M]`` (1 up to and including the first EOS),
    ``rollout_logp[S, M]``. Returns ``tokens[R, C]`` (the model reads ``tokens[:, :-1]``),
    ``actions``, ``segment_ids``, ``mask``, ``rollout_logp`` ``[R, C - 1]``, ``lengths[S]``,
    and ``where[S, M]``: the flat index into ``[R, C - 1]`` of the position predicting answer
    token ``k`` of sequence ``i`` (``-1`` past ``n_i``), to map per-token values back.
    """
    prompts, actions = np.asarray(prompts), np.asarray(actions)
    mask, rollout_logp = np.asarray(mask, np.float32), np.asarray(rollout_logp, np.float32)
    s, p = prompts.shape
    m = actions.shape[1]
    n = mask.sum(axis=1).astype(np.int64)  # the mask is a prefix of ones (sampling.generate)
    lengths = p + n
    row, offset = first_fit_decreasing(lengths, budget)
    rows = int(row.max()) + 1 if s else 0
    tokens = np.full((rows, budget), PAD, prompts.dtype)
    ids = np.full((rows, budget), -1, np.int32)
    out_mask = np.zeros((rows, budget - 1), np.float32)
    out_logp = np.zeros((rows, budget - 1), np.float32)
    where = np.full((s, m), -1, np.int64)
    for i in range(s):
        r, o, k = row[i], offset[i], n[i]
        tokens[r, o : o + p] = prompts[i]
        tokens[r, o + p : o + p + k] = actions[i, :k]
        ids[r, o : o + p + k] = i
        # Position o + p - 1 + j predicts answer token j (the shift); the sequence's last
        # position, o + p + k - 1, predicts the next sequence's first token: it stays 0.
        cols = o + p - 1 + np.arange(k)
        out_mask[r, cols] = mask[i, :k]
        out_logp[r, cols] = rollout_logp[i, :k]
        where[i, :k] = r * (budget - 1) + cols
    return {
        "tokens": tokens,
        "actions": tokens[:, 1:],
        "segment_ids": ids[:, :-1],
        "mask": out_mask,
        "rollout_logp": out_logp,
        "lengths": lengths,
        "where": where,
    }
