"""The Pallas backend: Triton-lowered and Mosaic GPU kernels on GPU, interpret mode elsewhere.

Each submodule serves some primitives (``logits``: log-probs from logits; ``ppo``: the PPO
loss, on packed rows too, and group advantages; ``linear``: log-probs of a linear head, and its
backward alone; ``distill``: the divergence between two linear heads, on Mosaic GPU; their
kernels live in ``ppo_kernels``, ``group_kernels``, ``linear_kernels`` with ``linear_grad_kernel``, and
``distill_kernels``) and may name an ``automatic`` rule of its own (when automatic choice passes
its kernels over on a GPU). One that fails to import leaves its primitives declined with the
import error as the reason.
"""

from __future__ import annotations

import importlib

from jaxrl_kernels.dispatch.contract import GPU_PLATFORMS, Backend, Problem

_SUBMODULES = {  # each submodule's OPS serves these primitives
    "logits": ("token_logprobs", "paired_logprobs"),
    "ppo": ("ppo_loss", "segment_ppo_loss", "group_advantages"),
    "linear": ("linear_logprobs", "linear_logprobs_backward"),
    "distill": ("distill_divergence",),
}

OPS: dict = {}
INVARIANT_OPS: dict = {}
_DECLINERS: dict = {}
_AUTOMATIC: dict = {}
_MISSING: dict[str, str] = {}

for _name, _primitives in _SUBMODULES.items():
    try:
        _mod = importlib.import_module(f"{__name__}.{_name}")
    except ImportError as _err:
        for _p in _primitives:
            _MISSING[_p] = f"pallas.{_name} is not available: {_err}"
        continue
    for _p in _primitives:
        OPS[_p] = _mod.OPS[_p]
        if _p in getattr(_mod, "INVARIANT_OPS", {}):
            INVARIANT_OPS[_p] = _mod.INVARIANT_OPS[_p]
        _DECLINERS[_p] = getattr(_mod, "declines", None)
        _AUTOMATIC[_p] = getattr(_mod, "automatic", None)


def unavailable_reason() -> str | None:
    try:
        from jax.experimental import pallas  # noqa: F401
    except ImportError as err:
        return f"jax.experimental.pallas does not import: {err}"
    return None


def declines(primitive: str, problem) -> str | None:
    if primitive in _MISSING:
        return _MISSING[primitive]
    decliner = _DECLINERS.get(primitive)
    return decliner(primitive, problem) if decliner else None


def automatic(primitive: str, problem: Problem) -> str | None:
    """Off a GPU the kernels run only emulated: automatic choice passes pallas over there; on
    a GPU, a submodule's own rule decides."""
    if not problem.on_gpu:
        return f"platform is {problem.platform!r}; pallas runs only in interpret mode there"
    rule = _AUTOMATIC.get(primitive)
    return rule(primitive, problem) if rule else None


BACKEND = Backend(
    "pallas",
    OPS,
    unavailable_reason,
    declines,
    automatic,
    native_platforms=GPU_PLATFORMS,
    invariant_ops=INVARIANT_OPS,
)
