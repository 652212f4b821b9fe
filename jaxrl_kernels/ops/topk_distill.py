"""Distillation from a served teacher: the forward KL over the teacher's top-k ids.

An inference server returns, per token, the teacher's K most likely ids and their log-probs
(from its own full softmax). The student's log-probs at those ids, normalised over its whole
vocabulary, come from ``linear_logprobs`` with K ids per position (one statistics pass over
the vocabulary, no ``[N, V]`` logits); the loss is a few ``[N, K]`` operations on them
(:func:`topk_divergence`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.config.distill import TAILS, TOPK_LEGACY, TopKDistillLoss
from jaxrl_kernels.engine import head_entry
from jaxrl_kernels.engine.linear_head import AxisName, HeadCall
from jaxrl_kernels.formulas import segment_math
from jaxrl_kernels.ops import segments
from jaxrl_kernels.sharding.entry import global_vocab

__all__ = ["TAILS", "linear_topk_distill_loss", "topk_divergence"]
_LOG_TINY = float(np.log(np.finfo(np.float32).tiny))


def log1mexp(x):
    """``log(1 − exp(x))`` for ``x <= 0``, accurate at both ends (``x`` above ``−1e-30``
    taken as ``−1e-30``: finite, with a finite gradient)."""
    x = jnp.minimum(x, -1e-30)
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def topk_divergence(student_logp, teacher_logp, valid, tail: str):
    """Per-position ``Σ_k p_t (log p_t − log p_s)`` over the valid ids (``[..., K]`` each; a
    teacher log-prob of −inf adds 0), plus with ``tail="bucket"`` the left-over masses'
    term ``r_t (log r_t − log r_s)`` with ``r = 1 − Σ_k p`` (0 where ``r_t <= 0``; ``log r_s``
    at least log of float32's smallest normal)."""
    p_t = jnp.where(valid, jnp.exp(teacher_logp), 0.0)
    safe_t = jnp.where(p_t > 0, teacher_logp, 0.0)
    d = jnp.sum(jnp.where(p_t > 0, p_t * (safe_t - student_logp), 0.0), axis=-1)
    if tail == "drop":
        return d
    r_t = 1.0 - jnp.sum(p_t, axis=-1)
    mass_s = jax.nn.logsumexp(jnp.where(valid, student_logp, -jnp.inf), axis=-1)
    log_r_s = jnp.maximum(log1mexp(jnp.where(jnp.isfinite(mass_s), mass_s, -jnp.inf)), _LOG_TINY)
    some = r_t > 0
    log_r_t = jnp.log(jnp.where(some, r_t, 1.0))
    return d + jnp.where(some, r_t * (log_r_t - log_r_s), 0.0)


def linear_topk_distill_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    teacher_ids: ArrayLike,
    teacher_logp: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    config: TopKDistillLoss | None = None,
    temperature: float = 1.0,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, jax.Array]:
    """The forward KL from a served teacher's top-k to a linear-head student, over the
    teacher's ids, without materialising the student's logits.

    With ``log p_s = linear_logprobs(hidden, weight, teacher_ids, bias, temperature=...)``
    (the student's full-vocabulary softmax at ``temperature``, at the K ids) and
    ``p_t = exp(teacher_logp)``, per token::

        d = Σ_k p_t,k (log p_t,k − log p_s,k)
          + [tail="bucket"] r_t (log r_t − log r_s),   r = 1 − Σ_k p,k

    over the valid ids (``>= 0``). Gradients reach ``hidden``, ``weight`` and ``bias``;
    ``teacher_logp`` gets none.

    Args:
      hidden: the student's ``[B, T, D]`` hidden states.
      weight: its head, ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``).
      teacher_ids: ``[B, T, K]`` int, the teacher's ids (``< 0``: padding, ignored; an id
        listed twice counts twice).
      teacher_logp: ``[B, T, K]`` float, the teacher's log-probs at those ids, taken as they
        are (−inf: an id of probability 0).
      mask: ``[B, T]`` (float, bool or int 0/1), 1 on the tokens that count.
      segment_ids, num_segments: packed rows (``num_segments`` required), as in ``aggregate``.
      bias: ``[V]`` or ``None``.
      weight_layout: ``"vd"`` or ``"dv"``.
      config: a ``jk.TopKDistillLoss``: ``tail`` (``"drop"``: the sum over the ids only;
        ``"bucket"``: the teacher's and the student's mass outside the ids as one more
        outcome, 0 where the teacher's ids hold all of its mass), ``loss_agg_mode`` and
        ``max_len`` (as in ``aggregate``); ``None``: its defaults.
      temperature: ``> 0``, dividing the student's logits (the teacher's log-probs are given).
      memory, backend, vocab_axis: as in ``linear_logprobs`` (``memory="fast"`` keeps the
        student's logits for the backward).
      **deprecated: ``tail``, ``loss_agg_mode``, ``max_len`` (use ``config=``), until 0.3.

    Returns:
      ``(loss, per_token)``: the float32 scalar ``aggregate(d, mask, loss_agg_mode,
      max_len)`` and ``d`` ``[B, T]`` float32, 0 where ``mask`` is 0 (no gradient there).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> h, w = jnp.ones((1, 2, 4)), jnp.zeros((8, 4))        # a uniform student: p_s = 1/8
      >>> ids = jnp.array([[[0, 1], [2, -1]]])                 # the second token: one id
      >>> t_logp = jnp.log(jnp.array([[[0.5, 0.5], [1.0, 1.0]]]))
      >>> loss, d = jk.linear_topk_distill_loss(h, w, ids, t_logp, jnp.ones((1, 2)))
      >>> [round(x, 3) for x in d[0].tolist()]                 # log 4, log 8
      [1.386, 2.079]
    """
    options = legacy.take(
        "linear_topk_distill_loss",
        deprecated,
        {"config": config},
        (TOPK_LEGACY,),
    )["config"]
    options = options or TopKDistillLoss()
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = tuple(hidden.shape[:2])
    teacher_ids = check.integer("teacher_ids", teacher_ids)
    check.rank("teacher_ids", teacher_ids, 3, "[B, T, K]")
    if tuple(teacher_ids.shape[:2]) != shape or teacher_ids.shape[2] < 1:
        raise ValueError(
            f"teacher_ids: expected shape {shape} + (K,) with K >= 1 "
            f"(hidden.shape[:2]), got {tuple(teacher_ids.shape)}"
        )
    teacher_logp = check.floating("teacher_logp", teacher_logp)
    check.shape("teacher_logp", teacher_logp, teacher_ids.shape, "teacher_ids.shape")
    mask = check.mask("mask", mask)
    check.shape("mask", mask, shape, "[B, T]")
    pack = segments.packing(segment_ids, num_segments, shape)
    mask = segments.mask(mask.astype(jnp.float32), pack)
    check.positive("temperature", temperature)
    mode = check.agg_mode(options.loss_agg_mode)
    max_len = segments.max_len(mode, options.max_len, pack)
    vocab = global_vocab(local_vocab, vocab_axis)
    counts = mask != 0
    valid = (teacher_ids >= 0) & counts[..., None]
    check.targets_in_range("teacher_ids", teacher_ids, vocab, ~valid)

    call = HeadCall(
        weight_layout=weight_layout, temperature=float(temperature), vocab_axis=vocab_axis
    )
    choice = head_entry.choose(
        "linear_topk_distill_loss", memory, hidden, weight, bias, shape, call, backend
    )
    student_logp, _ = head_entry.logprob_rows(
        hidden, weight, bias, teacher_ids, valid, call, choice
    )
    d = topk_divergence(
        student_logp, jax.lax.stop_gradient(teacher_logp).astype(jnp.float32), valid, options.tail
    )
    per_token = jnp.where(counts, d, 0.0)
    return segment_math.aggregate(per_token, mask, pack, mode, max_len), per_token
