"""Per-token log-probabilities (and entropies) from logits or from a linear LM head."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxrl_kernels import dispatch
from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.config.sampler import LEGACY as SAMPLER_LEGACY
from jaxrl_kernels.config.sampler import Sampler, truncation_of
from jaxrl_kernels.dispatch.contract import Problem, dtype_name
from jaxrl_kernels.engine import head_entry, logprob_core
from jaxrl_kernels.engine.linear_head import AxisName, HeadCall
from jaxrl_kernels.sharding.entry import global_vocab


def _row_valid(targets, ignore_index):
    if ignore_index is None:
        return jnp.ones(targets.shape, jnp.bool_), None
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index).__name__}")
    ignored = targets == ignore_index
    return ~ignored, ignored


def token_logprobs(
    logits: ArrayLike,
    targets: ArrayLike,
    *,
    temperature: float = 1.0,
    ignore_index: int | None = None,
    return_entropy: bool = False,
    sampler: Sampler | None = None,
    return_kept: bool = False,
    batch_invariant: bool = False,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> jax.Array | tuple[jax.Array, ...]:
    """Log-probabilities of the target tokens under ``softmax(logits / temperature)``.

    ``logp = z[target] - logsumexp(z)`` with ``z = logits / temperature`` in float32, and
    optionally the entropy of ``softmax(z)``. Differentiable in ``logits``.

    Args:
      logits: ``[..., V]`` float32, bfloat16 or float16.
      targets: ``[...]`` integer token ids (``logits.shape[:-1]``).
      temperature: ``> 0``.
      ignore_index: where ``targets == ignore_index``, both outputs are 0, with no gradient.
      return_entropy: also return the entropy.
      backend: ``"reference"``, ``"chunked"``, ``"pallas"`` or ``None`` (automatic; see
        ``explain``).
      vocab_axis: inside ``jax.shard_map``, the mesh axis over which ``logits`` holds
        consecutive slices of the vocabulary (targets stay global ids; results are global).
      sampler: a ``jk.Sampler`` (the rollout sampler's ``top_k`` / ``top_p`` / ``min_p``;
        None: no truncation): the log-probs (and entropy) of the distribution it samples from,
        ``softmax(z)`` on each row's kept set, renormalised (min-p, then top-k, then top-p, as
        vLLM; ties at a threshold kept; see docs/api.md "Sampler-matched log-probs"). A target
        outside its row's kept set gets ``z[target] − lse(kept set)`` (finite) and the
        gradient of that expression.
      return_kept: also return whether each target is in its row's kept set (bool; False
        on ignored rows; all True with no truncation).
      batch_invariant: each row's outputs and gradient bitwise independent of the other rows
        and of N (schedules that do not depend on N, on every backend; not with a
        truncation). See docs/api.md "Batch-invariant log-probs".
      **deprecated: ``top_k``, ``top_p``, ``min_p`` (use ``sampler=``), until 0.3.

    Returns:
      float32 ``logp`` ``[...]``, then ``entropy`` with ``return_entropy=True``, then
      ``kept`` with ``return_kept=True``.
      Another target outside ``[0, V)`` raises ``ValueError`` when concrete; traced, it gives
      NaN there (or raises in check mode, see ``checks``).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits = jnp.array([[0.0, 0.0], [0.0, 2.0]])
      >>> jk.token_logprobs(logits, jnp.array([0, 1])).round(3)
      Array([-0.693, -0.127], dtype=float32)
    """
    logits = check.floating("logits", logits)
    check.rank("logits", logits, range(1, 33), "[..., V]")
    targets = check.integer("targets", targets)
    check.shape("targets", targets, logits.shape[:-1], "logits.shape[:-1]")
    check.positive("temperature", temperature)
    truncation = truncation_of(_sampler("token_logprobs", sampler, deprecated))
    local_vocab = logits.shape[-1]
    if local_vocab == 0:
        raise ValueError("logits: expected a non-empty vocabulary axis, got V = 0")
    vocab = global_vocab(local_vocab, vocab_axis)
    row_valid, ignored = _row_valid(targets, ignore_index)
    check.targets_in_range("targets", targets, vocab, ignored)

    _check_invariant(batch_invariant, truncation)
    problem = Problem(
        n_rows=math.prod(targets.shape),
        vocab=local_vocab,
        dtype=dtype_name(logits),
        return_entropy=return_entropy,
        batch_invariant=bool(batch_invariant),
    )
    choice = dispatch.resolve("token_logprobs", problem, backend)
    logp, entropy, *kept = logprob_core.token_from_parts(
        choice.impl,
        logits,
        targets.astype(jnp.int32),
        row_valid,
        temperature=float(temperature),
        return_entropy=bool(return_entropy),
        vocab_axis=vocab_axis,
        truncation=truncation,
        find_kept=head_entry.kept_search(
            "token_logprobs", truncation, problem.n_rows, local_vocab, backend
        ),
    )
    return _outputs(logp, entropy, kept, row_valid, return_entropy, return_kept)


def _sampler(op: str, sampler: Sampler | None, deprecated: dict) -> Sampler | None:
    """The call's ``Sampler``: ``sampler=``, or one from the deprecated ``top_k`` / ``top_p`` /
    ``min_p`` keywords."""
    return legacy.take(
        op,
        deprecated,
        {"sampler": sampler},
        (SAMPLER_LEGACY,),
    )["sampler"]


def _check_invariant(batch_invariant, truncation, k_ids=False):
    """``batch_invariant=True`` takes one target per position and no sampler truncation."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    if batch_invariant and truncation is not None:
        raise ValueError(
            "batch_invariant: top_k, top_p and min_p are not batch-invariant "
            "(their kept-set passes take all rows at once)"
        )
    if batch_invariant and k_ids:
        raise ValueError("batch_invariant: takes one target per position, not K ids")


def _outputs(logp, entropy, kept, row_valid, return_entropy, return_kept):
    """``logp``, then the entropy and whether each target is kept, as asked."""
    outs = (logp,) + ((entropy,) if return_entropy else ())
    if return_kept:
        outs += (kept[0] if kept else row_valid & jnp.ones(logp.shape, bool),)
    return outs[0] if len(outs) == 1 else outs


def linear_logprobs(
    hidden: ArrayLike,
    weight: ArrayLike,
    targets: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    weight_layout: str = "vd",
    temperature: float = 1.0,
    ignore_index: int | None = None,
    return_entropy: bool = False,
    sampler: Sampler | None = None,
    return_kept: bool = False,
    batch_invariant: bool = False,
    memory: str | int | None = None,
    backend: str | None = None,
    vocab_axis: AxisName | None = None,
    **deprecated: Any,
) -> jax.Array | tuple[jax.Array, ...]:
    """``token_logprobs(hidden @ W^T + bias, targets)`` without materialising the logits.

    Same outputs and the same gradients as ``token_logprobs`` on the logits, chained into
    ``hidden``, ``weight`` and ``bias``; no backend except ``"reference"`` ever holds the
    ``[N, V]`` logits, forward or backward, unless ``memory="fast"`` asks to keep them.

    Args:
      hidden: ``[..., D]`` float (a model's final hidden states).
      weight: the LM head: ``[V, D]`` for ``weight_layout="vd"`` (a head or a tied embedding
        table), ``[D, V]`` for ``"dv"`` (the kernel of a Flax ``nn.Dense`` / ``nnx.Linear``).
      targets: ``[...]`` integer token ids (``hidden.shape[:-1]``), or ``[..., K]``: K ids
        per position, each position's log-probs at all of them from one pass over the
        vocabulary (ids ``< 0`` are padding: log-prob 0, no gradient).
      bias: ``[V]`` or ``None``.
      weight_layout: ``"vd"`` or ``"dv"``, as above.
      temperature, ignore_index, return_entropy, backend: as in ``token_logprobs`` (backend
        also ``"ffi"``: the CUDA kernels on Hopper GPUs).
      vocab_axis: inside ``jax.shard_map``, the mesh axis over which ``weight`` (and
        ``bias``) hold consecutive vocabulary slices; targets stay global ids.
      memory: ``"lean"`` (nothing ``[N, V]`` kept: the backward recomputes the logits),
        ``"fast"`` (the forward's logits kept for the backward as float16 / float32: one GEMM
        fewer for ``N·V·2`` bytes) or an int byte budget (``"fast"`` when they fit in it);
        ``None``: the mode of ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else ``"auto"``.
      sampler, return_kept: the sampler's truncation, as in ``token_logprobs`` (one target
        per position); each row's kept set is found in passes over the vocabulary, no
        ``[N, V]`` buffer.
      batch_invariant: as in ``token_logprobs`` (also d_hidden of each row; one target per
        position, ``memory="lean"``).
      **deprecated: ``top_k``, ``top_p``, ``min_p`` (use ``sampler=``), until 0.3.

    Returns:
      float32 ``logp`` shaped like ``targets``, then ``entropy`` with ``return_entropy=True``
      (``[...]``, one per position; 0 where every id of a position is padding or
      ``ignore_index``), then ``kept`` with ``return_kept=True``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrl_kernels as jk
      >>> hidden = jnp.ones((2, 3, 8))                   # [B, T, D]
      >>> head = jnp.zeros((8, 50))                      # an nnx.Linear kernel, [D, V]
      >>> logp = jk.linear_logprobs(hidden, head, jnp.zeros((2, 3), int), weight_layout="dv")
      >>> logp.shape, float(logp[0, 0]).__round__(3)     # uniform over 50 tokens: -log 50
      ((2, 3), -3.912)
    """
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    targets = check.integer("targets", targets)
    rows = hidden.shape[:-1]
    if targets.ndim == hidden.ndim and targets.shape[:-1] == rows and targets.shape[-1] >= 1:
        row_valid, _ = _row_valid(targets, ignore_index)
        row_valid = row_valid & (targets >= 0)  # K ids per row: ids < 0 are padding
        ignored = ~row_valid
    else:
        if targets.ndim == hidden.ndim:
            raise ValueError(
                f"targets: expected shape {tuple(rows)} (hidden.shape[:-1]) or "
                f"{tuple(rows)} + (K,) with K >= 1, got {tuple(targets.shape)}"
            )
        check.shape("targets", targets, rows, "hidden.shape[:-1]")
        row_valid, ignored = _row_valid(targets, ignore_index)
    check.positive("temperature", temperature)
    truncation = truncation_of(_sampler("linear_logprobs", sampler, deprecated))
    if truncation is not None and targets.ndim == hidden.ndim:
        raise ValueError("top_k, top_p and min_p take one target per position, not K ids")
    _check_invariant(batch_invariant, truncation, k_ids=targets.ndim == hidden.ndim)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.targets_in_range("targets", targets, vocab, ignored)
    call = HeadCall(
        weight_layout=weight_layout,
        temperature=float(temperature),
        return_entropy=bool(return_entropy),
        vocab_axis=vocab_axis,
        truncation=truncation,
        batch_invariant=batch_invariant,
    )
    choice = head_entry.choose("linear_logprobs", memory, hidden, weight, bias, rows, call, backend)
    logp, entropy, *kept = head_entry.logprob_rows(
        hidden, weight, bias, targets, row_valid, call, choice
    )
    return _outputs(logp, entropy, kept, row_valid, return_entropy, return_kept)
