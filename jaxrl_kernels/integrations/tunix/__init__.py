"""tunix policy losses that never build [B, T, V] logits.

Importing this module registers two policy losses with tunix's function registry:

* ``"jaxrl_grpo"``: tunix's ``"grpo"`` loss (``GRPOConfig``, also GSPO-token, DAPO, Dr. GRPO),
* ``"jaxrl_ppo"``: tunix's ``"ppo"`` policy loss (``PPOConfig``),

with the same loss, ``aux`` metrics and gradients, computed from the model's final hidden
states and LM head by :func:`jaxrl_kernels.linear_logprobs`::

    import jaxrl_kernels.integrations.tunix  # registers the losses
    config = GRPOConfig(..., policy_loss_fn="jaxrl_grpo")
    config = PPOConfig(..., policy_loss_fn="jaxrl_ppo")

The backend of the log-probs follows jaxrl_kernels' automatic choice, ``JAXRL_KERNELS_BACKEND``
or a ``jaxrl_kernels.use_backend`` scope around the first (tracing) train step.
"""

from __future__ import annotations

from tunix.rl import function_registry

from jaxrl_kernels.integrations.tunix.logprobs import check_model, find_head, policy_logprobs
from jaxrl_kernels.integrations.tunix.losses import grpo_policy_loss, ppo_policy_loss

GRPO_LOSS_NAME = "jaxrl_grpo"
PPO_LOSS_NAME = "jaxrl_ppo"

function_registry.register_policy_loss_fn(GRPO_LOSS_NAME)(grpo_policy_loss)
function_registry.register_policy_loss_fn(PPO_LOSS_NAME)(ppo_policy_loss)

__all__ = [
    "GRPO_LOSS_NAME",
    "PPO_LOSS_NAME",
    "check_model",
    "find_head",
    "grpo_policy_loss",
    "policy_logprobs",
    "ppo_policy_loss",
]
