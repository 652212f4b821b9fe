"""The ``ffi`` backend: SM90 (Hopper) kernels of the CUDA extension as XLA FFI custom calls.

``linear`` serves ``linear_logprobs`` (its ``Parts`` have no backward: dispatch resolves
``linear_logprobs_backward`` for it, ``Choice.backward``) and that backward alone; ``distill``
serves ``distill_divergence``. ``extension`` loads the extension and registers its targets;
without it, or off a Hopper GPU, the backend is unavailable.
"""

from __future__ import annotations

from jaxrl_kernels.backend_contract import Backend, Problem
from jaxrl_kernels.backends.ffi import distill, linear
from jaxrl_kernels.backends.ffi.extension import unavailable_reason

_SUBMODULES = (linear, distill)

OPS = {primitive: op for mod in _SUBMODULES for primitive, op in mod.OPS.items()}
_DECLINERS = {primitive: mod.declines for mod in _SUBMODULES for primitive in mod.OPS}


def declines(primitive: str, problem: Problem) -> str | None:
    """Why the kernels do not serve these inputs (None if they do)."""
    if primitive not in OPS:
        return (f"ffi implements linear_logprobs, its backward and distill_divergence, not "
                f"{primitive!r}")
    return _DECLINERS[primitive](primitive, problem)


def automatic(primitive: str, problem: Problem) -> str | None:
    if primitive not in OPS:
        return "ffi serves only linear_logprobs (forward and backward) and distill_divergence"
    return None


INVARIANT_OPS = dict(linear.INVARIANT_OPS)  # linear_logprobs and its backward

BACKEND = Backend("ffi", OPS, unavailable_reason, declines, automatic,
                  invariant_ops=INVARIANT_OPS)
