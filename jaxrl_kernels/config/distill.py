"""The options of the distillation losses, as values checked when they are built."""

from __future__ import annotations

import dataclasses

from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.formulas.divergence_math import DIVERGENCES

TAILS = ("drop", "bucket")
"""How ``linear_topk_distill_loss`` treats the mass outside the teacher's ids."""


@dataclasses.dataclass(frozen=True)
class DistillLoss:
    """The options of ``linear_distill_loss`` (docs/api.md, "linear_distill_loss").

    Attributes:
      divergence: ``"reverse_kl"`` (default), ``"forward_kl"`` or ``"jsd"``.
      jsd_beta: β in (0, 1) of the JSD (``m = β p_t + (1−β) p_s``); read only for ``"jsd"``.
        Default 0.5.
      loss_agg_mode, max_len: as in ``aggregate``. Defaults ``"token_mean"``, ``None``.

    Example:
      >>> import jaxrl_kernels as jk
      >>> jk.DistillLoss(divergence="jsd", jsd_beta=0.1).divergence
      'jsd'
    """

    divergence: str = "reverse_kl"
    jsd_beta: float = 0.5
    loss_agg_mode: str = "token_mean"
    max_len: int | None = None

    def __post_init__(self) -> None:
        check.option("divergence", self.divergence, DIVERGENCES)
        if self.divergence == "jsd":
            value = check._number("jsd_beta", self.jsd_beta)
            if value is None:
                raise TypeError("jsd_beta: expected a Python float in (0, 1), got a traced value")
            if not 0.0 < value < 1.0:
                raise ValueError(f"jsd_beta: expected a value in (0, 1), got {value}")
        check.agg_mode(self.loss_agg_mode)
        check.max_len(self.max_len)

    @property
    def beta(self) -> float:
        """The JSD's β as the kernels take it (0.5 where the divergence is a KL)."""
        return float(self.jsd_beta) if self.divergence == "jsd" else 0.5


@dataclasses.dataclass(frozen=True)
class TopKDistillLoss:
    """The options of ``linear_topk_distill_loss`` (docs/api.md, "linear_topk_distill_loss").

    Attributes:
      tail: ``"drop"`` (default: the KL over the teacher's ids) or ``"bucket"`` (the mass
        outside them as one more outcome).
      loss_agg_mode, max_len: as in ``aggregate``. Defaults ``"token_mean"``, ``None``.

    Example:
      >>> import jaxrl_kernels as jk
      >>> jk.TopKDistillLoss(tail="bucket").tail
      'bucket'
    """

    tail: str = "drop"
    loss_agg_mode: str = "token_mean"
    max_len: int | None = None

    def __post_init__(self) -> None:
        check.option("tail", self.tail, TAILS)
        check.agg_mode(self.loss_agg_mode)
        check.max_len(self.max_len)


DISTILL_LEGACY = legacy.Keywords(
    "config", DistillLoss, {f.name: f.name for f in dataclasses.fields(DistillLoss)}
)
"""The deprecated keywords a ``DistillLoss`` replaces."""

TOPK_LEGACY = legacy.Keywords(
    "config", TopKDistillLoss, {f.name: f.name for f in dataclasses.fields(TopKDistillLoss)}
)
"""The deprecated keywords a ``TopKDistillLoss`` replaces."""
