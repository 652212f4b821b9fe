"""tunix GRPO / PPO steps that never build [B, T, V] logits.

Importing this module registers two policy losses with tunix's function registry:

* ``"jaxrl_grpo"``: tunix's ``"grpo"`` loss (``GRPOConfig``, also GSPO-token, DAPO, Dr. GRPO),
* ``"jaxrl_ppo"``: tunix's ``"ppo"`` policy loss (``PPOConfig``),

with the same loss, ``aux`` metrics and gradients, computed from the model's final hidden
states and LM head by :func:`jaxrl_kernels.linear_logprobs`::

    from jaxrl_kernels.integrations import tunix as jaxrl_tunix  # registers the losses
    config = GRPOConfig(..., policy_loss_fn="jaxrl_grpo")
    config = PPOConfig(..., policy_loss_fn="jaxrl_ppo")

Both have tunix's exact loss signature, so tunix's learners call them as they call their own.
The reference model's and the rollout policy's log-probs of a step (tunix's
``compute_per_token_logps``, which builds the logits) move to the kernels with one explicit,
reversible call per cluster, :func:`use_kernel_logprobs` (see :mod:`.cluster`)::

    kernels = jaxrl_tunix.use_kernel_logprobs(rl_cluster)

Sampler-matched ("processed") log-probs, an option that is off by default: the log-probs of
the distribution the rollout samples from (its top-k / top-p, at its temperature) in both
passes and in the loss, with one call, made before the learner is built, that also points the
config's ``policy_loss_fn`` at the loss's sampler-matched variant (:mod:`.sampler`)::

    kernels = jaxrl_tunix.use_kernel_logprobs(rl_cluster, sampler_matched=True,
                                              algo_config=config)

The backend follows jaxrl_kernels' automatic choice, ``JAXRL_KERNELS_BACKEND`` or a
``jaxrl_kernels.use_backend`` scope around the first (tracing) call; docs/tunix.md has the rest.
"""

from __future__ import annotations

from tunix.rl import function_registry

from jaxrl_kernels.integrations.tunix.cluster import KernelLogprobs, use_kernel_logprobs
from jaxrl_kernels.integrations.tunix.logprobs import (
    check_model,
    compute_per_token_logps,
    find_head,
    policy_logprobs,
)
from jaxrl_kernels.integrations.tunix.losses import (
    GRPO_LOSS_NAME,
    PPO_LOSS_NAME,
    grpo_policy_loss,
    ppo_policy_loss,
    sampler_matched_loss,
)
from jaxrl_kernels.integrations.tunix.sampler import SamplerSettings, sampler_settings

function_registry.register_policy_loss_fn(GRPO_LOSS_NAME)(grpo_policy_loss)
function_registry.register_policy_loss_fn(PPO_LOSS_NAME)(ppo_policy_loss)

__all__ = [
    "GRPO_LOSS_NAME",
    "KernelLogprobs",
    "PPO_LOSS_NAME",
    "SamplerSettings",
    "check_model",
    "compute_per_token_logps",
    "find_head",
    "grpo_policy_loss",
    "policy_logprobs",
    "ppo_policy_loss",
    "sampler_matched_loss",
    "sampler_settings",
    "use_kernel_logprobs",
]
