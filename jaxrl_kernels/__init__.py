"""jaxrl_kernels: fused JAX kernels for RL fine-tuning of language models.

Per-token log-probs, entropies, KL penalties and clipped-surrogate losses that
never materialise the [tokens × vocabulary] logits, behind one dispatch
function (see ``explain``). Options come as validated values (``PolicyLoss``,
``Groups``, ``Sampler``, ``DistillLoss``, ``TopKDistillLoss``). The API and its
numerics: docs/api.md.
"""

from jaxrl_kernels.config import DistillLoss, Groups, PolicyLoss, Sampler, TopKDistillLoss
from jaxrl_kernels.dispatch import available_backends, use_backend
from jaxrl_kernels.dispatch.memory import memory_mode
from jaxrl_kernels.ops.distill import linear_distill_loss, linear_topk_logprobs
from jaxrl_kernels.ops.explain import explain
from jaxrl_kernels.ops.linear_losses import (
    linear_grpo_loss,
    linear_policy_gradient_loss,
    linear_ppo_loss,
)
from jaxrl_kernels.ops.logits_losses import grpo_loss, ratio_kl
from jaxrl_kernels.ops.logprobs import linear_logprobs, token_logprobs
from jaxrl_kernels.ops.losses import (
    aggregate,
    group_advantages,
    kl_penalty,
    policy_gradient_loss,
    ppo_loss,
)
from jaxrl_kernels.ops.topk_distill import linear_topk_distill_loss
from jaxrl_kernels.sharding.vocab_pieces import head_grad_pieces
from jaxrl_kernels.validation import checks

__version__ = "0.2.0"

__all__ = [
    "DistillLoss",
    "Groups",
    "PolicyLoss",
    "Sampler",
    "TopKDistillLoss",
    "aggregate",
    "available_backends",
    "checks",
    "explain",
    "group_advantages",
    "grpo_loss",
    "head_grad_pieces",
    "kl_penalty",
    "linear_distill_loss",
    "linear_grpo_loss",
    "linear_logprobs",
    "linear_policy_gradient_loss",
    "linear_ppo_loss",
    "linear_topk_distill_loss",
    "linear_topk_logprobs",
    "memory_mode",
    "policy_gradient_loss",
    "ppo_loss",
    "ratio_kl",
    "token_logprobs",
    "use_backend",
]
