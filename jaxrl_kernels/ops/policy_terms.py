"""What the policy-loss ops compute alike: the kernels' config of a call, the PPO term through
``dispatch``, group advantages, GRPO from log-probs, and the linear losses' checked inputs and
their one call of the linear-head entry.

The options arrive as config values (:class:`jaxrl_kernels.config.PolicyLoss`,
:class:`jaxrl_kernels.config.Groups`); this module checks them against the call's arrays
(``rollout_logp`` with ``tis_cap``, the reference with ``kl_coef``) and runs the shared parts
of :mod:`losses`, :mod:`logits_losses` and :mod:`linear_losses`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import dispatch, sharding
from jaxrl_kernels import validation as check
from jaxrl_kernels.config.policy import FIELDS, Groups, PolicyLoss
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels.engine import head_entry
from jaxrl_kernels.formulas import ppo_math, segment_math
from jaxrl_kernels.ops import segments
from jaxrl_kernels.sharding.entry import global_vocab

_sg = jax.lax.stop_gradient


def _tis_options(rollout_logp_given: bool, tis_cap: Any) -> None:
    if rollout_logp_given != (tis_cap is not None):
        raise ValueError(
            "rollout_logp / tis_cap: truncated importance sampling needs both "
            f"(got rollout_logp={'set' if rollout_logp_given else None}, "
            f"tis_cap={tis_cap!r})"
        )


def kernel_config(
    loss: PolicyLoss,
    *,
    has_rollout: bool,
    has_ref: bool = True,
    has_entropy: bool = False,
    kl_name: str = "kl_coef",
) -> ppo_math.PPOConfig:
    """The kernels' ``PPOConfig`` of ``loss`` (its aggregation mode canonical), after checking
    that the call's optional inputs come with the options that need them: ``rollout_logp``
    with ``tis_cap``, the reference's log-probs with ``kl_coef != 0`` (the op's keyword
    ``kl_name``), ``entropy`` with ``entropy_coef != 0``."""
    _tis_options(has_rollout, loss.tis_cap)
    if not has_ref and loss.kl_coef != 0:
        raise ValueError(f"ref_logp: required when {kl_name} != 0 ({kl_name}={loss.kl_coef!r})")
    if not has_entropy and loss.entropy_coef != 0:
        raise ValueError(
            f"entropy: required when entropy_coef != 0 (entropy_coef={loss.entropy_coef!r})"
        )
    options = {name: getattr(loss, name) for name in FIELDS}
    options["loss_agg_mode"] = check.agg_mode(loss.loss_agg_mode)
    return ppo_math.PPOConfig(**options)


def run_ppo(
    op: str,
    inputs: ppo_math.PPOInputs,
    cfg: ppo_math.PPOConfig,
    *,
    backend: str | None,
    strict: bool,
    packing: segments.Packing | None = None,
):
    """(loss, metrics) of the PPO term, on the backend ``dispatch`` chooses for ``op``; with
    ``packing``, the ``segment_ppo_loss`` primitive (sequences = segments)."""
    primitive = "ppo_loss" if packing is None else "segment_ppo_loss"
    choice = dispatch.resolve(
        op, Problem(n_rows=inputs.logp.size), backend, primitive=primitive, strict=strict
    )
    if packing is None:
        return choice.impl(inputs, cfg)
    return choice.impl(inputs, cfg, packing)


# -- group advantages ------------------------------------------------------------------------


def group_segments(batch: int, groups: Groups):
    """(segment_ids [B], number of groups, validity flag for traced boundaries)."""
    size, boundaries = groups.size, groups.boundaries
    if (size is None) == (boundaries is None):
        raise ValueError("groups: give exactly one of size and boundaries, e.g. jk.Groups(size=G)")
    if size is not None:
        if batch % size:
            raise ValueError(
                f"groups.size: expected a positive int dividing B = {batch}, got {size!r}"
            )
        return jnp.arange(batch) // size, batch // int(size), None
    bounds = check.integer("groups.boundaries", boundaries)
    check.rank("groups.boundaries", bounds, 1, "[G + 1]")
    if bounds.shape[0] < 2:
        raise ValueError(
            f"groups.boundaries: expected at least 2 entries [0, ..., B], "
            f"got shape {tuple(bounds.shape)}"
        )
    ok = (bounds[0] == 0) & (bounds[-1] == batch) & jnp.all(jnp.diff(bounds) > 0)
    if check.is_concrete(bounds):
        if not bool(ok):
            raise ValueError(
                f"groups.boundaries: expected strictly increasing values starting "
                f"at 0 and ending at B = {batch}, got {np.asarray(bounds).tolist()}"
            )
        ok = None
    else:
        check.boundaries("groups.boundaries", bounds, batch)  # check mode only
    ids = jnp.searchsorted(bounds[1:], jnp.arange(batch), side="right")
    return ids, bounds.shape[0] - 1, ok


def compute_group_advantages(
    rewards: Any, groups: Groups | None, *, backend: str | None, strict: bool
) -> jax.Array:
    """``group_advantages`` (docs/api.md); ``strict=False`` lets a requested backend that
    cannot serve it fall back to the automatic choice (a piece of a composite op)."""
    rewards = check.as_array("rewards", rewards)
    if not (
        jnp.issubdtype(rewards.dtype, jnp.floating) or jnp.issubdtype(rewards.dtype, jnp.integer)
    ):
        raise TypeError(f"rewards: expected a real dtype, got {rewards.dtype}")
    check.rank("rewards", rewards, 1, "[B]")
    if groups is None:
        raise ValueError("groups: expected a jk.Groups, e.g. jk.Groups(size=G), got None")
    ids, n_groups, ok = group_segments(rewards.shape[0], groups)
    (rewards,) = sharding.pin_grad_shardings(rewards)
    choice = dispatch.resolve(
        "group_advantages", Problem(n_rows=rewards.shape[0]), backend, strict=strict
    )
    # Groups may straddle any split of B: every device computes all of them from the [B] rewards.
    rewards = sharding.replicated(rewards.astype(jnp.float32))
    adv = choice.impl(
        rewards,
        ids.astype(jnp.int32),
        n_groups,
        normalize_std=bool(groups.normalize_std),
        std_ddof=int(groups.std_ddof),
        eps=groups.eps,
    )
    return adv if ok is None else jnp.where(ok, adv, jnp.nan)


# -- GRPO --------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: Any,
    *,
    advantages: Any,
    batch: int,
    groups: Groups | None,
    backend: str | None,
    what: str = "[B]",
) -> jax.Array:
    """GRPO's ``[B]`` advantages (``[S]`` packed: ``batch`` = S, ``what`` = "[S]"), without
    gradient: ``advantages`` when given, else the group advantages of ``rewards`` under
    ``groups`` (consecutive sequences, i.e. consecutive segment ids when packed)."""
    rewards = check.as_array("rewards", rewards)
    check.shape("rewards", rewards, (batch,), what)
    if advantages is not None:
        advantages = check.floating("advantages", advantages)
        check.shape("advantages", advantages, (batch,), what)
        return _sg(advantages.astype(jnp.float32))
    if groups is None:
        raise ValueError(
            "groups: expected a jk.Groups (e.g. jk.Groups(size=G)) or advantages=, got neither"
        )
    return _sg(compute_group_advantages(rewards, groups, backend=backend, strict=False))


def grpo_from_logprobs(
    logp: jax.Array,
    cfg: ppo_math.PPOConfig,
    *,
    ref_logp,
    old_logp,
    advantages,
    mask,
    rollout_logp,
    packing: segments.Packing | None = None,
):
    """(loss, policy_loss, kl) = aggregate(pg + β·kl), aggregate(pg), aggregate(kl), with pg
    the per-token policy term of ppo_loss (``ppo_math.policy_surrogate``) and β = cfg.kl_coef.
    ``advantages``: ``[B]`` one per row, or with ``packing`` already per token ``[B, T]``
    (each token its segment's, ``segment_math.spread``), the sequences then the segments."""
    inputs = ppo_math.PPOInputs(
        logp=logp,
        old_logp=old_logp,
        advantages=(
            advantages if packing is not None else jnp.broadcast_to(advantages[:, None], logp.shape)
        ),
        mask=mask,
        rollout_logp=rollout_logp,
        ref_logp=ref_logp,
    )
    if packing is not None:
        return segment_math.grpo_loss(inputs, cfg, packing)
    return ppo_math.grpo_loss(inputs, cfg)


def packed_grpo_advantages(
    rewards, *, advantages, groups, backend, pack: segments.Packing | None, batch: int
):
    """GRPO's advantages as ``grpo_from_logprobs`` takes them: ``[B]`` unpacked; packed, the
    ``[S]`` advantages (given or from the groups of consecutive segment ids) on each token of
    their segment."""
    if pack is None:
        return grpo_advantages(
            rewards, advantages=advantages, batch=batch, groups=groups, backend=backend
        )
    adv = grpo_advantages(
        rewards,
        advantages=advantages,
        batch=pack.count,
        groups=groups,
        backend=backend,
        what="[S] with segment_ids",
    )
    return _sg(segment_math.spread(adv, pack))


# -- the linear losses' shared parts -------------------------------------------------------


def with_segment_ids(inputs: dict, pack: segments.Packing | None) -> int | None:
    """Packed: adds the segment ids to a loss's ``inputs`` (they travel as the loss's other
    inputs do: an integer leaf of ``memory="fast"``'s ``custom_vjp``) and returns S, which
    stays static; None unpacked."""
    if pack is None:
        return None
    inputs["segment_ids"] = pack.ids
    return pack.count


def segment_inputs(inputs: dict, count: int | None):
    """(``inputs`` without the segment ids, their ``Packing`` or None): the inverse of
    :func:`with_segment_ids` inside a loss function."""
    if count is None:
        return inputs, None
    inputs = dict(inputs)
    return inputs, segments.Packing(inputs.pop("segment_ids"), count)


def linear_inputs(
    hidden, weight, bias, weight_layout, actions, mask, vocab_axis, segment_ids, num_segments, sized
):
    """The head and the per-token arrays every linear loss takes, checked, and the packing
    of ``segment_ids`` (S from ``num_segments`` or the ``[S]`` inputs ``sized``); the mask
    is 0 off every segment."""
    hidden, weight, bias, local_vocab = check.linear_head(hidden, weight, bias, weight_layout)
    vocab = global_vocab(local_vocab, vocab_axis)
    check.rank("hidden", hidden, 3, "[B, T, D]")
    shape = hidden.shape[:2]
    actions = check.integer("actions", actions)
    check.shape("actions", actions, shape, "[B, T]")
    pack = segments.packing(segment_ids, num_segments, shape, sized)
    mask = segments.mask(check.token_mask(mask, shape), pack)
    check.targets_in_range("actions", actions, vocab, mask=mask)
    return hidden, weight, bias, actions, mask, pack


def linear_loss(
    op,
    loss_fn,
    inputs,
    hidden,
    weight,
    bias,
    actions,
    mask,
    call,
    *,
    memory,
    backend,
    counts_outside=False,
):
    """``loss_fn(logp, entropy | None, inputs)`` on the head's log-probs of ``actions``
    (``head_entry.loss_rows``). With a sampler's truncation and ``counts_outside``, the
    metrics count the response tokens whose action is outside its kept set
    (``outside_kept_set``)."""
    out, kept = head_entry.loss_rows(
        op,
        loss_fn,
        inputs,
        hidden,
        weight,
        bias,
        actions,
        mask != 0,
        call,
        memory=memory,
        backend=backend,
    )
    if kept is None or not counts_outside:
        return out
    loss, metrics = out
    outside = jnp.sum(((mask != 0) & ~kept).astype(jnp.float32))
    return loss, {**metrics, "outside_kept_set": _sg(outside)}
