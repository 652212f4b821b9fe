"""The one function that chooses a backend, and ``explain``, which reports the choices.

Every public op describes its call as a ``backend_contract.Problem`` and asks :func:`resolve`
for the implementation of a primitive (the table is in :mod:`backend_contract`); ``resolve``
chooses (:func:`select`) and notes the choice for :func:`explain`.

Each backend is a module under ``jaxrl_kernels.backends``, imported on first use, that
declares itself as ``BACKEND``, a ``backend_contract.Backend``: its ``ops`` (primitive ->
implementation), whether it can run in this process (``unavailable_reason``), which inputs it
cannot serve (``declines``), when automatic choice passes it over although it could serve the
call (``automatic``: the rules of docs/api.md, each kept by the backend it concerns) and the
types of its tuning knobs (``configs``). A requested backend (the ``backend=`` argument,
:func:`use_backend`, ``JAXRL_KERNELS_BACKEND``) is taken if it can serve the call; otherwise
automatic choice takes the first backend of :data:`BACKENDS` that all of these let through;
nothing else in the package decides.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxrl_kernels import logprob_core
from jaxrl_kernels.backend_contract import (OP_PRIMITIVE, STANDALONE_BACKWARDS, Backend, Choice,
                                            Problem)

BACKENDS: tuple[str, ...] = ("ffi", "pallas", "chunked", "reference")
"""Every backend, best first."""

_MODULES = {name: f"jaxrl_kernels.backends.{name}" for name in BACKENDS}

ENV_VAR = "JAXRL_KERNELS_BACKEND"

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrl_kernels_backend", default=None)


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
