"""What an op decides while it is traced (backends, ``memory=``, layouts), kept for ``explain``.

``dispatch.explain`` traces an op abstractly inside :func:`collecting`; the places that decide
something call :func:`note`, a no-op outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_log: contextvars.ContextVar[list[tuple[str, Any]] | None] = contextvars.ContextVar(
    "jaxrl_kernels_trace_log", default=None
)


def note(step: str, what: Any) -> Any:
    """Keep ``(step, what)`` for the :func:`collecting` scope in progress; returns ``what``."""
    log = _log.get()
    if log is not None:
        log.append((step, what))
    return what


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[str, Any]]]:
    """A scope whose notes land in the list it yields."""
    log: list[tuple[str, Any]] = []
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)
