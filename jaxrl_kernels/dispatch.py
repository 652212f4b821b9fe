"""The backend contract, the registry, and the one function that chooses a backend.

Every public op describes its call as a :class:`Problem` and asks :func:`resolve` for the
implementation of a *primitive* (the backend-specific piece of work); ``resolve`` chooses
(:func:`select`) and notes the choice for :func:`explain`:

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

Each backend is a module under ``jaxrl_kernels.backends``, imported on first use, that
declares itself as ``BACKEND``, a :class:`Backend`: its ``ops`` (primitive -> implementation),
whether it can run in this process (``unavailable_reason``), which inputs it cannot serve
(``declines``), when automatic choice passes it over although it could serve the call
(``automatic``: the rules of docs/api.md, each kept by the backend it concerns) and the
types of its tuning knobs (``configs``). Automatic choice takes the first backend of
:data:`BACKENDS` that all of these let through; nothing else in the package decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_kernels import head, logprob_core

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

# Forward primitive -> its backward on its own, for a backend whose forward has none (its
# ``Parts.backward`` is None). The reference backend has none (it differentiates itself).
STANDALONE_BACKWARDS: dict[str, str] = {"linear_logprobs": "linear_logprobs_backward"}

ENV_VAR = "JAXRL_KERNELS_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrl_kernels_backend", default=None)


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
    platform: str = dataclasses.field(default_factory=lambda: jax.default_backend())

    @property
    def logits_bytes_f32(self) -> int:
        return 4 * self.n_rows * self.vocab

    @property
    def on_gpu(self) -> bool:
        return self.platform in GPU_PLATFORMS


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def linear_problem(hidden, weight, bias, *, weight_layout: str, return_entropy: bool) -> Problem:
    """The Problem of a linear_logprobs call (forward or backward) on flat [N, D] hidden states."""
    n_rows, dim = hidden.shape
    return Problem(n_rows=n_rows, vocab=head.vocab_size(weight, weight_layout), hidden_dim=dim,
                   dtype=dtype_name(hidden), weight_dtype=dtype_name(weight),
                   weight_layout=weight_layout, has_bias=bias is not None,
                   return_entropy=return_entropy)


def _serves_all(primitive: str, problem: Problem) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a backend module declares as its ``BACKEND``: the contract dispatch relies on."""

    name: str
    """Its name in :data:`BACKENDS`."""
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
    configs: Mapping[str, type] = dataclasses.field(default_factory=dict)
    """Primitive -> the type of the knobs that tune its kernels (none for plain jnp)."""


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


def _validate_name(name: str, what: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{what}: unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


_loaded: dict[str, Any] = {}


def _backend(name: str) -> Backend | Exception:
    """The ``BACKEND`` of a backend module, or the error that kept it from importing."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(_MODULES[name])
        except Exception as err:  # an unbuilt/unimportable backend is reported, not hidden
            _loaded[name] = err
    mod = _loaded[name]
    return mod if isinstance(mod, Exception) else mod.BACKEND


def _backend_refusal(name: str, primitive: str, problem: Problem) -> str | None:
    """Why backend ``name`` cannot serve this call at all (explicit or not)."""
    backend = _backend(name)
    if isinstance(backend, Exception):
        return f"backend {name!r} failed to import: {type(backend).__name__}: {backend}"
    why = backend.unavailable_reason() or backend.declines(primitive, problem)
    if why:
        return why
    if primitive not in backend.ops:
        return f"backend {name!r} does not implement {primitive!r}"
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
    """The single selection function (:func:`resolve` also records its outcome).

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
            return _choice(op, problem, primitive, wanted, True, ())
        if strict:
            raise NotImplementedError(f"{op}: backend {wanted!r} cannot serve this call: {why}")
    declined = []
    for name in BACKENDS:
        why = (_backend_refusal(name, primitive, problem)
               or _backend(name).automatic(primitive, problem))
        if why is None:
            return _choice(op, problem, primitive, name, False, tuple(declined))
        declined.append((name, why))
    raise AssertionError(f"no backend serves {primitive}: {declined}")  # reference serves all


def _choice(op, problem, primitive, name, explicit, declined) -> Choice:
    impl = _backend(name).ops[primitive]
    backward = None
    if isinstance(impl, logprob_core.Parts) and impl.backward is None:
        def backward():
            return resolve(op, problem, primitive=STANDALONE_BACKWARDS[primitive],
                           strict=False).impl
    return Choice(name, impl, explicit, declined, backward)


def resolve(op: str, problem: Problem, backend: str | None = None, *,
            primitive: str | None = None, strict: bool = True) -> Choice:
    """:func:`select`, recorded for :func:`explain` under ``primitive`` (given) or ``op``.

    Every call site uses this. A forward without a backward of its own (``Choice.backward``
    set) resolves its standalone backward here as well, when the backward pass is traced.
    """
    choice = select(op, problem, backend, primitive=primitive, strict=strict)
    return record(primitive or op, choice)


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
    ordinary = Problem(n_rows=1, vocab=1)
    large = Problem(n_rows=1, vocab=2**30)  # 4 GiB of float32 logits: beyond every size rule

    def rank(backend: Backend) -> int:
        if backend.automatic(primitive, ordinary) is None:
            return 0
        if backend.automatic(primitive, large) is None:
            return 1
        native = backend.native_platforms
        return 3 if native is not None and ordinary.platform not in native else 2

    runnable = []
    for name in BACKENDS:
        backend = _backend(name)
        if (isinstance(backend, Exception) or backend.unavailable_reason()
                or primitive not in backend.ops):
            continue
        runnable.append(backend)
    return tuple(b.name for b in sorted(runnable, key=rank))  # stable: BACKENDS order in a group


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

_recorder: contextvars.ContextVar[list[tuple[str, Any]] | None] = contextvars.ContextVar(
    "jaxrl_kernels_recorder", default=None)


def record(step: str, note: Any) -> Any:
    """Note ``note`` (a :class:`Choice`, or anything with ``explain_line(step)``, such as
    ``memory.MemoryNote``) for an :func:`explain` in progress; returns it."""
    log = _recorder.get()
    if log is not None:
        log.append((step, note))
    return note


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
    log: list[tuple[str, Any]] = []
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
        if not isinstance(choice, Choice):
            lines.append(choice.explain_line(step))
            continue
        how = "requested" if choice.explicit else "automatic"
        lines.append(f"{step}: {choice.backend} ({how})")
        for name, why in choice.declined:
            lines.append(f"  - {name} declined: {why}")
    return "\n".join(lines)


def dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name
