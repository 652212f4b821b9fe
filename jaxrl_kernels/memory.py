"""``memory=`` of the linear-head ops: keep the head's logits for the backward, or not.

``"lean"`` (the default) keeps nothing ``[N, V]``-sized and recomputes the logits in the
backward (4 GEMMs per forward+backward); ``"fast"`` keeps the forward's logits for the backward
(3 GEMMs, :mod:`jaxrl_kernels.saved_logits`); an int is a byte budget: ``"fast"`` when the kept
logits fit in it, else ``"lean"``. An op states its request (:class:`Request`: the argument and
what ``"fast"`` would keep); ``dispatch.resolve`` decides with :func:`choose` and records why,
for ``explain``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

MODES = ("lean", "fast")
"""The named modes of ``memory=`` (an int byte budget is the third form)."""


@dataclasses.dataclass(frozen=True)
class MemoryNote:
    """What :func:`choose` decided, for ``explain``."""

    mode: str
    text: str

    def explain_line(self, step: str) -> str:
        """Its line in ``explain``: fast, the op's own line; lean, under its backend's."""
        return f"{step}: {self.text}" if self.mode == "fast" else f"  memory: {self.text}"


def _size(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} bytes"


@dataclasses.dataclass(frozen=True)
class Request:
    """A linear-head op's ``memory=`` argument and what ``"fast"`` would keep from its forward
    to its backward (``kept_bytes`` of ``kept_dtype`` in ``kept_shape``). ``loss``: the op's
    fast mode takes its gradient in the forward (:mod:`jaxrl_kernels.fused_loss`,
    ``fused_distill``); ``gemms``: the GEMMs per forward+backward of ``"fast"`` and
    ``"lean"``; ``kept``: what a loss's fast mode keeps."""

    memory: Any
    kept_bytes: int
    kept_shape: tuple[int, ...]
    kept_dtype: Any
    loss: bool = False
    gemms: tuple[int, int] = (3, 4)
    kept: str = "the head's logits, then their gradient in their place"


def choose(request: Request, backend: str | None,
           wanted: str | None = None) -> MemoryNote:
    """``"lean"`` or ``"fast"`` (``.mode``) for ``request``, with the reason (``.text``).
    ``backend``: the op's ``backend=`` argument (with ``"fast"``, an error: the fast mode has
    no backend); ``wanted``: a backend requested by ``use_backend`` or the environment, which
    ``"fast"`` notes it does not use."""
    memory, kept_bytes, kept_shape, kept_dtype = (request.memory, request.kept_bytes,
                                                  request.kept_shape, request.kept_dtype)
    loss, gemms, kept = request.loss, request.gemms, request.kept
    is_budget = isinstance(memory, (int, np.integer)) and not isinstance(memory, bool)
    if not (is_budget or (isinstance(memory, str) and memory in MODES)):
        raise ValueError(f"memory: expected 'lean', 'fast' or a byte budget (an int >= 0), "
                         f"got {memory!r}")
    size = _size(kept_bytes)
    if is_budget:
        if memory < 0:
            raise ValueError(f"memory: a byte budget must be >= 0, got {memory}")
        mode = "fast" if kept_bytes <= memory else "lean"
        why = (f"memory={int(memory)}: a budget of {_size(int(memory))} "
               f"{'>=' if mode == 'fast' else '<'} the {size} of logits 'fast' keeps")
    else:
        mode, why = memory, f"memory={memory!r}"
    if mode == "fast" and backend is not None:
        raise ValueError(f"backend: {backend!r} serves memory='lean' only; memory='fast' computes "
                         "the logits with XLA's GEMM and keeps them (pass backend=None)")
    if mode == "fast" and loss:
        text = (f"memory fast ({why}): the loss's gradient taken in the forward: {kept}, as "
                f"{np.dtype(kept_dtype).name} "
                f"{list(kept_shape)} ({size}); XLA's GEMMs, {gemms[0]} per forward+backward")
    elif mode == "fast":
        text = (f"memory fast ({why}): the head's logits kept as {np.dtype(kept_dtype).name} "
                f"{list(kept_shape)} ({size}) for the backward; XLA's GEMMs, {gemms[0]} per "
                "forward+backward")
        if wanted is not None:
            text += f"; the backend override {wanted!r} applies to memory='lean' only"
    else:
        text = (f"lean ({why}): nothing [N, V]-sized kept; the backward recomputes the logits "
                f"({gemms[1]} GEMMs per forward+backward)")
    return MemoryNote(mode, text)
