"""The public option values, each checked when it is built and passed to an op as one argument.

``PolicyLoss`` (``config=`` of the policy losses), ``Groups`` (``groups=``: GRPO's groups),
``Sampler`` (``sampler=``: a rollout sampler's truncation), ``DistillLoss`` and
``TopKDistillLoss`` (``config=`` of the distillation losses). ``deprecated`` takes the keywords
they replaced, for one minor version.
"""

from jaxrl_kernels.config.distill import DistillLoss, TopKDistillLoss
from jaxrl_kernels.config.policy import Groups, PolicyLoss
from jaxrl_kernels.config.sampler import Sampler

__all__ = ["DistillLoss", "Groups", "PolicyLoss", "Sampler", "TopKDistillLoss"]
