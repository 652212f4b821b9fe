"""Choosing an implementation: the backend contract, the resolver, the memory mode, the trace log.

``contract`` is what ops and backends agree on (the primitives, ``Problem``, ``Backend``,
``Choice``, ``Parts`` / ``Whole``); ``resolver`` holds ``resolve``, the one function that chooses a backend and a
memory mode (re-exported here: ``jaxrl_kernels.dispatch.BACKENDS``, ``resolve``, ``select``,
``use_backend``, ``available_backends``); ``memory`` the lean / fast rule; ``trace_log`` what was
chosen, for ``jk.explain``. The backends are imported by ``resolve`` on first use, so they sit
below this package's front module and above ``contract``.
"""

from jaxrl_kernels.dispatch.resolver import (
    BACKENDS,
    ENV_VAR,
    FAST,
    available_backends,
    record,
    requested_backend,
    resolve,
    scoped_backend,
    select,
    use_backend,
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "FAST",
    "available_backends",
    "record",
    "requested_backend",
    "resolve",
    "scoped_backend",
    "select",
    "use_backend",
]
