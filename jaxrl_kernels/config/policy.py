"""The configuration of the policy losses, and the pieces they share.

:class:`PolicyLoss` holds the options of ``ppo_loss``, ``grpo_loss``, their linear-head forms
and the policy-gradient losses, and checks them when it is built (with
:mod:`jaxrl_kernels.validation`). :func:`from_arguments` gives the ``PolicyLoss`` of one call
(its ``config=`` or one built from its keywords); :func:`kernel_config` checks it against the
call's optional inputs and gives the kernels' :class:`ppo_math.PPOConfig`. The rest is what
the ops of :mod:`losses`, :mod:`logits_losses` and :mod:`linear_losses` compute alike: the
PPO term through ``dispatch`` (:func:`run_ppo`), group advantages, GRPO from log-probs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import dispatch, sharding
from jaxrl_kernels.formulas import kl_math
from jaxrl_kernels.formulas import ppo_math
from jaxrl_kernels.formulas import surrogate_math
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels import validation as check

_sg = jax.lax.stop_gradient


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
            raise ValueError(f"dual_clip: expected None with policy_loss='cispo' (CISPO has no "
                             f"dual clip), got {self.dual_clip!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(PolicyLoss))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolicyLoss)}
PG_UNUSED = tuple(name for name in FIELDS if name not in ("loss_agg_mode", "max_len"))
"""The attributes the policy-gradient losses have no term for."""


def _at_default(value: Any, default: Any) -> bool:
    """``value`` is the Python value ``default`` (an array or a tracer never is)."""
    if value is None or default is None:
        return value is default
    return isinstance(value, (int, float, str)) and value == default


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float, str, type(None))) else type(value).__name__


def from_arguments(op: str, config: PolicyLoss | None, arguments: dict[str, Any], *,
                   renamed: dict[str, str] | None = None, unused: tuple[str, ...] = ()
                   ) -> PolicyLoss:
    """The ``PolicyLoss`` of one call of ``op``: ``config``, or one built from its keywords.

    ``arguments`` holds the op's arguments (its ``locals()`` on entry); those named like an
    attribute, or like a key of ``renamed`` (an op's keyword -> the attribute it sets, e.g.
    ``{"beta": "kl_coef"}``), are the op's keywords for the config. With ``config``, each of
    them must be at its default (else ``ValueError``: the value is set twice), and so must
    the attributes in ``unused``, those ``op`` has no term for.
    """
    renamed = renamed or {}
    keywords = {name: renamed.get(name, name) for name in (*FIELDS, *renamed)
                if name in arguments}
    if config is None:
        return PolicyLoss(**{attr: arguments[name] for name, attr in keywords.items()})
    if not isinstance(config, PolicyLoss):
        raise TypeError(f"config: expected a jaxrl_kernels.PolicyLoss or None, got "
                        f"{type(config).__name__}")
    for name, attr in keywords.items():
        if not _at_default(arguments[name], DEFAULTS[attr]):
            raise ValueError(
                f"{name}: expected its default {DEFAULTS[attr]!r} with config= (set it in the "
                f"PolicyLoss: dataclasses.replace(config, {attr}=...)), got "
                f"{_shown(arguments[name])}")
    for attr in unused:
        if not _at_default(getattr(config, attr), DEFAULTS[attr]):
            raise ValueError(f"config: {op} has no term for {attr}; expected its default "
                             f"{DEFAULTS[attr]!r}, got {_shown(getattr(config, attr))}")
    return config


def _tis_options(rollout_logp_given: bool, tis_cap: Any) -> None:
    if rollout_logp_given != (tis_cap is not None):
        raise ValueError("rollout_logp / tis_cap: truncated importance sampling needs both "
                         f"(got rollout_logp={'set' if rollout_logp_given else None}, "
                         f"tis_cap={tis_cap!r})")


def kernel_config(loss: PolicyLoss, *, has_rollout: bool, has_ref: bool = True,
                  has_entropy: bool = False, kl_name: str = "kl_coef") -> ppo_math.PPOConfig:
    """The kernels' ``PPOConfig`` of ``loss`` (its aggregation mode canonical), after checking
    that the call's optional inputs come with the options that need them: ``rollout_logp``
    with ``tis_cap``, the reference's log-probs with ``kl_coef != 0`` (the op's keyword
    ``kl_name``), ``entropy`` with ``entropy_coef != 0``."""
    _tis_options(has_rollout, loss.tis_cap)
    if not has_ref and loss.kl_coef != 0:
        raise ValueError(f"ref_logp: required when {kl_name} != 0 ({kl_name}={loss.kl_coef!r})")
    if not has_entropy and loss.entropy_coef != 0:
        raise ValueError(f"entropy: required when entropy_coef != 0 "
                         f"(entropy_coef={loss.entropy_coef!r})")
    options = {name: getattr(loss, name) for name in FIELDS}
    options["loss_agg_mode"] = check.agg_mode(loss.loss_agg_mode)
    return ppo_math.PPOConfig(**options)


def run_ppo(op: str, inputs: ppo_math.PPOInputs, cfg: ppo_math.PPOConfig, *,
            backend: str | None, strict: bool):
    """(loss, metrics) of the PPO term, on the backend ``dispatch`` chooses for ``op``."""
    choice = dispatch.resolve(op, Problem(n_rows=inputs.logp.size), backend,
                              primitive="ppo_loss", strict=strict)
    return choice.impl(inputs, cfg)


# -- group advantages ------------------------------------------------------------------------

def group_segments(batch: int, group_size: Any, group_boundaries: Any):
    """(segment_ids [B], number of groups, validity flag for traced boundaries)."""
    if (group_size is None) == (group_boundaries is None):
        raise ValueError("group_size / group_boundaries: give exactly one of them")
    if group_size is not None:
        if not isinstance(group_size, (int, np.integer)) or group_size <= 0 or batch % group_size:
            raise ValueError(f"group_size: expected a positive int dividing B = {batch}, "
                             f"got {group_size!r}")
        return jnp.arange(batch) // group_size, batch // int(group_size), None
    bounds = check.integer("group_boundaries", group_boundaries)
    check.rank("group_boundaries", bounds, 1, "[G + 1]")
    if bounds.shape[0] < 2:
        raise ValueError(f"group_boundaries: expected at least 2 entries [0, ..., B], "
                         f"got shape {tuple(bounds.shape)}")
    ok = (bounds[0] == 0) & (bounds[-1] == batch) & jnp.all(jnp.diff(bounds) > 0)
    if check.is_concrete(bounds):
        if not bool(ok):
            raise ValueError(f"group_boundaries: expected strictly increasing values starting at "
                             f"0 and ending at B = {batch}, got {np.asarray(bounds).tolist()}")
        ok = None
    else:
        check.boundaries("group_boundaries", bounds, batch)  # check mode only
    ids = jnp.searchsorted(bounds[1:], jnp.arange(batch), side="right")
    return ids, bounds.shape[0] - 1, ok


def compute_group_advantages(rewards: Any, *, group_size: Any, group_boundaries: Any,
                             normalize_std: bool, std_ddof: int, eps: float,
                             backend: str | None, strict: bool) -> jax.Array:
    """``group_advantages`` (docs/api.md); ``strict=False`` lets a requested backend that
    cannot serve it fall back to the automatic choice (a piece of a composite op)."""
    rewards = check.as_array("rewards", rewards)
    if not (jnp.issubdtype(rewards.dtype, jnp.floating)
            or jnp.issubdtype(rewards.dtype, jnp.integer)):
        raise TypeError(f"rewards: expected a real dtype, got {rewards.dtype}")
    check.rank("rewards", rewards, 1, "[B]")
    check.non_negative_int("std_ddof", std_ddof)
    ids, groups, ok = group_segments(rewards.shape[0], group_size, group_boundaries)
    (rewards,) = sharding.pin_grad_shardings(rewards)
    choice = dispatch.resolve("group_advantages", Problem(n_rows=rewards.shape[0]),
                              backend, strict=strict)
    # Groups may straddle any split of B: every device computes all of them from the [B] rewards.
    rewards = sharding.replicated(rewards.astype(jnp.float32))
    adv = choice.impl(rewards, ids.astype(jnp.int32), groups, normalize_std=bool(normalize_std),
                      std_ddof=int(std_ddof), eps=eps)
    return adv if ok is None else jnp.where(ok, adv, jnp.nan)


# -- GRPO --------------------------------------------------------------------------------------

def grpo_advantages(rewards: Any, *, advantages: Any, batch: int, group_size: Any,
                    group_boundaries: Any, normalize_std: bool, eps: float,
                    backend: str | None) -> jax.Array:
    """GRPO's ``[B]`` advantages, without gradient: ``advantages`` when given, else the group
    advantages of ``rewards``."""
    rewards = check.as_array("rewards", rewards)
    check.shape("rewards", rewards, (batch,), "[B]")
    if advantages is not None:
        advantages = check.floating("advantages", advantages)
        check.shape("advantages", advantages, (batch,), "[B]")
        return _sg(advantages.astype(jnp.float32))
    return _sg(compute_group_advantages(
        rewards, group_size=group_size, group_boundaries=group_boundaries,
        normalize_std=normalize_std, std_ddof=0, eps=eps, backend=backend, strict=False))


def grpo_from_logprobs(logp: jax.Array, cfg: ppo_math.PPOConfig, *, ref_logp, old_logp,
                       advantages, mask, rollout_logp):
    """(loss, policy_loss, kl) = aggregate(pg + β·kl), aggregate(pg), aggregate(kl), with pg
    the per-token policy term of ppo_loss (``ppo_math.policy_surrogate``) and β = cfg.kl_coef."""
    inputs = ppo_math.PPOInputs(
        logp=logp, old_logp=old_logp,
        advantages=jnp.broadcast_to(advantages[:, None], logp.shape), mask=mask,
        rollout_logp=rollout_logp, ref_logp=ref_logp)
    return ppo_math.grpo_loss(inputs, cfg)
