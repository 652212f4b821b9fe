"""The reference backend: plain jnp, materialises float32 logits. The oracle the others match.

``logprobs`` serves the log-prob primitives, ``distill`` the divergence between two linear
heads and a head's top-k; the PPO loss and group advantages are ``ppo_math``'s and
``aggregation_math``'s functions (on packed rows ``segment_math``'s), a sampler's kept set
``kept_set.find`` (passes over vocabulary chunks: no [N, V] buffer), ``memory="fast"``'s kept logits
``rounded_logits.local_stats`` (XLA's GEMM and reductions) and its backward GEMMs
``kept_grads.leading_rows_grads`` (XLA's). It serves every primitive, always:
the last resort.
"""

from __future__ import annotations

from jaxrl_kernels.backends.reference import distill, logprobs
from jaxrl_kernels.dispatch.contract import Backend
from jaxrl_kernels.formulas import aggregation_math, ppo_math, segment_math
from jaxrl_kernels.head import kept_grads, kept_set, rounded_logits

OPS = {
    **logprobs.OPS,  # token_logprobs, paired_logprobs, linear_logprobs
    "ppo_loss": ppo_math.ppo_loss,
    "segment_ppo_loss": segment_math.ppo_loss,
    "group_advantages": aggregation_math.group_advantages,
    "kept_set": kept_set.find,
    "kept_logits": rounded_logits.local_stats,
    "kept_gemms": kept_grads.leading_rows_grads,
    **distill.OPS,  # distill_divergence, topk_logprobs
}

BACKEND = Backend("reference", OPS, invariant_ops=logprobs.INVARIANT_OPS)
