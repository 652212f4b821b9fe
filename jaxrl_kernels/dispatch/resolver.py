"""The one function that chooses a backend (and a linear-head op's ``memory=`` mode).

Every public op describes its call as a ``contract.Problem`` and asks :func:`resolve`
for the implementation of a primitive (the table is in :mod:`contract`); ``resolve``
chooses (:func:`select`) and notes the choice for ``jaxrl_kernels.ops.explain``.

Each backend is a module under ``jaxrl_kernels.backends``, imported on first use, that
declares itself as ``BACKEND``, a ``contract.Backend``: its ``ops`` (primitive ->
implementation), whether it can run in this process (``unavailable_reason``), which inputs it
cannot serve (``declines``), when automatic choice passes it over although it could serve the
call (``automatic``: the rules of docs/api.md, each kept by the backend it concerns). A
requested backend (the ``backend=`` argument,
:func:`use_backend`, ``JAXRL_KERNELS_BACKEND``) is taken if it can serve the call; otherwise
automatic choice takes the first backend of :data:`BACKENDS` that all of these let through;
nothing else in the package decides. A call with ``Problem.batch_invariant`` gets the
backend's ``invariant_ops`` (a backend without one for the primitive declines it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
from collections.abc import Iterator
from typing import Any

from jaxrl_kernels.dispatch import memory as memory_lib
from jaxrl_kernels.dispatch import trace_log
from jaxrl_kernels.dispatch.contract import (
    OP_PRIMITIVE,
    STANDALONE_BACKWARDS,
    Backend,
    Choice,
    Parts,
    Problem,
)

BACKENDS: tuple[str, ...] = ("ffi", "pallas", "chunked", "reference")
"""Every backend, best first."""

_MODULES = {name: f"jaxrl_kernels.backends.{name}" for name in BACKENDS}

FAST = "xla-kept"
"""The ``Choice.backend`` of ``memory="fast"`` where no primitive makes the kept buffer
(``fused_distill``: XLA's GEMMs); the linear-head log-prob ops' fast mode is the backend that
serves ``kept_logits`` (``saved_logits``, ``fused_loss``)."""

ENV_VAR = "JAXRL_KERNELS_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrl_kernels_backend", default=None
)


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
    if primitive not in backend.ops_for(problem):
        return f"backend {name!r} has no batch-invariant {primitive!r}"
    return None


def scoped_backend() -> str | None:
    """The backend a :func:`use_backend` scope asks for, if any."""
    return _override.get()


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


def select(
    op: str,
    problem: Problem,
    backend: str | None = None,
    *,
    primitive: str | None = None,
    strict: bool = True,
) -> Choice:
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
    return _automatic(op, problem, primitive)


def _automatic(op: str, problem: Problem, primitive: str) -> Choice:
    """The first backend of :data:`BACKENDS` that serves ``primitive`` and that automatic
    choice takes."""
    declined = []
    for name in BACKENDS:
        why = _backend_refusal(name, primitive, problem) or _backend(name).automatic(
            primitive, problem
        )
        if why is None:
            return _choice(op, problem, primitive, name, False, tuple(declined))
        declined.append((name, why))
    raise AssertionError(f"no backend serves {primitive}: {declined}")  # reference serves all


def _choice(op, problem, primitive, name, explicit, declined) -> Choice:
    impl = _backend(name).ops_for(problem)[primitive]
    backward = None
    if isinstance(impl, Parts) and impl.backward is None:

        def backward():
            return resolve(
                op, problem, primitive=STANDALONE_BACKWARDS[primitive], strict=False
            ).impl

    return Choice(name, impl, explicit, declined, backward, batch_invariant=problem.batch_invariant)


def resolve(
    op: str,
    problem: Problem,
    backend: str | None = None,
    *,
    primitive: str | None = None,
    strict: bool = True,
    memory: memory_lib.Request | None = None,
    kept: str | None = None,
) -> Choice:
    """:func:`select`, recorded for :func:`explain` under ``primitive`` (given) or ``op``.

    Every call site uses this. A forward without a backward of its own (``Choice.backward``
    set) resolves its standalone backward here as well, when the backward pass is traced.

    ``memory``: a linear-head op's ``memory=`` request. Its mode is the argument, else that of
    the innermost ``memory_mode`` scope, else ``JAXRL_KERNELS_MEMORY``, else ``"lean"``
    (``memory.requested``, through ``memory.choose``: nowhere else). ``"fast"`` (or a budget
    the kept buffer fits) is an implementation of its own, the logits (or the loss's gradient)
    kept: its ``memory`` note says why, and the choice is the backend that
    automatic choice takes for the primitive ``kept`` (the one that makes the kept buffer:
    ``"kept_logits"`` for the linear-head log-prob ops; never a requested backend), or none
    (``FAST``, ``impl`` None) without ``kept``; otherwise a backend is selected as above, for
    ``"lean"``. Both are recorded with the reason (the mode's source and a byte budget's
    comparison included), once per call.
    """
    if memory is not None:
        wanted = None if backend is not None else requested_backend(None)
        note = memory_lib.choose(memory, backend, wanted, batch_invariant=problem.batch_invariant)
        if note.mode == "fast":
            record(op, note)
            if kept is None:
                return Choice(FAST, None, False, (), memory=note)
            choice = record(kept, _automatic(op, problem, kept))
            return dataclasses.replace(choice, memory=note)
    choice = select(op, problem, backend, primitive=primitive, strict=strict)
    record(primitive or op, choice)
    if memory is None:
        return choice
    record(op, note)
    return dataclasses.replace(choice, memory=note)


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
        if (
            isinstance(backend, Exception)
            or backend.unavailable_reason()
            or primitive not in backend.ops
        ):
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


# -- explain: the choices an op makes while it is traced abstractly ---------------------------


def record(step: str, note: Any) -> Any:
    """Note ``note`` (a :class:`Choice`, or anything with ``explain_line(step)``, such as
    ``memory.MemoryNote``) for an :func:`explain` in progress; returns it."""
    return trace_log.note(step, note)
