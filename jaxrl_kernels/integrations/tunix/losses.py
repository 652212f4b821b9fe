"""tunix's GRPO and PPO policy losses on log-probs that never pass through [B, T, V] logits.

Both have tunix's policy-loss signature ``fn(model, train_example, algo_config, pad_id, eos_id,
**kwargs) -> (loss, aux)`` and return what tunix's ``"grpo"`` / ``"ppo"`` losses return: the
same loss, the same ``aux`` keys and values, the same gradient for every model parameter. The
only O(B·T·V) work, the log-probs (and entropies) of the completion, is
:func:`jaxrl_kernels.linear_logprobs` on the model's final hidden states
(:mod:`.logprobs`); the rest is O(B·T) arithmetic on [B, T] arrays, written here with tunix's
definitions (:mod:`.token_math` lists where they differ from our ``ppo_loss``).

GRPO (tunix ``grpo_loss_fn``), per completion token with A the advantage ([B] or [B, T]),
ε = ``epsilon``, ε_h = ``epsilon_high`` (default ε), old = ``old_per_token_logps`` (or
stop_gradient(logp) when None):

* ℓ = clip(logp − old, ±20); ``loss_algo="gspo-token"`` replaces it by
  min(logp − sg(logp) + sg(ℓ̄_b), 10), ℓ̄_b the masked mean of ℓ over sequence b;
* r = exp(ℓ); pg = max(−A·r, −A·clip(r, 1 − ε, 1 + ε_h)); dual clip c = ``epsilon_c``: where
  A < 0, pg = min(pg, −c·A);
* pg ·= ``sampler_is_weights`` when the example has them;
* loss = agg(pg) + β·agg(KL) (β = ``beta``; KL by ``kl_loss_mode`` and ``kl_clamp_value``,
  when the example has ``ref_per_token_logps``), agg = ``loss_agg_mode``.

PPO (tunix ``ppo_policy_loss_fn``): r = exp(logp − old) (no clip), the same clipped surrogate
with ``epsilon_low`` / ``epsilon_high`` and dual clip, loss = mean(pg) − ``entropy_coef``·mean(H)
(+ ``kl_coef``·mean(KL "kl") when the config has a positive ``kl_coef``), means taken as
Σ m·x / (Σ m + 1e-8). The value (critic) loss is tunix's own: it has no vocabulary axis.

Both have exactly the parameters of tunix's own losses, ``(model, train_example, algo_config,
pad_id, eos_id, **kwargs)``: tunix's PPOLearner hands the registered function itself to its
trainer, whose ``nnx.value_and_grad`` binds every argument by position, so a keyword-only
parameter would fail there ("keyword arguments could not be resolved to positions"). The
keywords they read are ``backend`` (jaxrl_kernels' backend for the log-probs; absent or None:
automatic), ``sampler`` (below) and ``memory`` (``"fast"`` takes the loss's gradient in the
forward; absent or None: the mode of ``jk.memory_mode`` or ``JAXRL_KERNELS_MEMORY``, else
``"auto"``), for direct calls or a trainer's loss wrapper; tunix passes none (a
``jk.memory_mode`` scope in force when the training step is traced, or the variable, then sets
the mode), and others are ignored as tunix's losses ignore them.

Sampler matching (off by default; :mod:`.sampler`): with a ``sampler`` keyword (a
:class:`.sampler.SamplerSettings`; tunix's learners pass it through the variant that
:func:`sampler_matched_loss` registers, e.g. ``"jaxrl_grpo[temperature=0.9,top_k=50]"``), the
policy's log-probs and entropy are those of the rollout's truncated, renormalised distribution
(its top-k / top-p, at its temperature, also for PPO, whose tunix loss takes temperature 1),
and ``aux`` gains ``"outside_kept_set"`` (how many completion tokens lie outside their
position's kept set) when the settings truncate. The loss formulas are unchanged. Absent or
None: tunix's log-probs, exactly as without the option.

The final hidden states enter the head with the model dimension whole
(:func:`.logprobs.head_layout`), so that XLA lays out the step, and every parameter's gradient
and updated value, as under tunix's own losses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from tunix.rl import function_registry

import jaxrl_kernels as jk
from jaxrl_kernels.engine import head_entry
from jaxrl_kernels.engine.linear_head import HeadCall
from jaxrl_kernels.integrations.tunix import token_math as tm
from jaxrl_kernels.integrations.tunix.logprobs import policy_head_rows, tunix_temperature
from jaxrl_kernels.integrations.tunix.sampler import SamplerSettings, loss_sampler

GRPO_LOSS_NAME = "jaxrl_grpo"
PPO_LOSS_NAME = "jaxrl_ppo"
LOSS_ALGOS = ("grpo", "gspo-token")

_sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """What a registered loss computes on the policy's per-token log-probs:
    ``loss_of_logprobs(logp, entropy | None, inputs) -> (loss, aux)`` (tunix's layout,
    :class:`.logprobs.HeadRows`' ``pad``), with the log-probs taken at ``temperature``, from
    ``sampler``'s truncated distribution when it is given (sampler matching), with the
    entropy when ``with_entropy``; ``op`` names the kernels' loss for the memory choice."""

    loss_of_logprobs: Callable
    inputs: dict
    temperature: float
    with_entropy: bool
    sampler: SamplerSettings | None
    op: str


def _example_loss(model, example, pad_id, eos_id, terms: LossTerms, kwargs):
    """``terms.loss_of_logprobs`` on the policy's per-token log-probs, through the library's
    one linear-head entry (``head_entry.loss_rows``): with ``kwargs["memory"]`` resolving to
    ``"fast"`` (and no sampler truncation) the loss's gradient is taken in the forward (3
    GEMMs, one [B, T, V] buffer); else the log-probs come from the ``linear_logprobs``
    primitive (lean: nothing [B, T, V] kept; fast with a truncation: the logits kept for the
    backward). With a truncation, ``aux`` gains ``"outside_kept_set"``: how many completion
    tokens (mask != 0) lie outside their position's kept set."""
    rows = policy_head_rows(
        model,
        example.prompt_ids,
        example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        segment_ids=getattr(example, "segment_ids", None),
        segment_positions=getattr(example, "segment_positions", None),
    )
    call = HeadCall(
        weight_layout=rows.layout,
        temperature=terms.temperature,
        return_entropy=terms.with_entropy,
        truncation=None if terms.sampler is None else terms.sampler.truncation,
    )

    def loss_fn(logp, entropy, inputs):
        return terms.loss_of_logprobs(*rows.pad(logp, entropy), inputs)

    valid = jnp.ones(rows.targets.shape, jnp.bool_)
    (loss, aux), kept = head_entry.loss_rows(
        terms.op,
        loss_fn,
        terms.inputs,
        rows.hidden,
        rows.weight,
        None,
        rows.targets,
        valid,
        call,
        memory=kwargs.get("memory"),
        backend=kwargs.get("backend"),
    )
    if kept is None:
        return loss, aux
    outside = (terms.inputs["mask"] != 0) & ~rows.pad_kept(kept)
    return loss, {**aux, "outside_kept_set": _sg(jnp.sum(outside.astype(jnp.float32)))}


def _loss_temperature(algo_config, sampler, tunix_value):
    """The temperature of the policy's log-probs: tunix's (``tunix_value``), or with sampler
    matching the sampler's, which must then agree with ``algo_config.temperature`` where the
    config has one (GRPOLearner copies the rollout's there)."""
    if sampler is None:
        return tunix_temperature(tunix_value)
    own = getattr(algo_config, "temperature", None)
    if own is not None and tunix_temperature(own) != sampler.temperature:
        raise ValueError(
            f"sampler.temperature = {sampler.temperature} but "
            f"algo_config.temperature = {own}: sampler-matched log-probs take one temperature, "
            "the rollout's"
        )
    return sampler.temperature


def grpo_loss_terms(train_example, algo_config, sampler=None) -> LossTerms:
    """The :class:`LossTerms` of tunix's ``"grpo"`` loss (checks the config's options);
    ``sampler``: the :class:`.sampler.SamplerSettings` of sampler matching, or None."""
    mode = algo_config.loss_agg_mode
    tm.check_option("loss_agg_mode", mode, tm.AGG_MODES)
    tm.check_option("loss_algo", algo_config.loss_algo, LOSS_ALGOS)
    epsilon = algo_config.epsilon
    epsilon_high = getattr(algo_config, "epsilon_high", epsilon)
    beta = algo_config.beta
    inputs = dict(
        mask=train_example.completion_mask,
        adv=train_example.advantages.astype(jnp.float32),
        old=train_example.old_per_token_logps,
        ref=train_example.ref_per_token_logps,
        weights=getattr(train_example, "sampler_is_weights", None),
    )
    return LossTerms(
        functools.partial(_grpo_loss, algo_config, epsilon, epsilon_high, beta, mode),
        inputs,
        _loss_temperature(algo_config, sampler, algo_config.temperature),
        True,
        sampler,
        "linear_grpo_loss",
    )


def grpo_policy_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """tunix's ``"grpo"`` policy loss (GRPO / GSPO-token) from hidden states; (loss, aux).

    ``kwargs``: ``backend`` (jaxrl_kernels' backend, default automatic) and ``memory``
    (``"lean"``, ``"fast"``: the loss's gradient taken in the forward,
    :mod:`jaxrl_kernels.engine.fused_loss`, or a byte budget; absent: ``jk.memory_mode``'s, else
    ``JAXRL_KERNELS_MEMORY``'s, else ``"auto"``) and ``sampler`` (a
    :class:`.sampler.SamplerSettings`: sampler-matched log-probs; absent or None: tunix's);
    others are ignored.
    """
    return _example_loss(
        model,
        train_example,
        pad_id,
        eos_id,
        grpo_loss_terms(train_example, algo_config, loss_sampler(kwargs)),
        kwargs,
    )


def _grpo_loss(algo_config, epsilon, epsilon_high, beta, mode, logp, entropy, inputs):
    """tunix's GRPO / GSPO-token loss and metrics on the per-token log-probs."""
    mask, adv, old = inputs["mask"], inputs["adv"], inputs["old"]
    adv = adv if adv.ndim == 2 else adv[:, None]
    old = _sg(logp) if old is None else old.astype(jnp.float32)

    log_ratio, ppo_kl = tm.grpo_log_ratio(logp, old, mask, algo_config.loss_algo)
    ratio = jnp.exp(log_ratio)
    pg, unclipped, clipped, dual = tm.surrogate(
        ratio, adv, epsilon, epsilon_high, getattr(algo_config, "epsilon_c", None)
    )
    weights = inputs["weights"]
    if weights is not None:
        weights = weights.astype(jnp.float32)
        pg = pg * weights
    loss = tm.aggregate(pg, mask, mode)

    aux = {
        "kl": 0.0,
        "kl_loss": 0.0,
        "pg_loss": loss,
        "pg_clipfrac": tm.masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": tm.aggregate(dual, mask, mode),
        **tm.grpo_diagnostics(ratio, log_ratio, adv, unclipped, clipped, mask),
        "sampler_is/weight_mean": (
            jnp.float32(1.0) if weights is None else tm.masked_mean(weights, mask)
        ),
        "sampler_is/weight_min": (
            jnp.float32(1.0) if weights is None else tm.masked_min(weights, mask)
        ),
    }
    ref = inputs["ref"]
    if ref is not None:
        kl = tm.kl_divergence(logp, ref, algo_config.kl_loss_mode, algo_config.kl_clamp_value)
        aux["kl"] = jk.aggregate(kl, mask, "token_mean")
        aux["kl_loss"] = tm.aggregate(kl, mask, mode)
        if beta is not None and beta != 0.0:
            loss = loss + beta * aux["kl_loss"]
    aux["entropy"] = tm.aggregate(entropy, mask, mode)
    return loss, aux


def ppo_loss_terms(train_example, algo_config, sampler=None) -> LossTerms:
    """The :class:`LossTerms` of tunix's ``"ppo"`` policy loss (log-probs at temperature 1,
    as tunix's; with a ``sampler``, sampler matching, at the sampler's)."""
    old = train_example.old_per_token_logps
    if old is None:
        raise ValueError(
            "train_example.old_per_token_logps: PPO's ratio needs the rollout "
            "policy's log-probs, got None"
        )
    entropy_coef = algo_config.entropy_coef
    with_entropy = entropy_coef is not None and entropy_coef != 0.0
    inputs = dict(
        mask=train_example.completion_mask,
        adv=train_example.advantages,
        old=old,
        ref=train_example.ref_per_token_logps,
    )
    return LossTerms(
        functools.partial(_ppo_loss, algo_config, entropy_coef, with_entropy),
        inputs,
        _loss_temperature(algo_config, sampler, 1.0),
        with_entropy,
        sampler,
        "linear_ppo_loss",
    )


def ppo_policy_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """tunix's ``"ppo"`` policy loss from hidden states; (loss, aux).

    ``kwargs``: ``backend`` (jaxrl_kernels' backend, default automatic) and ``memory``
    (``"lean"``, ``"fast"``: the loss's gradient taken in the forward,
    :mod:`jaxrl_kernels.engine.fused_loss`, or a byte budget; absent: ``jk.memory_mode``'s, else
    ``JAXRL_KERNELS_MEMORY``'s, else ``"auto"``) and ``sampler`` (a
    :class:`.sampler.SamplerSettings`: sampler-matched log-probs; absent or None: tunix's);
    others are ignored.
    """
    return _example_loss(
        model,
        train_example,
        pad_id,
        eos_id,
        ppo_loss_terms(train_example, algo_config, loss_sampler(kwargs)),
        kwargs,
    )


def _ppo_loss(algo_config, entropy_coef, with_entropy, logp, entropy, inputs):
    """tunix's PPO policy loss and metrics on the per-token log-probs."""
    mask, adv, old = inputs["mask"], inputs["adv"], inputs["old"]
    ratio = jnp.exp(logp - old)
    pg, unclipped, clipped, dual = tm.surrogate(
        ratio,
        adv,
        algo_config.epsilon_low,
        algo_config.epsilon_high,
        getattr(algo_config, "epsilon_c", None),
    )
    aux = {
        "pg_clipfrac": tm.masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "pg_clipfrac_lower": tm.masked_mean(dual, mask),
    }
    loss = tm.masked_mean(pg, mask)
    if with_entropy:
        aux["loss/entropy"] = tm.masked_mean(entropy, mask)
        loss = loss - entropy_coef * aux["loss/entropy"]
    kl_coef = getattr(algo_config, "kl_coef", 0.0)
    if kl_coef > 0.0 and inputs["ref"] is not None:
        kl = tm.kl_divergence(
            logp, inputs["ref"], "kl", getattr(algo_config, "kl_clamp_value", None)
        )
        aux["kl"] = tm.masked_mean(kl, mask)
        loss = loss + kl_coef * aux["kl"]
    return loss, aux


def sampler_matched_loss(loss_name: str, sampler: SamplerSettings) -> str:
    """Register (once) and return the name of ``loss_name``'s sampler-matched variant.

    ``loss_name``: ``"jaxrl_grpo"`` or ``"jaxrl_ppo"``; ``sampler``: a
    :class:`.sampler.SamplerSettings`. The variant, registered with tunix's policy losses
    under a name that spells the settings (``"jaxrl_grpo[temperature=0.9,top_k=50,top_p=0.95]"``),
    has tunix's loss signature and calls the loss with ``sampler=sampler`` (other keywords
    pass through): set it as a config's ``policy_loss_fn`` before the learner is built (the
    learner looks its loss up then), as ``use_kernel_logprobs(..., sampler_matched=True,
    algo_config=config)`` does.
    """
    losses = {GRPO_LOSS_NAME: grpo_policy_loss, PPO_LOSS_NAME: ppo_policy_loss}
    if loss_name not in losses:
        raise ValueError(
            f"sampler_matched_loss: expected {GRPO_LOSS_NAME!r} or "
            f"{PPO_LOSS_NAME!r}, got {loss_name!r}"
        )
    if not isinstance(sampler, SamplerSettings):
        raise TypeError(
            f"sampler_matched_loss: expected a SamplerSettings, got {type(sampler).__name__}"
        )
    fields = ",".join(
        f"{f.name}={getattr(sampler, f.name)!r}"
        for f in dataclasses.fields(sampler)
        if getattr(sampler, f.name) is not None
    )
    name = f"{loss_name}[{fields}]"
    try:
        function_registry.get_policy_loss_fn(name)
    except LookupError:
        function_registry.register_policy_loss_fn(name)(_matched(losses[loss_name], sampler, name))
    return name


def _matched(loss_fn, sampler, name):
    def loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
        return loss_fn(
            model, train_example, algo_config, pad_id, eos_id, **{**kwargs, "sampler": sampler}
        )

    loss.__name__ = loss.__qualname__ = f"{loss_fn.__name__}_sampler_matched"
    loss.__doc__ = (
        f"{name!r}: {loss_fn.__name__} with sampler={sampler} (sampler-matched "
        "log-probs; jaxrl_kernels.integrations.tunix.sampler_matched_loss)."
    )
    loss.sampler = sampler
    loss.base = loss_fn
    return loss
