"""``explain``: which implementation each piece of work of an op gets, and why.

The op is traced abstractly (``jax.eval_shape``); what ``dispatch`` chose (backends, the
``memory=`` mode) and how each step is laid out on the devices are noted meanwhile
(:mod:`trace_log`) and reported line by line.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_kernels import dispatch
from jaxrl_kernels.dispatch import trace_log
from jaxrl_kernels.dispatch.contract import OP_PRIMITIVE, Choice
from jaxrl_kernels.ops import distill, linear_losses, logits_losses, logprobs, losses, topk_distill


def _public_ops() -> dict[str, Any]:
    """Public op name -> the function."""
    modules = (logprobs, losses, logits_losses, linear_losses, distill, topk_distill)
    return {name: getattr(m, name) for m in modules for name in OP_PRIMITIVE if hasattr(m, name)}


def explain(op: str, *args: Any, **kwargs: Any) -> str:
    """Which backend each piece of work of ``op(*args, **kwargs)`` gets, and why.

    Traces the call abstractly (``jax.eval_shape``: nothing is computed) and reports, for each
    backend choice the op makes, the backend chosen and whether it was requested or
    automatic, why each better backend declined, an override in force, and how the step is
    laid out on the devices (``layout:``). For the ops from hidden states, the ``memory=`` mode
    and where it came from: ``memory='fast'`` (the argument, or the default ``'auto'``),
    ``jk.memory_mode('fast')`` (a scope) or ``JAXRL_KERNELS_MEMORY=fast``, with a byte
    budget's comparison; the backward's vocabulary pieces where several are asked for
    (``pieces:``, ``jk.head_grad_pieces``).

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
    if op not in OP_PRIMITIVE:
        raise ValueError(f"op: unknown op {op!r}; valid: {', '.join(sorted(OP_PRIMITIVE))}")
    if kwargs.get("backend") is not None:
        raise ValueError("explain: pass no backend= (explain describes the automatic choice)")
    fn = _public_ops()[op]
    with trace_log.collecting() as log:
        jax.eval_shape(lambda *a: fn(*a, **kwargs), *args)
    header = []
    wanted = dispatch.requested_backend(None)
    if wanted is not None:
        source = "use_backend" if dispatch.scoped_backend() is not None else dispatch.ENV_VAR
        header.append(f"{op}: backend override {wanted!r} is in force ({source})")
    blocks: list[tuple[str, list[str]]] = []  # (step, its lines), in the order noted
    for step, choice in log:
        # how the op is laid out on the devices (engine.note_layout), its backward's pieces
        if step in ("layout", "pieces"):
            mine = [b for b in blocks if b[0] == op] or blocks[-1:]
            if mine:
                mine[-1][1].append(f"  {step}: {choice}")
            else:
                blocks.append((op, [f"  {step}: {choice}"]))
            continue
        if not isinstance(choice, Choice):
            blocks.append((step, [choice.explain_line(step)]))
            continue
        how = "requested" if choice.explicit else "automatic"
        how += ", batch-invariant" if choice.batch_invariant else ""
        lines = [f"{step}: {choice.backend} ({how})"]
        lines += [f"  - {name} declined: {why}" for name, why in choice.declined]
        blocks.append((step, lines))
    return "\n".join(header + [line for _, lines in blocks for line in lines])
