"""The options of the policy losses, as values checked when they are built.

:class:`PolicyLoss` holds the options of ``ppo_loss``, ``grpo_loss``, their linear-head forms
and the policy-gradient losses; :class:`Groups` how GRPO's sequences form groups (and
``group_advantages``'). Both are frozen dataclasses: built once, checked once, passed as
``config=`` / ``groups=``. :func:`policy_options` gives one call's ``PolicyLoss`` (its
``config=``, or one built from the keywords it replaced, deprecated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl_kernels import validation as check
from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.formulas import kl_math, ppo_math, surrogate_math


@dataclasses.dataclass(frozen=True)
class PolicyLoss(ppo_math.PPOConfig):
    """The options of a policy loss, checked when it is built.

    Pass it as ``config=`` to ``ppo_loss``, ``grpo_loss``, ``linear_ppo_loss``,
    ``linear_grpo_loss``, ``policy_gradient_loss`` or ``linear_policy_gradient_loss``
    instead of the keywords of the same names (docs/api.md, "PolicyLoss"). Frozen and
    hashable: a static argument of ``jax.jit``; ``dataclasses.replace`` gives a changed copy,
    checked again.

    Attributes:
      clip_low: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``;
        ``0 <= clip_low < 1``. Default 0.2.
      clip_high: ``> 0``. Default 0.2.
      dual_clip: ``c > 1`` or ``None``: where ``A < 0`` the loss is capped at ``-A·c``; not
        with ``policy_loss="cispo"``. Default ``None``.
      tis_cap: the cap (``> 0``) of the training–inference importance weight, or ``None``;
        the op then needs ``rollout_logp`` (and ``rollout_logp`` needs it). Default ``None``.
      kl_coef: the weight of the per-token KL penalty to the reference policy (``beta`` of
        the GRPO losses); when ``!= 0`` the op needs the reference's log-probs. Default 0.0.
      kl_estimator: ``"k1"``, ``"abs"``, ``"k2"`` or ``"k3"``, as in ``kl_penalty``.
        Default ``"k3"``.
      entropy_coef: the weight of the entropy bonus ``-entropy_coef·entropy`` per token; the
        PPO losses only (``ppo_loss`` then needs ``entropy``). Default 0.0.
      loss_agg_mode: ``"token_mean"``, ``"seq_mean_token_mean"`` (alias
        ``"sequence_mean"``), ``"seq_mean_token_sum"`` or ``"seq_mean_token_sum_norm"``, as
        in ``aggregate``. Default ``"token_mean"``.
      max_len: for ``"seq_mean_token_sum_norm"``, a positive int; ``None`` means ``T``.
        Default ``None``.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO's sequence ratio). Default
        ``"token"``.
      policy_loss: ``"ppo"`` (the clipped surrogate) or ``"cispo"``. Default ``"ppo"``.
      tis_level: ``"token"`` or ``"sequence"``: the importance weight per token or per
        sequence. Default ``"token"``.
      tis_mode: ``"truncate"`` (``min(w, tis_cap)``) or ``"mask"`` (0 where
        ``w > tis_cap``). Default ``"truncate"``.

    Raises:
      ValueError: a value outside its range or an unknown option, with the message the op's
        keyword gives (e.g. ``clip_low: expected a value in [0.0, 1.0), got 1.5``).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> config = jk.PolicyLoss(clip_high=0.28, loss_agg_mode="seq_mean_token_sum_norm")
      >>> logp = jnp.log(jnp.full((2, 3), 0.5))
      >>> loss, _ = jk.ppo_loss(logp, logp, jnp.array([1.0, -1.0]), jnp.ones((2, 3)),
      ...                       config=config)
      >>> float(loss)
      0.0
    """

    def __post_init__(self) -> None:
        check.clip_options(self.clip_low, self.clip_high, self.dual_clip)
        check.positive("tis_cap", self.tis_cap)
        check.option("kl_estimator", self.kl_estimator, kl_math.KL_ESTIMATORS)
        check.agg_mode(self.loss_agg_mode)
        check.max_len(self.max_len)
        check.option("ratio_level", self.ratio_level, ppo_math.RATIO_LEVELS)
        check.option("policy_loss", self.policy_loss, surrogate_math.POLICY_LOSSES)
        check.option("tis_level", self.tis_level, ppo_math.TIS_LEVELS)
        check.option("tis_mode", self.tis_mode, surrogate_math.TIS_MODES)
        if self.policy_loss == "cispo" and self.dual_clip is not None:
            raise ValueError(
                f"dual_clip: expected None with policy_loss='cispo' (CISPO has no "
                f"dual clip), got {self.dual_clip!r}"
            )


FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLoss))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolicyLoss)}
PG_UNUSED = tuple(name for name in FIELDS if name not in ("loss_agg_mode", "max_len"))
"""The attributes the policy-gradient losses have no term for."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Groups:
    """How GRPO's sequences form groups, and how their rewards become advantages.

    Pass it as ``groups=`` to ``grpo_loss``, ``linear_grpo_loss`` and ``group_advantages``
    (docs/api.md, "group_advantages"). Groups are runs of consecutive sequences. A pytree
    whose one leaf is ``boundaries`` (so a traced array may be passed through ``jax.jit``);
    the rest is static.

    Attributes:
      size: every group has ``size`` sequences (a positive int dividing ``B``); or ``None``
        with ``boundaries``.
      boundaries: ``[G + 1]`` integers ``[0, b1, ..., B]``, strictly increasing; or ``None``
        with ``size``. Checked against ``B`` by the op (invalid traced boundaries give NaN
        advantages, or raise in check mode).
      normalize_std: divide by ``std_g + eps``; ``False`` gives ``r - mean_g``. Default True.
      std_ddof: the standard deviation's delta degrees of freedom. Default 0.
      eps: added to the standard deviation. Default 1e-6.

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> jk.group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]),
      ...                     groups=jk.Groups(size=2, normalize_std=False))
      Array([ 0.5, -0.5,  0. ,  0. ], dtype=float32)
    """

    size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    boundaries: Any = None
    normalize_std: bool = dataclasses.field(default=True, metadata=dict(static=True))
    std_ddof: int = dataclasses.field(default=0, metadata=dict(static=True))
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))

    def __post_init__(self) -> None:
        # ``boundaries`` is a pytree leaf (any placeholder during a tree map): the op checks it.
        size = self.size
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0
        ):
            raise ValueError(f"size: expected a positive int or None, got {size!r}")
        check.non_negative_int("std_ddof", self.std_ddof)
        if not isinstance(self.normalize_std, (bool, np.bool_)):
            raise TypeError(
                f"normalize_std: expected a bool, got {type(self.normalize_std).__name__}"
            )


GRPO_GROUPS = legacy.Keywords(
    "groups",
    Groups,
    {
        "group_size": "size",
        "group_boundaries": "boundaries",
        "normalize_std": "normalize_std",
        "eps": "eps",
    },
)
"""The GRPO losses' deprecated keywords for their ``Groups``."""

ADVANTAGE_GROUPS = legacy.Keywords("groups", Groups, {**GRPO_GROUPS.fields, "std_ddof": "std_ddof"})
"""``group_advantages``' deprecated keywords for its ``Groups`` (``std_ddof`` too)."""


GRPO_KEYWORDS = {
    **{name: name for name in FIELDS if name not in ("kl_coef", "entropy_coef", "max_len")},
    "beta": "kl_coef",
}
"""The GRPO losses' deprecated keywords for their ``PolicyLoss`` (``beta`` sets ``kl_coef``)."""


def policy_options(
    op: str,
    config: PolicyLoss | None,
    deprecated: Mapping[str, Any],
    *,
    keywords: Mapping[str, str] | None = None,
    unused: tuple[str, ...] = (),
    extra: tuple[legacy.Keywords, ...] = (),
    given: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One call's config values: ``config`` (a ``PolicyLoss``, default ``PolicyLoss()``) and
    those of ``extra`` (``given`` holds their new parameters' values), each as passed or built
    from the deprecated keywords of ``op`` (``keywords``: each old keyword -> the attribute it
    sets; default: every attribute but ``unused``). The attributes in ``unused`` (those ``op``
    has no term for) must be at their defaults."""
    fields = keywords or {name: name for name in FIELDS if name not in unused}
    values = legacy.take(
        op,
        deprecated,
        {"config": config, **(given or {})},
        (legacy.Keywords("config", PolicyLoss, fields), *extra),
    )
    loss = values["config"] or PolicyLoss()
    for attr in unused:
        value = getattr(loss, attr)
        if not (value is None if DEFAULTS[attr] is None else value == DEFAULTS[attr]):
            raise ValueError(
                f"config: {op} has no term for {attr}; expected its default "
                f"{DEFAULTS[attr]!r}, got {value!r}"
            )
    values["config"] = loss
    return values
