"""``memory=`` of the linear-head ops: keep the head's logits for the backward, or not.

``"lean"`` keeps nothing ``[N, V]``-sized and recomputes the logits in the backward (4 GEMMs
per forward+backward); ``"fast"`` keeps the forward's logits for the backward (3 GEMMs,
:mod:`jaxrl_kernels.engine.saved_logits`); an int is a byte budget: ``"fast"`` when the kept
logits fit in it, else ``"lean"``; ``"auto"`` (the default) is the budget
1/:data:`AUTO_FRACTION` of the device's memory, ``"lean"`` where the device reports none.
An op states its request (:class:`Request`: the argument and what ``"fast"`` would keep);
``dispatch.resolve`` decides with :func:`choose` and records why, for ``explain``. An op's
``memory=None`` (its default) takes the mode of the innermost :func:`memory_mode` scope, else
of ``JAXRL_KERNELS_MEMORY``, else ``"auto"`` (:func:`requested`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

MODES = ("lean", "fast", "auto")
"""The named modes of ``memory=`` (an int byte budget is the fourth form)."""

DEFAULT = "auto"
"""The mode of ``memory=None`` outside every :func:`memory_mode` scope, without the variable."""

AUTO_FRACTION = 8
"""``"auto"``: ``"fast"`` when its kept buffer fits in 1/AUTO_FRACTION of the device's memory
(XLA's ``bytes_limit``), else ``"lean"``. Live memory is not known when a call is traced, so
the budget is a fixed, conservative share: the plain code it replaces keeps the same logits
in 16 bits and their float32 log-softmax besides (3× the bytes)."""


def device_memory() -> int | None:
    """The memory of the default backend's first device (XLA's ``bytes_limit``), or None
    where the runtime does not report one (CPU)."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a runtime without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


ENV_VAR = "JAXRL_KERNELS_MEMORY"

_scoped: contextvars.ContextVar[str | int | None] = contextvars.ContextVar(
    "jaxrl_kernels_memory", default=None
)


def _is_budget(memory: Any) -> bool:
    return isinstance(memory, (int, np.integer)) and not isinstance(memory, bool)


def check(memory: Any, what: str = "memory") -> str | int:
    """``memory`` if it is a mode of :data:`MODES` or a byte budget (an int >= 0), else a
    ``ValueError`` whose message starts with ``what``."""
    if not (_is_budget(memory) or (isinstance(memory, str) and memory in MODES)):
        raise ValueError(
            f"{what}: expected 'lean', 'fast', 'auto' or a byte budget (an int >= 0), "
            f"got {memory!r}"
        )
    if _is_budget(memory) and memory < 0:
        raise ValueError(f"{what}: a byte budget must be >= 0, got {memory}")
    return int(memory) if _is_budget(memory) else memory


def requested(memory: Any) -> tuple[str | int, str]:
    """The mode in force for an op's ``memory=`` argument, and how it was asked for (as
    ``explain`` shows it): the argument unless ``None``, else the innermost
    :func:`memory_mode` scope, else the variable ``JAXRL_KERNELS_MEMORY`` (``fast``, ``lean``
    or a decimal byte count), else :data:`DEFAULT`. A bad value is a ``ValueError`` naming its
    source."""
    if memory is not None:
        memory = check(memory)
        return memory, f"memory={memory!r}"
    scoped = _scoped.get()
    if scoped is not None:
        return scoped, f"jk.memory_mode({scoped!r})"
    env = os.environ.get(ENV_VAR)
    if env:
        return check(int(env) if env.isdecimal() else env, ENV_VAR), f"{ENV_VAR}={env}"
    return DEFAULT, f"memory={DEFAULT!r}"


@contextlib.contextmanager
def memory_mode(mode: str | int | None) -> Iterator[None]:
    """Within this scope, an op's ``memory=None`` (its default) means ``mode``.

    For the ops from hidden states (``linear_logprobs``, the linear losses,
    ``linear_distill_loss``): the mode is the ``memory=`` argument when given, else that of
    the innermost scope, else the environment variable ``JAXRL_KERNELS_MEMORY`` (``fast``,
    ``lean``, ``auto`` or a decimal byte count, for the whole process), else ``"auto"``. ``explain``
    says which. The mode is read when an op is traced: a function jitted and traced inside the
    scope keeps its mode when called again outside it (same shapes, no new trace).

    Args:
      mode: ``"lean"``, ``"fast"``, ``"auto"``, a byte budget (an int >= 0: ``"fast"`` when
        the kept buffer fits in it), or ``None``: within this scope, as outside every scope
        (the variable, else ``"auto"``). Anything else is a ``ValueError`` on entry, as the
        ``memory=`` argument's.

    Returns:
      A context manager.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> h, w, t = jnp.ones((4, 8)), jnp.zeros((50, 8)), jnp.zeros(4, int)
      >>> with jk.memory_mode("fast"):
      ...     print(jk.explain("linear_logprobs", h, w, t).splitlines()[0])
      linear_logprobs: memory fast (jk.memory_mode('fast')): the head's logits kept ...
    """
    token = _scoped.set(None if mode is None else check(mode))
    try:
        yield
    finally:
        _scoped.reset(token)


@dataclasses.dataclass(frozen=True)
class MemoryNote:
    """What :func:`choose` decided, for ``explain``."""

    mode: str
    text: str

    def explain_line(self, step: str) -> str:
        """Its line in ``explain``: fast, the op's own line; lean, under its backend's."""
        return f"{step}: {self.text}" if self.mode == "fast" else f"  memory: {self.text}"


def _row_skip_peak(kept_shape, min_rows: int) -> str:
    """What the fast mode's peak adds where it skips masked rows: XLA assigns every row-count
    branch's copy of its kept rows' gradient when it compiles (docs/api.md, "Padded and masked
    rows"). Empty below ``min_rows`` rows, where no device skips any."""
    if int(np.prod(kept_shape[:-1])) < min_rows:
        return ""
    return (
        f"; where a device runs {min_rows} rows or more and the vocabulary whole, masked rows are "
        "skipped and the peak holds up to about 7/8 of that again (each row count's copy of "
        "its kept rows' gradient)"
    )


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} bytes"


@dataclasses.dataclass(frozen=True)
class Request:
    """A linear-head op's ``memory=`` argument (``None``: not given, :func:`requested`) and
    what ``"fast"`` would keep from its forward to its backward (``kept_bytes`` of
    ``kept_dtype`` in ``kept_shape``). ``loss``: the op's
    fast mode takes its gradient in the forward (:mod:`jaxrl_kernels.engine.fused_loss`,
    ``fused_distill``); ``gemms``: the GEMMs per forward+backward of ``"fast"`` and
    ``"lean"``; ``kept``: what a loss's fast mode keeps; ``skip_rows``: the fewest rows on a
    device from which its fast mode skips masked rows (``engine.row_skip``), which adds
    branch copies to its peak (None: it runs every row, or its branches' GEMMs read the kept
    rows in place: a fused loss on ffi's ``kept_gemms``)."""

    memory: Any
    kept_bytes: int
    kept_shape: tuple[int, ...]
    kept_dtype: Any
    loss: bool = False
    gemms: tuple[int, int] = (3, 4)
    kept: str = "the head's logits, then their gradient in their place"
    skip_rows: int | None = None


def choose(
    request: Request,
    backend: str | None,
    wanted: str | None = None,
    *,
    batch_invariant: bool = False,
) -> MemoryNote:
    """``"lean"`` or ``"fast"`` (``.mode``) for ``request``, with the reason (``.text``): its
    ``memory`` as :func:`requested` resolves it. ``backend``: the op's ``backend=`` argument
    (with ``"fast"`` from the op's own ``memory=``, an error: the fast mode has no backend;
    with ``"fast"`` from a scope or the variable, ``"lean"`` on that backend); ``wanted``: a
    backend requested by ``use_backend`` or the environment, which ``"fast"`` notes it does
    not use. ``batch_invariant``: the op's ``batch_invariant=True``, which ``"fast"`` does not
    serve (its GEMM and reductions take all N rows at once): ``memory="fast"`` is an error,
    a budget, a scope or the variable give ``"lean"``."""
    memory, asked = requested(request.memory)
    kept_bytes, kept_shape, kept_dtype = request.kept_bytes, request.kept_shape, request.kept_dtype
    loss, gemms, kept = request.loss, request.gemms, request.kept
    size = _size(kept_bytes)
    automatic = memory == "auto"
    if automatic:
        total = device_memory()
        if total is None:
            memory, asked = "lean", f"{asked}: the device reports no memory size"
        else:
            memory = total // AUTO_FRACTION
            asked = f"{asked}: 1/{AUTO_FRACTION} of the device's {_size(total)}"
    if isinstance(memory, int):
        mode = "fast" if kept_bytes <= memory else "lean"
        why = (
            f"{asked}: a budget of {_size(memory)} "
            f"{'>=' if mode == 'fast' else '<'} the {size} of logits 'fast' keeps"
        )
    else:
        mode, why = memory, asked
    if mode == "fast" and batch_invariant:
        if memory == "fast" and request.memory is not None:
            raise ValueError(
                "memory: 'fast' is not batch-invariant (XLA's GEMM and reductions "
                "over all N rows at once); batch_invariant=True takes "
                "memory='lean' (or None)"
            )
        mode, why = "lean", f"{why}, but batch_invariant=True, which 'fast' does not serve"
    if mode == "fast" and backend is not None and (request.memory is None or automatic):
        # a scope or the variable is a default: a call's own backend= is more specific
        mode, why = "lean", f"{why}, but backend={backend!r} given, which serves 'lean' only"
    if mode == "fast" and backend is not None:
        raise ValueError(
            f"backend: {backend!r} serves memory='lean' only, and 'fast' was chosen "
            f"({why}); 'fast' keeps the logits, and dispatch alone chooses what "
            "makes them (pass backend=None, or memory='lean')"
        )
    if mode == "fast" and loss:
        text = (
            f"memory fast ({why}): the loss's gradient taken in the forward: {kept}, as "
            f"{np.dtype(kept_dtype).name} "
            f"{list(kept_shape)} ({size}); GEMMs of the head: {gemms[0]} per "
            "forward+backward"
        )
    elif mode == "fast":
        text = (
            f"memory fast ({why}): the head's logits kept as {np.dtype(kept_dtype).name} "
            f"{list(kept_shape)} ({size}) for the backward; GEMMs of the head: "
            f"{gemms[0]} per forward+backward"
        )
        if wanted is not None:
            text += f"; the backend override {wanted!r} applies to memory='lean' only"
    else:
        text = (
            f"lean ({why}): nothing [N, V]-sized kept; the backward recomputes the logits "
            f"({gemms[1]} GEMMs per forward+backward)"
        )
    if mode == "fast" and request.skip_rows is not None:
        text += _row_skip_peak(kept_shape, request.skip_rows)
    return MemoryNote(mode, text)
