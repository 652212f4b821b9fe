"""The ``ffi`` backend: SM90 (Hopper) kernels of the CUDA extension as XLA FFI custom calls.

``linear`` serves ``linear_logprobs`` (its ``Parts`` have no backward: dispatch resolves
``linear_logprobs_backward`` for it, ``Choice.backward``), that backward alone and
``memory="fast"``'s ``kept_logits``; ``kept_gemms`` the fast mode's backward GEMMs on a
row-skipping branch's rows of the kept gradient, read in place; ``distill`` serves
``distill_divergence``; ``kept_set`` a sampler's kept set per row. ``extension`` loads the
extension and registers its targets; without it, or off a Hopper GPU, the backend is
unavailable.
"""

from __future__ import annotations

from jaxrl_kernels.backends.ffi import distill, kept_gemms, kept_set, linear
from jaxrl_kernels.backends.ffi.extension import unavailable_reason
from jaxrl_kernels.dispatch.contract import Backend, Problem

_SUBMODULES = (linear, kept_gemms, distill, kept_set)

OPS = {primitive: op for mod in _SUBMODULES for primitive, op in mod.OPS.items()}
_DECLINERS = {primitive: mod.declines for mod in _SUBMODULES for primitive in mod.OPS}


def declines(primitive: str, problem: Problem) -> str | None:
    """Why the kernels do not serve these inputs (None if they do)."""
    if primitive not in OPS:
        return (
            f"ffi implements memory='fast''s kept_logits and kept_gemms, linear_logprobs, its "
            f"backward, distill_divergence and kept_set, not {primitive!r}"
        )
    return _DECLINERS[primitive](primitive, problem)


def automatic(primitive: str, problem: Problem) -> str | None:
    if primitive not in OPS:
        return (
            "ffi serves only linear_logprobs (forward and backward), kept_logits, kept_gemms, "
            "distill_divergence and kept_set"
        )
    if primitive == "kept_logits" and problem.n_rows < linear.KEPT_LOGITS_MIN_ROWS:
        return (
            f"{problem.n_rows} rows < {linear.KEPT_LOGITS_MIN_ROWS}: XLA's GEMM is faster "
            "there (ffi.linear.KEPT_LOGITS_MIN_ROWS)"
        )
    return None


INVARIANT_OPS = dict(linear.INVARIANT_OPS)  # linear_logprobs and its backward

BACKEND = Backend("ffi", OPS, unavailable_reason, declines, automatic, invariant_ops=INVARIANT_OPS)
