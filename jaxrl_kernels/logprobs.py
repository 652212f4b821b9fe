"""Per-token log-probabilities (and entropies) from logits or from a linear LM head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl_kernels import dispatch, logprob_core, saved_logits, sharding
from jaxrl_kernels import validation as check

WEIGHT_LAYOUTS = ("vd", "dv")
_LAYOUT_SHAPES = {"vd": "[V, D]", "dv": "[D, V]"}


def _row_valid(targets, ignore_index):
    if ignore_index is None:
        return jnp.ones(targets.shape, jnp.bool_), None
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index).__name__}")
    ignored = targets == ignore_index
    return ~ignored, ignored


def token_logprobs(logits, targets, *, temperature=1.0, ignore_index=None, return_entropy=False,
                   backend=None, vocab_axis=None):
    """log softmax(logits / T)[target] (and the entropy of softmax(logits / T)).

    logits: [..., V] float32/bfloat16/float16; targets: [...] integers.
    Returns float32 logp [...] or (logp, entropy). Where targets == ignore_index
    both are 0 with no gradient; other targets outside [0, V) raise ValueError
    when concrete and give NaN when traced. Inside ``jax.shard_map``, ``vocab_axis``
    names the mesh axis over which ``logits`` holds consecutive slices of the
    vocabulary (targets stay global ids); the results are the global ones.
    """
    logits = check.floating("logits", logits)
    check.rank("logits", logits, range(1, 33), "[..., V]")
    targets = check.integer("targets", targets)
    check.shape("targets", targets, logits.shape[:-1], "logits.shape[:-1]")
    check.positive("temperature", temperature)
    local_vocab = logits.shape[-1]
    if local_vocab == 0:
        raise ValueError("logits: expected a non-empty vocabulary axis, got V = 0")
    vocab = global_vocab(local_vocab, vocab_axis)
    row_valid, ignored = _row_valid(targets, ignore_index)
    check.targets_in_range("targets", targets, vocab, ignored)

    problem = dispatch.Problem("token_logprobs", n_rows=math.prod(targets.shape),
                               vocab=local_vocab, dtype=dispatch.dtype_name(logits),
                               return_entropy=return_entropy)
    choice = dispatch.record("token_logprobs", dispatch.select("token_logprobs", problem, backend))
    logp, entropy = logprob_core.token_logprobs(
        choice.impl, logits, targets.astype(jnp.int32), row_valid, temperature=float(temperature),
        return_entropy=bool(return_entropy), vocab_axis=vocab_axis,
        record=dispatch.plan_recorder("token_logprobs"))
    return (logp, entropy) if return_entropy else logp


def global_vocab(local_vocab: int, vocab_axis) -> int:
    """The vocabulary size across a ``vocab_axis`` split (checks the axis)."""
    if vocab_axis is None:
        return local_vocab
    axes = sharding.check_vocab_axis(vocab_axis)
    return local_vocab * math.prod(jax.lax.axis_size(a) for a in axes)


def check_linear_head(hidden, weight, bias, weight_layout):
    """Validate an LM head; return (hidden, weight, bias, vocab)."""
    hidden = check.floating("hidden", hidden)
    weight = check.floating("weight", weight)
    check.option("weight_layout", weight_layout, WEIGHT_LAYOUTS)
    check.rank("hidden", hidden, range(1, check.MAX_RANK + 1), "[..., D]")
    check.rank("weight", weight, 2, _LAYOUT_SHAPES[weight_layout])
    dim = hidden.shape[-1]
    vocab, w_dim = weight.shape if weight_layout == "vd" else weight.shape[::-1]
    if w_dim != dim:
        # Read in the other layout, this weight's D is our ``vocab`` and its V is ``w_dim``.
        other = "dv" if weight_layout == "vd" else "vd"
        hint = (f"; it fits weight_layout={other!r} ({_LAYOUT_SHAPES[other]} with V = {w_dim})"
                if vocab == dim else "")
        raise ValueError(f"weight: expected shape {_LAYOUT_SHAPES[weight_layout]} with D = {dim} "
                         f"(hidden.shape[-1]) for weight_layout={weight_layout!r}, got "
                         f"{tuple(weight.shape)}{hint}")
    if vocab == 0:
        raise ValueError("weight: expected a non-empty vocabulary axis, got V = 0")
    if bias is not None:
        bias = check.floating("bias", bias)
        check.shape("bias", bias, (vocab,), "[V]")
    return hidden, weight, bias, vocab


def linear_logprobs_rows(hidden, weight, bias, targets, row_valid, *, op, weight_layout,
                         temperature, return_entropy, backend, vocab_axis=None, memory="lean"):
    """Dispatch the linear_logprobs primitive on validated inputs: hidden [..., D] with rows
    [...] (targets, row_valid). Returns (logp [...], entropy [...] | None).

    ``memory``: ``"lean"``, ``"fast"`` or a byte budget (``dispatch.memory_mode``); ``"fast"``
    keeps the logits for the backward (``saved_logits``)."""
    n_rows = math.prod(targets.shape)
    local_vocab = weight.shape[0] if weight_layout == "vd" else weight.shape[1]
    vocab = global_vocab(local_vocab, vocab_axis)
    memory_note = dispatch.memory_mode(
        op, memory, saved_logits.kept_bytes(n_rows, vocab, hidden.dtype, weight.dtype),
        tuple(targets.shape) + (vocab,), saved_logits.kept_dtype(hidden.dtype, weight.dtype),
        backend)
    if memory_note.mode == "fast":
        dispatch.record(op, memory_note)
        return saved_logits.linear_logprobs(
            hidden, weight, bias, targets.astype(jnp.int32), row_valid,
            weight_layout=weight_layout, temperature=float(temperature),
            return_entropy=bool(return_entropy), vocab_axis=vocab_axis,
            record=dispatch.plan_recorder(op))
    flat_hidden = jax.ShapeDtypeStruct((n_rows, hidden.shape[-1]), hidden.dtype)
    problem = dispatch.linear_problem(op, flat_hidden, weight, bias, weight_layout=weight_layout,
                                      return_entropy=return_entropy)
    choice = dispatch.record(op, dispatch.select(op, problem, backend))
    dispatch.record(op, memory_note)

    def standalone_backward():
        backward = dispatch.select(op, problem, primitive="linear_logprobs_backward",
                                   strict=False)
        return dispatch.record("linear_logprobs_backward", backward).impl

    return logprob_core.linear_logprobs(
        choice.impl, hidden, weight, bias, targets.astype(jnp.int32), row_valid,
        weight_layout=weight_layout, temperature=float(temperature),
        return_entropy=bool(return_entropy), backward=standalone_backward,
        vocab_axis=vocab_axis, record=dispatch.plan_recorder(op))


def linear_logprobs(hidden, weight, targets, bias=None, *, weight_layout="vd", temperature=1.0,
                    ignore_index=None, return_entropy=False, backend=None, vocab_axis=None,
                    memory="lean"):
    """token_logprobs(hidden @ W^T + bias, targets) without materialising the logits.

    hidden: [..., D]; weight: [V, D] (``"vd"``, LM head / tied embedding) or
    [D, V] (``"dv"``, a Flax Dense kernel); bias: [V] or None.
    Differentiable in hidden, weight and bias. Inside ``jax.shard_map``,
    ``vocab_axis`` names the mesh axis over which weight (and bias) hold consecutive
    vocabulary slices; targets stay global ids and the results are the global ones.
    ``memory``: ``"lean"`` (default; nothing [N, V] kept, the backward recomputes the
    logits), ``"fast"`` (the forward's logits kept for the backward in the head's 16-bit
    dtype: one GEMM fewer, N·V·2 bytes more) or a byte budget (``"fast"`` when they fit).
    """
    hidden, weight, bias, local_vocab = check_linear_head(hidden, weight, bias, weight_layout)
    targets = check.integer("targets", targets)
    check.shape("targets", targets, hidden.shape[:-1], "hidden.shape[:-1]")
    check.positive("temperature", temperature)
    vocab = global_vocab(local_vocab, vocab_axis)
    row_valid, ignored = _row_valid(targets, ignore_index)
    check.targets_in_range("targets", targets, vocab, ignored)
    logp, entropy = linear_logprobs_rows(
        hidden, weight, bias, targets, row_valid, op="linear_logprobs",
        weight_layout=weight_layout, temperature=temperature, return_entropy=return_entropy,
        backend=backend, vocab_axis=vocab_axis, memory=memory)
    return (logp, entropy) if return_entropy else logp
