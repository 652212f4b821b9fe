"""The one internal entry of a linear-head op: choose an implementation for a :class:`HeadCall`,
then run the log-probs (or a loss of them) on validated inputs.

The public ops (``linear_logprobs``, the linear losses, ``linear_topk_distill_loss``) and the
tunix integration build a :class:`HeadCall` from their arguments and call :func:`choose` and
:func:`logprob_rows` / :func:`loss_rows`; nothing below them takes the options one by one.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_kernels import dispatch
from jaxrl_kernels.dispatch import memory as memory_lib
from jaxrl_kernels.dispatch.contract import Choice, Problem, linear_problem
from jaxrl_kernels.engine import fused_loss, row_skip, saved_logits
from jaxrl_kernels.engine.linear_head import HeadCall, linear_from_parts
from jaxrl_kernels.head import geometry, rounded_logits
from jaxrl_kernels.sharding.entry import global_vocab

__all__ = ["HeadCall", "choose", "kept_search", "logprob_rows", "loss_rows"]


def kept_search(op: str, truncation, n_rows: int, vocab: int, backend: str | None):
    """The ``kept_set`` primitive for a call with a sampler's ``truncation`` (None without
    one) on ``n_rows`` rows of ``vocab`` columns a device: the requested backend's where it
    has one, else automatic choice's."""
    if truncation is None:
        return None
    return dispatch.resolve(
        op, Problem(n_rows=n_rows, vocab=vocab), backend, primitive="kept_set", strict=False
    ).impl


def choose(
    op: str,
    memory: Any,
    hidden,
    weight,
    bias,
    rows,
    call: HeadCall,
    backend: str | None,
    *,
    loss: bool = False,
    gemms: Choice | None = None,
) -> Choice:
    """``dispatch.resolve`` for a linear-head op with ``memory=`` on these operands (``rows``:
    the rows' shape): the kept-logits path (``choice.fast``) or a backend,
    and why (``call.batch_invariant``: the backend's batch-invariant implementation, always
    lean). ``loss``: the op is a loss of the log-probs (its fast mode keeps the gradient);
    ``gemms``: that loss's ``kept_gemms`` (:func:`_kept_gemms`)."""
    rows = tuple(rows)
    vocab = global_vocab(geometry.vocab_size(weight, call.weight_layout), call.vocab_axis)
    n_rows = math.prod(rows)
    problem = _problem(hidden, weight, bias, n_rows, call)
    # Row skipping's branches copy their rows of the kept buffer for XLA's GEMMs, except in a
    # fused loss whose backward GEMMs are ffi's, which read them in place (``kept_gemms``).
    in_place = loss and gemms is not None and gemms.backend == "ffi"
    request = memory_lib.Request(
        memory,
        rounded_logits.kept_bytes(n_rows, vocab, hidden.dtype, weight.dtype),
        rows + (vocab,),
        rounded_logits.kept_dtype(hidden.dtype, weight.dtype),
        loss=loss,
        skip_rows=None if in_place else row_skip.MIN_ROWS,
    )
    return dispatch.resolve(op, problem, backend, memory=request, kept="kept_logits")


def _kept_gemms(op: str, hidden, weight, bias, n_rows: int, call: HeadCall) -> Choice | None:
    """The ``kept_gemms`` primitive of a fused loss on ``n_rows`` rows (its fast mode's backward
    GEMMs on a row-skipping branch's rows), not recorded; None with ``call.truncation`` (that
    fast mode keeps the logits instead)."""
    if call.truncation is not None:
        return None
    problem = _problem(hidden, weight, bias, n_rows, call)
    return dispatch.select(op, problem, primitive="kept_gemms", strict=False)


def _problem(hidden, weight, bias, n_rows: int, call: HeadCall) -> Problem:
    flat_hidden = jax.ShapeDtypeStruct((n_rows, hidden.shape[-1]), hidden.dtype)
    return linear_problem(
        flat_hidden,
        weight,
        bias,
        weight_layout=call.weight_layout,
        return_entropy=call.return_entropy,
        batch_invariant=call.batch_invariant,
    )


def logprob_rows(hidden, weight, bias, targets, row_valid, call: HeadCall, choice: Choice):
    """The linear_logprobs primitive on validated inputs, by ``choice`` (:func:`choose`):
    hidden [..., D] with rows [...] (targets, row_valid: [...] or K ids [..., K]). Returns
    (logp like targets, entropy [...] | None), and with ``call.truncation`` whether each target
    is in its row's kept set."""
    find_kept = kept_search(
        "linear_logprobs",
        call.truncation,
        math.prod(hidden.shape[:-1]),
        geometry.vocab_size(weight, call.weight_layout),
        choice.backend if choice.explicit else None,
    )
    targets = targets.astype(jnp.int32)
    if choice.fast:
        return saved_logits.fast_linear_logprobs(
            choice.impl, hidden, weight, bias, targets, row_valid, call, find_kept=find_kept
        )
    return linear_from_parts(
        choice.impl,
        hidden,
        weight,
        bias,
        targets,
        row_valid,
        call,
        backward=choice.backward,
        find_kept=find_kept,
    )


def loss_rows(
    op: str,
    loss_fn,
    inputs,
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    call: HeadCall,
    *,
    memory: Any,
    backend: str | None,
):
    """``(loss_fn(logp, entropy | None, inputs), kept | None)`` on the head's log-probs of
    ``targets``: lean, the log-probs from :func:`logprob_rows`; fast, the loss's gradient
    taken in the forward (``fused_loss``: 3 GEMMs). With ``call.truncation`` the log-probs
    are the processed distribution's (the fast mode keeps the logits instead) and ``kept``
    says whether each target is in its row's kept set."""
    gemms = _kept_gemms(op, hidden, weight, bias, math.prod(targets.shape), call)
    choice = choose(
        op, memory, hidden, weight, bias, targets.shape, call, backend, loss=True, gemms=gemms
    )
    if choice.fast and gemms is not None:
        dispatch.record("kept_gemms", gemms)
        out = fused_loss.fused_linear_loss(
            choice.impl,
            loss_fn,
            hidden,
            weight,
            bias,
            targets.astype(jnp.int32),
            row_valid,
            inputs,
            call,
            gemms=gemms.impl,
        )
        return out, None
    logp, entropy, *kept = logprob_rows(hidden, weight, bias, targets, row_valid, call, choice)
    return loss_fn(logp, entropy, inputs), (kept[0] if kept else None)
