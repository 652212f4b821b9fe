"""Distillation between two linear LM heads, and the top-k log-probs of one, without logits.

``linear_distill_loss``: a per-token divergence (forward KL, reverse KL or the generalised JSD)
between the full-vocabulary distributions of a student head and a frozen teacher head;
``linear_topk_logprobs``: each row's k most likely tokens and their log-probs (the teacher-side
export for top-k distillation). The per-row math is in ``divergence_math``; the backends'
pieces are each backend's ``distill.py`` (``reference``: jnp on the logits, the oracle;
``chunked``: vocabulary chunks, its docstring counts the GEMMs; ``pallas``: the divergence on
Mosaic GPU kernels; ``ffi``: SM90 kernels).

Both are :mod:`engine` ops like the log-prob ops: rows stay where they live, a
vocabulary split over devices is used in place, and inside ``jax.shard_map`` ``vocab_axis``
names the axis whose slices of the heads' vocabulary each device holds.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxrl_kernels import dispatch
from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.config.distill import DISTILL_LEGACY, DistillLoss
from jaxrl_kernels.dispatch import memory as memory_lib
from jaxrl_kernels.dispatch.contract import distill_problem, linear_problem
from jaxrl_kernels.engine import distill_halves, fused_distill
from jaxrl_kernels.engine.linear_head import AxisName
from jaxrl_kernels.formulas import segment_math
from jaxrl_kernels.head import geometry, rounded_logits
from jaxrl_kernels.ops import segments
from jaxrl_kernels.sharding.entry import global_vocab

_LAYOUT_SHAPES = {"vd": "[V, {d}]", "dv": "[{d}, V]"}


# -- validation ---------------------------------------------------------------------------------


def _check_teacher(t_hidden, t_weight, t_bias, layout, shape, vocab):
    """Validate the teacher head against the student's rows ``shape`` [B, T] and ``vocab``."""
    t_hidden = check.floating("teacher_hidden", t_hidden)
    t_weight = check.floating("teacher_weight", t_weight)
    check.option("teacher_weight_layout", layout, geometry.LAYOUTS)
    check.rank("teacher_hidden", t_hidden, 3, "[B, T, D_t]")
    if tuple(t_hidden.shape[:2]) != tuple(shape):
        raise ValueError(
            f"teacher_hidden: expected [B, T] = {tuple(shape)} (hidden.shape[:2]), "
            f"got shape {tuple(t_hidden.shape)}"
        )
    dim = t_hidden.shape[-1]
    want = _LAYOUT_SHAPES[layout].format(d="D_t")
    check.rank("teacher_weight", t_weight, 2, want)
    t_vocab, w_dim = geometry.vocab_size(t_weight, layout), geometry.hidden_dim(t_weight, layout)
    if w_dim != dim:
        raise ValueError(
            f"teacher_weight: expected shape {want} with D_t = {dim} "
            f"(teacher_hidden.shape[-1]) for teacher_weight_layout={layout!r}, "
            f"got {tuple(t_weight.shape)}"
        )
    if t_vocab != vocab:
        raise ValueError(
            f"teacher_weight: expected the student's vocabulary V = {vocab} "
            f"(the weight's), got V = {t_vocab} in shape {tuple(t_weight.shape)}"
        )
    if t_bias is not None:
        t_bias = check.floating("teacher_bias", t_bias)
        check.shape("teacher_bias", t_bias, (vocab,), "[V]")
    return t_hidden, t_weight, t_bias


def _check_temperature(temperature):
    check.positive("temperature", temperature)
    return float(temperature)


# -- linear_distill_loss ------------------------------------------------------------------------


def linear_distill_loss(
    hidden: ArrayLike,
    weight: ArrayLike,
    teacher_hidden: ArrayLike,
    teacher_weight: ArrayLike,
    mask: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    num_segments: int | None = None,
    bias: ArrayLike | None = None,
    teacher_bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    teacher_weight_layout: str = "vd",
    config: DistillLoss | None = None,
    temperature: float = 1.0,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> tuple[jax.Array, jax.Array]:
    """A per-token divergence between a student and a frozen teacher LM head, over the whole
    vocabulary, without materialising either model's logits.

    ``z = (hidden·Wᵀ + b) / temperature`` for each model (no τ² factor on the loss),
    ``p_s = softmax(z_s)``, ``p_t = softmax(z_t)``, and per token ``d``:
    ``"forward_kl"`` ``Σ p_t (log p_t − log p_s)``; ``"reverse_kl"`` ``Σ p_s (log p_s −
    log p_t)``; ``"jsd"`` ``β·KL(p_t ‖ m) + (1−β)·KL(p_s ‖ m)`` with ``m = β p_t + (1−β) p_s``.
    Gradients reach ``hidden``, ``weight`` and ``bias``; the teacher's arguments get zeros. No
    backend except ``"reference"`` holds ``[B, T, V]`` logits, forward or backward.

    Args:
      hidden: the student's ``[B, T, D_s]`` hidden states.
      weight: the student's head, ``[V, D_s]`` (``"vd"``) or ``[D_s, V]`` (``"dv"``).
      teacher_hidden: the teacher's ``[B, T, D_t]`` (``D_t`` may differ from ``D_s``).
      teacher_weight: the teacher's head, ``[V, D_t]`` or ``[D_t, V]`` (the same ``V``).
      mask: ``[B, T]`` (float, bool or int 0/1), 1 on the tokens that count.
      segment_ids, num_segments: packed rows (``num_segments`` required), as in ``aggregate``.
      bias, teacher_bias: ``[V]`` or ``None``.
      weight_layout, teacher_weight_layout: ``"vd"`` or ``"dv"`` for each head.
      config: a ``jk.DistillLoss``: ``divergence`` (``"reverse_kl"``, ``"forward_kl"`` or
        ``"jsd"``), ``jsd_beta`` (β in (0, 1), for ``"jsd"`` only), ``loss_agg_mode`` and
        ``max_len`` (as in ``aggregate``); ``None``: its defaults.
      temperature: ``> 0``, dividing both models' logits (and biases).
      backend: ``None`` (automatic), ``"reference"``, ``"chunked"`` or ``"pallas"``
        (16-bit heads; docs/api.md).
      vocab_axis: inside ``jax.shard_map``, the mesh axis over which both heads (and biases)
        hold consecutive vocabulary slices.
      memory: ``"lean"`` (nothing ``[B, T, V]`` kept: the backward recomputes both heads'
        logits, 4 student GEMMs and 2 teacher ones), ``"fast"`` (the divergence's gradient
        taken in the forward into one ``[B, T, V]`` buffer in the student head's dtype: 3
        student GEMMs and 1 teacher one, ``jaxrl_kernels.engine.fused_distill``) or an int byte
        budget for that buffer (``"fast"`` when it fits); ``None``: the mode of
        ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else ``"auto"``.
      **deprecated: ``divergence``, ``jsd_beta``, ``loss_agg_mode``, ``max_len`` (use
        ``config=``), until 0.3.

    Returns:
      ``(loss, per_token)``: the float32 scalar ``aggregate(d, mask, loss_agg_mode,
      max_len)`` and ``d`` ``[B, T]`` float32, exactly 0 where ``mask`` is 0 (no gradient
      from there).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> h, w = jnp.ones((1, 2, 4)), jnp.zeros((8, 4))          # a uniform student
      >>> th, tw = jnp.ones((1, 2, 6)), jnp.zeros((8, 6)).at[0].set(1.0)  # z_t = (6, 0, ...)
      >>> loss, d = jk.linear_distill_loss(h, w, th, tw, jnp.ones((1, 2)),  # log 8 − H(p_t)
      ...                                  config=jk.DistillLoss(divergence="forward_kl"))
      >>> round(float(loss), 3), d.shape
      (1.96, (1, 2))
    """
    options = (
        legacy.take(
            "linear_distill_loss",
            deprecated,
            {"config": config},
            (DISTILL_LEGACY,),
        )["config"]
        or DistillLoss()
    )
    divergence, beta = options.divergence, options.beta
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    check.rank("hidden", hidden, 3, "[B, T, D_s]")
    shape = hidden.shape[:2]
    teacher_hidden, teacher_weight, teacher_bias = _check_teacher(
        teacher_hidden, teacher_weight, teacher_bias, teacher_weight_layout, shape, local_vocab
    )
    mask = check.mask("mask", mask)
    check.shape("mask", mask, shape, "[B, T]")
    pack = segments.packing(segment_ids, num_segments, shape)
    mask = segments.mask(mask.astype(jnp.float32), pack)
    temperature = _check_temperature(temperature)
    mode = check.agg_mode(options.loss_agg_mode)
    max_len = segments.max_len(mode, options.max_len, pack)
    vocab = global_vocab(local_vocab, vocab_axis)  # checks the axis

    op = "linear_distill_loss"
    stop = lambda x: None if x is None else jax.lax.stop_gradient(x)
    opts = dict(
        weight_layout=weight_layout,
        teacher_weight_layout=teacher_weight_layout,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
    )
    valid = mask != 0
    operands = (
        hidden,
        weight,
        bias,
        stop(teacher_hidden),
        stop(teacher_weight),
        stop(teacher_bias),
    )
    kept_dtype = rounded_logits.kept_dtype(hidden.dtype, weight.dtype)
    request = memory_lib.Request(
        memory,
        math.prod(shape) * vocab * kept_dtype.itemsize,
        tuple(shape) + (vocab,),
        kept_dtype,
        loss=True,
        gemms=(4, 6),
        kept="the student's logit gradient",
    )
    problem = distill_problem(
        hidden,
        weight,
        bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        weight_layout=weight_layout,
        teacher_weight_layout=teacher_weight_layout,
    )
    choice = dispatch.resolve(op, problem, backend, memory=request)
    if choice.fast:
        d = fused_distill.divergence_rows(operands, valid, opts=opts, vocab_axis=vocab_axis)
    else:
        d = distill_halves.divergence_rows(
            choice.impl, operands, valid, opts=opts, vocab_axis=vocab_axis
        )
    per_token = jnp.where(valid, d, 0.0)
    return segment_math.aggregate(per_token, mask, pack, mode, max_len), per_token


# -- linear_topk_logprobs -----------------------------------------------------------------------


def linear_topk_logprobs(
    hidden: ArrayLike,
    weight: ArrayLike,
    k: int,
    *,
    bias: ArrayLike | None = None,
    weight_layout: str = "vd",
    temperature: float = 1.0,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``k`` most likely tokens of each row of a linear head and their log-probs, without
    materialising the logits.

    With ``z = (hidden·Wᵀ + b) / temperature``: ``ids`` are the k largest ``z`` in descending
    order (equal float32 logits: the lower id first), ``logp = z[ids] − lse`` and
    ``lse = logsumexp(z)``. ``logp`` and ``lse`` are differentiable (``logp`` as
    ``linear_logprobs`` at those ids); ``ids`` are not. Across a vocabulary split over devices
    each slice's top-k merges into the global one.

    Args:
      hidden: ``[..., D]`` (may be 1-D).
      weight: ``[V, D]`` (``"vd"``) or ``[D, V]`` (``"dv"``), as in ``linear_logprobs``.
      k: a Python int in ``[1, V]``.
      bias, weight_layout, temperature: as in ``linear_logprobs``.
      backend: ``None`` (automatic), ``"reference"`` or ``"chunked"``.
      vocab_axis: inside ``jax.shard_map``, the mesh axis splitting the weight's vocabulary;
        ``ids`` are global.

    Returns:
      ``(logp, ids, lse)``: float32 ``[..., k]``, int32 ``[..., k]`` and float32 ``[...]``.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> w = jnp.array([[0.0], [2.0], [1.0], [2.0]])          # [V, D]: tokens 1 and 3 tie
      >>> logp, ids, lse = jk.linear_topk_logprobs(jnp.ones(1), w, 3)
      >>> ids.tolist(), [round(x, 3) for x in logp.tolist()]
      ([1, 3, 2], [-0.918, -0.918, -1.918])
    """
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    vocab = global_vocab(local_vocab, vocab_axis)
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
        raise TypeError(f"k: expected a Python int in [1, V = {vocab}], got {type(k).__name__}")
    if not 1 <= k <= vocab:
        raise ValueError(f"k: expected a value in [1, V = {vocab}], got {k}")
    temperature = _check_temperature(temperature)
    squeeze = hidden.ndim == 1
    if squeeze:
        hidden = hidden[None]
    n_row_dims = hidden.ndim - 1
    flat_hidden = jax.ShapeDtypeStruct(
        (math.prod(hidden.shape[:-1]), hidden.shape[-1]), hidden.dtype
    )
    problem = linear_problem(
        flat_hidden, weight, bias, weight_layout=weight_layout, return_entropy=False
    )
    choice = dispatch.resolve("linear_topk_logprobs", problem, backend)
    values, ids, lse = distill_halves.topk_rows(
        choice.impl,
        hidden,
        weight,
        bias,
        k=int(k),
        n_row_dims=n_row_dims,
        weight_layout=weight_layout,
        temperature=temperature,
        vocab_axis=vocab_axis,
    )
    logp = values - lse[..., None]
    if squeeze:
        logp, ids, lse = logp[0], ids[0], lse[0]
    return logp, ids, lse
