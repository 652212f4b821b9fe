"""The backend registry and the one function that chooses a backend.

Every public op describes its call as a :class:`Problem` and asks :func:`select`
for the implementation of a *primitive* (the backend-specific piece of work):

=================  ===========================================================
primitive          what a backend implements
=================  ===========================================================
token_logprobs     log-probs of logits [..., V]: a ``logprob_core.Parts``
                   (kernel backends: per-device row statistics + backward) or
                   a ``logprob_core.Whole`` (reference: plain jnp)
paired_logprobs    the same for policy and reference logits sharing targets,
                   gradient to the policy only
linear_logprobs    the same for a linear head (hidden, weight, bias);
                   ``ffi``'s Parts have no backward of their own: dispatch
                   picks one (``ffi``'s own on Hopper)
linear_logprobs    ``(hidden[N,D], weight, bias | None, targets[N], lse[N],
_backward          entropy[N] | None, g_logp[N], g_ent[N] | None, *,
                   weight_layout, temperature) -> (d_hidden, d_weight,
                   d_bias | None)``: the backward alone, for ``ffi``
                   (served by ffi, pallas and chunked)
distill_divergence per-row divergence between two linear heads (``distill``):
                   a ``logprob_core.Parts`` (chunked) or ``Whole`` (reference)
topk_logprobs      top-k logits, ids and lse of a linear head: a
                   ``logprob_core.Parts`` on every backend
ppo_loss           ``(ppo_inputs: rl_math.PPOInputs, config: rl_math.PPOConfig)
                   -> (loss, metrics)``
group_advantages   ``(rewards[B], segment_ids[B], num_groups, *,
                   normalize_std, std_ddof, eps) -> adv[B]``
=================  ===========================================================

``logprob_core`` states the contract of the log-prob parts (targets outside a device's
vocabulary slice, rows without a gradient) and holds the one custom_vjp and the sharding
(``sharding.run``) that every kernel backend shares.

Backends are modules under ``jaxrl_kernels.backends`` imported on first use.
Each exposes ``OPS`` (primitive -> callable), ``unavailable_reason() -> str |
None`` (can it run in this process at all) and ``declines(primitive, problem)
-> str | None`` (can it serve these inputs). The automatic-choice rules (docs/api.md)
live in :func:`_automatic_policy`; nothing else in the package decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax
import numpy as np

BACKENDS: tuple[str, ...] = ("ffi", "pallas", "chunked", "reference")
"""Every backend, best first."""

_MODULES = {name: f"jaxrl_kernels.backends.{name}" for name in BACKENDS}

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
}

# Primitives whose reference implementation holds a float32 [N, V] buffer.
VOCAB_PRIMITIVES = frozenset({"token_logprobs", "paired_logprobs", "linear_logprobs",
                              "distill_divergence", "topk_logprobs"})

# Backward passes on their own, for forwards without one. The reference backend has none (it
# differentiates itself); chunked serves them at any size, since they reuse the saved lse.
STANDALONE_BACKWARDS = frozenset({"linear_logprobs_backward"})

CHUNKED_THRESHOLD_BYTES = 256 * 2**20
"""On CPU, vocabulary ops switch from reference to chunked above this [N, V] f32 size."""

ENV_VAR = "JAXRL_KERNELS_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrl_kernels_backend", default=None)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a backend needs to know to accept or decline a call."""

    op: str
    n_rows: int = 0
    vocab: int = 0
    hidden_dim: int = 0
    dtype: str = "float32"
    weight_layout: str = "vd"
    has_bias: bool = False
    return_entropy: bool = False
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def logits_bytes_f32(self) -> int:
        return 4 * self.n_rows * self.vocab


def linear_problem(op: str, hidden, weight, bias, *, weight_layout: str,
                   return_entropy: bool) -> Problem:
    """The Problem of a linear_logprobs call (forward or backward) on flat [N, D] hidden states."""
    n_rows, dim = hidden.shape
    vocab = weight.shape[0] if weight_layout == "vd" else weight.shape[1]
    return Problem(op, n_rows=n_rows, vocab=vocab, hidden_dim=dim, dtype=dtype_name(hidden),
                   weight_layout=weight_layout, has_bias=bias is not None,
                   return_entropy=return_entropy,
                   extra=(("weight_dtype", dtype_name(weight)),))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of a selection: the backend, its implementation, and why."""

    backend: str
    impl: Callable[..., Any]
    explicit: bool
    declined: tuple[tuple[str, str], ...]  # (better backend, why it was not used)


def _validate_name(name: str, what: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{what}: unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


_loaded: dict[str, ModuleType | Exception] = {}


def _module(name: str) -> ModuleType | Exception:
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(_MODULES[name])
        except Exception as err:  # an unbuilt/unimportable backend is reported, not hidden
            _loaded[name] = err
    return _loaded[name]


def _backend_refusal(name: str, primitive: str, problem: Problem) -> str | None:
    """Why backend ``name`` cannot serve this call at all (explicit or not)."""
    mod = _module(name)
    if isinstance(mod, Exception):
        return f"backend {name!r} failed to import: {type(mod).__name__}: {mod}"
    why = mod.unavailable_reason() or mod.declines(primitive, problem)
    if why:
        return why
    if primitive not in mod.OPS:
        return f"backend {name!r} does not implement {primitive!r}"
    return None


def _automatic_policy(name: str, primitive: str, problem: Problem) -> str | None:
    """The automatic-choice rules (docs/api.md) beyond what a backend can serve."""
    on_gpu = problem.platform in ("gpu", "cuda", "rocm")
    if name == "ffi" and primitive not in ("linear_logprobs", "linear_logprobs_backward"):
        return "ffi serves only linear_logprobs (forward and backward)"
    if name == "pallas" and not on_gpu:
        return f"platform is {problem.platform!r}; pallas runs only in interpret mode there"
    if name == "chunked" and primitive in STANDALONE_BACKWARDS:
        return None
    if name == "chunked" and primitive in VOCAB_PRIMITIVES:
        size = problem.logits_bytes_f32
        if size <= CHUNKED_THRESHOLD_BYTES:
            return (f"a float32 [N, V] buffer is {size / 2**20:.1f} MiB "
                    f"<= {CHUNKED_THRESHOLD_BYTES // 2**20} MiB, so reference is used")
    if name == "chunked" and primitive not in VOCAB_PRIMITIVES:
        return "chunked adds nothing over reference for ops without a vocabulary axis"
    return None


def requested_backend(backend: str | None) -> str | None:
    """The backend asked for: the argument, else ``use_backend``, else the env variable."""
    if backend is not None:
        return _validate_name(backend, "backend")
    scoped = _override.get()
    if scoped is not None:
        return scoped
    env = os.environ.get(ENV_VAR)
    if env:
        return _validate_name(env, ENV_VAR)
    return None


def select(op: str, problem: Problem, backend: str | None = None, *,
           primitive: str | None = None, strict: bool = True) -> Choice:
    """The single selection function.

    ``op`` is the public op name; ``primitive`` defaults to the op's main
    primitive. With a requested backend (argument, ``use_backend`` or
    ``JAXRL_KERNELS_BACKEND``) that cannot serve the call, ``strict`` raises
    ``NotImplementedError``; composite ops pass ``strict=False`` for their
    secondary primitives, which then fall back to automatic choice.
    """
    primitive = primitive or OP_PRIMITIVE[op]
    wanted = requested_backend(backend)
    if wanted is not None:
        why = _backend_refusal(wanted, primitive, problem)
        if why is None:
            return Choice(wanted, _module(wanted).OPS[primitive], True, ())
        if strict:
            raise NotImplementedError(f"{op}: backend {wanted!r} cannot serve this call: {why}")
    declined = []
    for name in BACKENDS:
        why = _backend_refusal(name, primitive, problem) or _automatic_policy(name, primitive, problem)
        if why is None:
            return Choice(name, _module(name).OPS[primitive], False, tuple(declined))
        declined.append((name, why))
    raise AssertionError(f"no backend serves {primitive}: {declined}")  # reference serves all


def available_backends(op: str) -> tuple[str, ...]:
    """The backends that can run ``op`` in this process, in the order automatic choice uses them.

    Four groups, each in :data:`BACKENDS` order: the backends automatic choice picks for
    ordinary inputs here; those it picks only for large vocabulary problems (``chunked`` on
    CPU, above 256 MiB of float32 logits); those that run natively here but only when asked
    for by name; those that run here only emulated (``pallas`` off a GPU, in interpret mode,
    slowly). Backends that cannot run here at all (not built, wrong platform) are left out;
    every backend name, runnable or not, is in :data:`BACKENDS`.

    Args:
      op: a public op name, e.g. ``"linear_logprobs"``.

    Returns:
      A tuple of backend names: ``("reference", "chunked", "pallas")`` on a CPU;
      ``("ffi", "pallas", "reference", "chunked")`` for ``"linear_logprobs"`` on a Hopper GPU
      with the extension built.

    Example:
      >>> import jaxrl_kernels as jk
      >>> jk.available_backends("ppo_loss")  # on a CPU  # doctest: +SKIP
      ('reference', 'pallas')
    """
    if op not in OP_PRIMITIVE:
        raise ValueError(f"op: unknown op {op!r}; valid: {', '.join(sorted(OP_PRIMITIVE))}")
    primitive = OP_PRIMITIVE[op]
    ordinary = Problem(op, n_rows=1, vocab=1)
    large = Problem(op, n_rows=1, vocab=CHUNKED_THRESHOLD_BYTES)  # 4 * N * V > the threshold

    def rank(name: str) -> int:
        if _automatic_policy(name, primitive, ordinary) is None:
            return 0
        if _automatic_policy(name, primitive, large) is None:
            return 1
        return 3 if name == "pallas" and ordinary.platform not in ("gpu", "cuda", "rocm") else 2

    runnable = []
    for name in BACKENDS:
        mod = _module(name)
        if isinstance(mod, Exception) or mod.unavailable_reason() or primitive not in mod.OPS:
            continue
        runnable.append(name)
    return tuple(sorted(runnable, key=rank))  # stable: BACKENDS order within a group


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Within this scope, ``backend=None`` means ``name`` (``None`` restores automatic choice).

    The request applies to every piece of work of an op that the backend serves; a piece it
    cannot serve is chosen automatically (``explain`` shows each). An op called with
    ``backend=`` directly raises ``NotImplementedError`` if that backend cannot serve it.
    ``JAXRL_KERNELS_BACKEND=name`` does the same for the whole process. The backend is chosen
    when an op is traced: enter the scope before the first call of a jitted function.

    Args:
      name: a name in ``jaxrl_kernels.dispatch.BACKENDS``, or ``None``.

    Returns:
      A context manager.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> with jk.use_backend("chunked"):
      ...     logp = jk.token_logprobs(jnp.zeros((4, 8)), jnp.zeros(4, int))
      >>> logp.shape
      (4,)
    """
    if name is not None:
        _validate_name(name, "use_backend")
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


# -- explain: record the choices an op makes while it is traced abstractly ---------------

_recorder: contextvars.ContextVar[list[tuple[str, Choice | str]] | None] = contextvars.ContextVar(
    "jaxrl_kernels_recorder", default=None)


def record(op: str, choice: Choice | MemoryNote) -> Choice | MemoryNote:
    log = _recorder.get()
    if log is not None:
        log.append((op, choice))
    return choice


def plan_recorder(op: str) -> Callable[[Any], None]:
    """A callback for ``sharding.run``: notes how a step is laid out on the devices."""
    def note(plan) -> None:
        log = _recorder.get()
        if log is not None:
            log.append((op, plan.describe()))
    return note


def explain(op: str, *args: Any, **kwargs: Any) -> str:
    """Which backend each piece of work of ``op(*args, **kwargs)`` gets, and why.

    Traces the call abstractly (``jax.eval_shape``: nothing is computed) and reports, for each
    backend choice the op makes, the backend chosen and whether it was requested or
    automatic, why each better backend declined, an override in force, and how the step is
    laid out on the devices (``layout:``).

    Args:
      op: a public op name.
      *args, **kwargs: the op's arguments (arrays or ``jax.ShapeDtypeStruct``); no
        ``backend=``.

    Returns:
      The report, one line per choice or reason.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrl_kernels as jk
      >>> h = jax.ShapeDtypeStruct((512, 64), jnp.float32)
      >>> w = jax.ShapeDtypeStruct((32000, 64), jnp.float32)
      >>> t = jax.ShapeDtypeStruct((512,), jnp.int32)
      >>> print(jk.explain("linear_logprobs", h, w, t).splitlines()[0])  # on a CPU
      linear_logprobs: reference (automatic)
    """
    import jaxrl_kernels  # the public ops

    if op not in OP_PRIMITIVE:
        raise ValueError(f"op: unknown op {op!r}; valid: {', '.join(sorted(OP_PRIMITIVE))}")
    if kwargs.get("backend") is not None:
        raise ValueError("explain: pass no backend= (explain describes the automatic choice)")
    fn = getattr(jaxrl_kernels, op)
    log: list[tuple[str, Choice]] = []
    token = _recorder.set(log)
    try:
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
    finally:
        _recorder.reset(token)
    lines = []
    wanted = requested_backend(None)
    if wanted is not None:
        source = "use_backend" if _override.get() is not None else ENV_VAR
        lines.append(f"{op}: backend override {wanted!r} is in force ({source})")
    for step, choice in log:
        if isinstance(choice, str):  # a layout note from sharding.run
            lines.append(f"  layout: {choice}")
            continue
        if isinstance(choice, MemoryNote):  # fast: the op's own line; lean: under its backend
            lines.append(f"{step}: {choice.text}" if choice.mode == "fast"
                         else f"  memory: {choice.text}")
            continue
        how = "requested" if choice.explicit else "automatic"
        lines.append(f"{step}: {choice.backend} ({how})")
        for name, why in choice.declined:
            lines.append(f"  - {name} declined: {why}")
    return "\n".join(lines)


# -- the memory mode of the linear-head ops ----------------------------------------------------

MEMORY_MODES = ("lean", "fast")
"""``memory=`` of the linear-head ops: ``"lean"`` (the default) keeps nothing ``[N, V]``-sized
and recomputes the logits in the backward (4 GEMMs); ``"fast"`` keeps the forward's logits for
the backward (3 GEMMs, ``saved_logits``); an int is a byte budget: ``"fast"`` when the kept
logits fit in it, else ``"lean"``."""


@dataclasses.dataclass(frozen=True)
class MemoryNote:
    """What :func:`memory_mode` decided, for :func:`explain`."""

    mode: str
    text: str


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} bytes"


def memory_mode(op: str, memory: Any, kept_bytes: int, kept_shape: tuple[int, ...],
                kept_dtype: Any, backend: str | None) -> MemoryNote:
    """``"lean"`` or ``"fast"`` (``.mode``) for a linear-head op's ``memory=`` argument, with the
    reason (``.text``; pass the note to :func:`record` for :func:`explain`). ``kept_bytes``:
    what ``"fast"`` would keep from forward to backward."""
    is_budget = isinstance(memory, (int, np.integer)) and not isinstance(memory, bool)
    if not (is_budget or (isinstance(memory, str) and memory in MEMORY_MODES)):
        raise ValueError(f"memory: expected 'lean', 'fast' or a byte budget (an int >= 0), "
                         f"got {memory!r}")
    size = _size(kept_bytes)
    if is_budget:
        if memory < 0:
            raise ValueError(f"memory: a byte budget must be >= 0, got {memory}")
        mode = "fast" if kept_bytes <= memory else "lean"
        why = (f"memory={int(memory)}: a budget of {_size(int(memory))} "
               f"{'>=' if mode == 'fast' else '<'} the {size} of logits 'fast' keeps")
    else:
        mode, why = memory, f"memory={memory!r}"
    if mode == "fast" and backend is not None:
        raise ValueError(f"backend: {backend!r} serves memory='lean' only; memory='fast' computes "
                         "the logits with XLA's GEMM and keeps them (pass backend=None)")
    if mode == "fast":
        text = (f"memory fast ({why}): the head's logits kept as {np.dtype(kept_dtype).name} "
                f"{list(kept_shape)} ({size}) for the backward; XLA's GEMMs, 3 per "
                "forward+backward")
        wanted = requested_backend(None)
        if wanted is not None:
            text += f"; the backend override {wanted!r} applies to memory='lean' only"
    else:
        text = (f"lean ({why}): nothing [N, V]-sized kept; the backward recomputes the logits "
                "(4 GEMMs per forward+backward)")
    return MemoryNote(mode, text)


def dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name
