"""The chunked backend: jnp walking the vocabulary in chunks, no float32 [N, V] buffer.

``logprobs`` serves the log-prob primitives (of given logits and of a linear head, and the
linear head's backward alone), ``distill`` the divergence between two linear heads and a
head's top-k; both walk the vocabulary with ``vocab_chunks``. The PPO loss (on packed rows
too) and group advantages are the reference's functions (no vocabulary axis).
"""

from __future__ import annotations

from jaxrl_kernels.backends.chunked import distill, logprobs
from jaxrl_kernels.dispatch.contract import STANDALONE_BACKWARDS, VOCAB_PRIMITIVES, Backend, Problem
from jaxrl_kernels.formulas import aggregation_math, ppo_math, segment_math

AUTOMATIC_ABOVE_BYTES = 256 * 2**20
"""Automatic choice takes chunked over reference for a vocabulary primitive whose float32
[N, V] logits exceed this size (below, reference's one buffer is faster and fits)."""


def automatic(primitive: str, problem: Problem) -> str | None:
    """Chunked only saves memory: automatic choice takes it for large vocabulary problems and
    for a standalone backward (it reuses the saved lse, at any size)."""
    if primitive in STANDALONE_BACKWARDS.values():
        return None
    if primitive not in VOCAB_PRIMITIVES:
        return "chunked adds nothing over reference for ops without a vocabulary axis"
    size = problem.logits_bytes_f32
    if size <= AUTOMATIC_ABOVE_BYTES:
        return (
            f"a float32 [N, V] buffer is {size / 2**20:.1f} MiB "
            f"<= {AUTOMATIC_ABOVE_BYTES // 2**20} MiB, so reference is used"
        )
    return None


OPS = {
    **logprobs.OPS,  # token_logprobs, paired_logprobs, linear_logprobs(_backward)
    "ppo_loss": ppo_math.ppo_loss,
    "segment_ppo_loss": segment_math.ppo_loss,
    "group_advantages": aggregation_math.group_advantages,
    **distill.OPS,  # distill_divergence, topk_logprobs
}

INVARIANT_OPS = logprobs.INVARIANT_OPS  # token_logprobs, linear_logprobs(_backward)

BACKEND = Backend("chunked", OPS, automatic=automatic, invariant_ops=INVARIANT_OPS)
