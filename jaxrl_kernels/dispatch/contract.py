"""The contract between the public ops and the backends: what an op asks for, what a backend
declares, and what the choice hands back.

An op describes its call as a :class:`Problem` and asks ``dispatch.resolve`` for the
implementation of a *primitive* (the backend-specific piece of work); a backend is a module
under ``jaxrl_kernels.backends`` that declares itself as ``BACKEND``, a :class:`Backend`; the
answer is a :class:`Choice`. The primitives:

=================  ===========================================================
primitive          what a backend implements
=================  ===========================================================
token_logprobs     log-probs of logits [..., V]: a ``logprob_core.Parts``
                   (kernel backends: per-device row statistics + backward) or
                   a ``logprob_core.Whole`` (reference: plain jnp)
paired_logprobs    the same for policy and reference logits sharing targets,
                   gradient to the policy only
linear_logprobs    the same for a linear head (hidden, weight, bias);
                   ``ffi``'s Parts have no backward of their own: the
                   :class:`Choice` carries the standalone one (``ffi``'s own on
                   Hopper), chosen when the backward pass is traced
linear_logprobs    ``(hidden[N,D], weight, bias | None, targets[N], lse[N],
_backward          entropy[N] | None, g_logp[N], g_ent[N] | None, *,
                   weight_layout, temperature) -> (d_hidden, d_weight,
                   d_bias | None)``, d_hidden float32 (the engine rounds
                   it after any sum over a vocabulary split): the
                   backward alone, for ``ffi``
                   (served by ffi, pallas and chunked); ``targets`` and
                   ``g_logp`` may be [N, K] (K ids per row:
                   ``head_ids.split_targets``), as for ``Parts.backward``
distill_divergence per-row divergence between two linear heads (``distill``):
                   a ``logprob_core.Parts`` (chunked, pallas, ffi) or
                   ``Whole`` (reference)
topk_logprobs      top-k logits, ids and lse of a linear head: a
                   ``logprob_core.Parts`` on every backend
ppo_loss           ``(ppo_inputs: ppo_math.PPOInputs, config: ppo_math.PPOConfig)
                   -> (loss, metrics)``
segment_ppo_loss   ``(ppo_inputs, config, packing: segment_math.Packing) ->
                   (loss, metrics)``: ``ppo_loss`` on packed rows, the
                   sequences the segments (pallas: per-token kernels, the
                   per-segment sums in jnp)
group_advantages   ``(rewards[B], segment_ids[B], num_groups, *,
                   normalize_std, std_ddof, eps) -> adv[B]``
kept_set           ``(logits: kept_set.Logits, n_rows, vocab, m[N], active[N],
                   truncation, *, vocab_axes, varying) -> kept_set.KeptSet``:
                   each row's kept set under a sampler's truncation, for the
                   log-prob ops' ``top_k`` / ``top_p`` / ``min_p`` (reference:
                   jnp passes over vocabulary chunks; ffi: a kernel on whole rows,
                   which also takes ``m=None`` with ``targets=``: then the rows'
                   own max and target, ``kept_set.finds_row_max``)
kept_logits        ``(plan, hidden[N,D], weight, bias | None, t_local[N],
                   row_valid[N], *, weight_layout, temperature, with_entropy)
                   -> (stats, target_rel, z)``: ``memory="fast"``'s forward
                   on one device, the logits ``z`` rounded to the head's
                   dtype and the row statistics of the rounded values (the
                   target logit unrounded), as ``rounded_logits.local_stats``
                   (reference: XLA's GEMM and reductions; ffi: one kernel,
                   which lays ``z`` out at ``plan.logits_rows`` rows where
                   that is set, the rows past N zero); with
                   ``exp_offsets=[N]`` (raw logits, no bias) ``z`` is
                   ``exp((h·Wᵀ − offset)/T)`` and the statistics are the
                   float32 logits' (``head.relative_probs``)
kept_gemms         ``(hidden[S,D], weight, dz[R,V], scale, *, weight_layout)
                   -> (d_hidden f32[S,D], d_weight)``: ``memory="fast"``'s
                   backward GEMMs on the first S ≤ R rows of the kept
                   gradient, ``scale`` the loss's float32 cotangent
                   (reference: XLA's GEMMs on ``dz[:S]``, which XLA copies
                   out; ffi: one custom call reading them in place)
=================  ===========================================================

``logprob_core`` states the contract of the log-prob parts (targets outside a device's
vocabulary slice, rows without a gradient); :mod:`engine` turns every op's per-device halves
into one differentiable, sharded op. How a backend is chosen is ``dispatch``.

Adding an op on a linear head:

1. its two per-device functions on flat rows, ``forward(plan, *operands) -> (*outputs,
   *residuals)`` and ``backward(plan, *operands, *residuals, *cotangents) -> cotangents``,
   and ``engine.vjp.differentiable`` with the operands' roles
   (``engine.linear_head.linear_head_op`` when its outputs are log-probs from row statistics);
   the math on tiles in a ``formulas/*_math`` module, shared with the kernels; its options as
   a config value (``config/``);
2. a row in :data:`OP_PRIMITIVE` (and the primitive in the table above) if backends serve
   its heavy part, and ``dispatch.resolve`` at its one call site (with ``memory=`` if it
   has a kept-logits mode);
3. each backend that serves it: the implementation in its package and an entry in its
   ``ops`` (and a reason in its ``declines`` for inputs it cannot take).

Adding a backend: a package under ``jaxrl_kernels/backends/`` whose ``__init__`` declares
``BACKEND`` (a :class:`Backend`: ``ops``, ``unavailable_reason``, ``declines(primitive,
problem)``, ``automatic``, and ``invariant_ops`` for ``batch_invariant=True``), importing no
other backend, and its name in ``dispatch.BACKENDS`` (best first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_kernels.head import geometry

# Public op -> the primitive whose backend the op's ``backend=`` argument picks.
OP_PRIMITIVE: dict[str, str] = {
    "token_logprobs": "token_logprobs",
    "linear_logprobs": "linear_logprobs",
    "ratio_kl": "paired_logprobs",
    "grpo_loss": "paired_logprobs",
    "linear_ppo_loss": "linear_logprobs",
    "linear_grpo_loss": "linear_logprobs",
    "linear_policy_gradient_loss": "linear_logprobs",
    "ppo_loss": "ppo_loss",
    "group_advantages": "group_advantages",
    "linear_distill_loss": "distill_divergence",
    "linear_topk_logprobs": "topk_logprobs",
    "linear_topk_distill_loss": "linear_logprobs",
}

# Primitives whose reference implementation holds a float32 [N, V] buffer.
VOCAB_PRIMITIVES = frozenset(
    {"token_logprobs", "paired_logprobs", "linear_logprobs", "distill_divergence", "topk_logprobs"}
)

# Forward primitive -> its backward on its own, for a backend whose forward has none (its
# ``Parts.backward`` is None). The reference backend has none (it differentiates itself).
STANDALONE_BACKWARDS: dict[str, str] = {"linear_logprobs": "linear_logprobs_backward"}

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to accept or decline a call."""

    n_rows: int = 0
    vocab: int = 0
    hidden_dim: int = 0
    dtype: str = "float32"
    """The dtype of the logits or of the hidden states."""
    weight_dtype: str | None = None
    """The head weight's dtype (None: no head)."""
    weight_layout: str = "vd"
    has_bias: bool = False
    return_entropy: bool = False
    teacher_dtype: str | None = None
    """A second head's hidden states' dtype (``distill_divergence``; None: no second head)."""
    teacher_weight_dtype: str | None = None
    teacher_hidden_dim: int = 0
    teacher_weight_layout: str = "vd"
    teacher_has_bias: bool = False
    batch_invariant: bool = False
    """Each row's results must be bitwise independent of the other rows (``batch_invariant=True``:
    the backend's :attr:`Backend.invariant_ops`)."""
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())

    @property
    def logits_bytes_f32(self) -> int:
        return 4 * self.n_rows * self.vocab

    @property
    def on_gpu(self) -> bool:
        return self.platform in GPU_PLATFORMS


def linear_problem(
    hidden, weight, bias, *, weight_layout: str, return_entropy: bool, batch_invariant: bool = False
) -> Problem:
    """The Problem of a linear_logprobs call (forward or backward) on flat [N, D] hidden states."""
    n_rows, dim = hidden.shape
    return Problem(
        n_rows=n_rows,
        vocab=geometry.vocab_size(weight, weight_layout),
        hidden_dim=dim,
        dtype=dtype_name(hidden),
        weight_dtype=dtype_name(weight),
        weight_layout=weight_layout,
        has_bias=bias is not None,
        return_entropy=return_entropy,
        batch_invariant=batch_invariant,
    )


def distill_problem(
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    *,
    weight_layout: str,
    teacher_weight_layout: str,
) -> Problem:
    """The Problem of a distill_divergence call: the student's head as :func:`linear_problem`
    on flat rows [N, D_s] (``hidden`` [..., D_s]), and the teacher's."""
    flat = jax.ShapeDtypeStruct((int(np.prod(hidden.shape[:-1])), hidden.shape[-1]), hidden.dtype)
    student = linear_problem(flat, weight, bias, weight_layout=weight_layout, return_entropy=False)
    return dataclasses.replace(
        student,
        teacher_dtype=dtype_name(t_hidden),
        teacher_weight_dtype=dtype_name(t_weight),
        teacher_hidden_dim=t_hidden.shape[-1],
        teacher_weight_layout=teacher_weight_layout,
        teacher_has_bias=t_bias is not None,
    )


def _serves_all(primitive: str, problem: Problem) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend module declares as its ``BACKEND``: the contract dispatch relies on."""

    name: str
    """Its name in ``dispatch.BACKENDS``."""
    ops: Mapping[str, Any]
    """Primitive -> implementation (a ``logprob_core.Parts`` / ``Whole`` for the log-prob
    primitives, a function otherwise; see the table above)."""
    unavailable_reason: Callable[[], str | None] = lambda: None
    """Why it cannot run in this process at all (not built, no such device); None if it can."""
    declines: Callable[[str, Problem], str | None] = _serves_all
    """Why it cannot serve these inputs (dtype, alignment, size); None if it can. Binding on
    an explicit request as well."""
    automatic: Callable[[str, Problem], str | None] = _serves_all
    """Why automatic choice passes it over although it can serve the call (it would be
    slower, or emulated); None if automatic choice takes it."""
    native_platforms: tuple[str, ...] | None = None
    """The platforms it runs natively on (None: all); elsewhere it is emulated."""
    invariant_ops: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Primitive -> the implementation for a call with ``Problem.batch_invariant``: schedules
    (tiles, splits, chunks, GEMM shapes) that do not depend on N, so that each row's results
    are bitwise independent of the other rows. A primitive missing here is declined for such
    a call."""

    def ops_for(self, problem: Problem) -> Mapping[str, Any]:
        """:attr:`invariant_ops` for a batch-invariant call, else :attr:`ops`."""
        return self.invariant_ops if problem.batch_invariant else self.ops


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of a selection: the backend, its implementation, and why."""

    backend: str
    impl: Callable[..., Any]
    explicit: bool
    declined: tuple[tuple[str, str], ...]  # (better backend, why it was not used)
    backward: Callable[[], Callable[..., Any]] | None = None
    """For a forward without a backward of its own: a thunk that resolves the standalone
    backward when the backward pass is traced (and records it for ``explain``)."""
    memory: Any = None
    """A linear-head op's ``memory.MemoryNote`` (``.mode``: ``"lean"`` or ``"fast"``); None
    for the other ops."""
    batch_invariant: bool = False
    """``impl`` is the backend's batch-invariant implementation (``Backend.invariant_ops``)."""

    @property
    def fast(self) -> bool:
        """``memory="fast"`` was chosen: no backend, the kept-logits path."""
        return self.memory is not None and self.memory.mode == "fast"


def dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


@dataclasses.dataclass(frozen=True)
class Parts:
    """The two per-device pieces of a kernel backend's log-prob op (their contract:
    ``engine.logprob_core``'s module docstring)."""

    stats: Callable[..., Any]
    backward: Callable[..., Any] | None  # None: ask dispatch for a standalone backward


@dataclasses.dataclass(frozen=True)
class Whole:
    """A log-prob op jax differentiates itself: ``fn(*local operands, targets, row_valid,
    vocab_axes=..., **options) -> outputs``."""

    fn: Callable[..., Any]
