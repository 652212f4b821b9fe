"""Reference-model and rollout-policy log-probs of a tunix RLCluster from jaxrl_kernels.

Registering "jaxrl_grpo" / "jaxrl_ppo" changes the *policy loss* only. A tunix GRPO or PPO step
computes per-token log-probs in two more places, both with tunix's
``common.compute_per_token_logps``, which builds the model's [B, T, V] logits:

* the reference model's (``ref_per_token_logps``, when ``beta != 0``):
  ``RLCluster.get_ref_per_token_logps`` -> ``rl_cluster.inference_worker.get_ref_per_token_logps``;
* the rollout (old) policy's (``old_per_token_logps``: GRPO with ``num_iterations > 1``, PPO
  always): ``RLCluster.get_old_per_token_logps`` -> ``rl_cluster.rollout.get_per_token_logps``.

:func:`use_kernel_logprobs` points those two methods *of one cluster* at
:func:`.logprobs.compute_per_token_logps` (same arguments, same numbers, no logits). It is
explicit, per cluster (other clusters and tunix's modules are untouched) and reversible::

    cluster = rl_cluster.RLCluster(...)
    kernels = jaxrl_tunix.use_kernel_logprobs(cluster)     # before learner.train(...)
    learner = GRPOLearner(cluster, GRPOConfig(..., policy_loss_fn="jaxrl_grpo"), ...)
    learner.train(dataset)
    kernels.restore()                                      # tunix's own methods again

or ``with jaxrl_tunix.use_kernel_logprobs(cluster): learner.train(...)``.

Sampler matching (off by default): ``use_kernel_logprobs(cluster, sampler_matched=True,
algo_config=config)`` makes both passes return the log-probs of the distribution the rollout
samples from, ``softmax(z / T)`` truncated to the rollout config's ``top_k`` / ``top_p`` and
renormalised (:mod:`.sampler`; both at the rollout's temperature T, where tunix takes the old
policy's at 1), and points ``config.policy_loss_fn`` ("jaxrl_grpo" / "jaxrl_ppo") at the loss's
sampler-matched variant (:func:`.losses.sampler_matched_loss`), so that the current policy's
log-probs come from the same distribution; call it before building the learner, which looks
its loss up then. ``restore()`` undoes both.

What it covers: the reference model (any model :func:`.logprobs.check_model` accepts) and the
``"vanilla"`` rollout engine (tunix's own sampler). A vLLM rollout returns the engine's own
log-probs (no [B, T, V] array in JAX), and other engines keep their own method; both are
left alone and listed in ``KernelLogprobs.skipped``. Not covered: the sampler's generation
itself (its prefill computes the prompt's logits and each decoding step one [B, V] row) and
``RLCluster.get_actor_per_token_logps`` (used by tunix's agentic learner only).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrl_kernels.integrations.tunix.logprobs import check_model, compute_per_token_logps
from jaxrl_kernels.integrations.tunix.losses import (
    GRPO_LOSS_NAME,
    PPO_LOSS_NAME,
    grpo_policy_loss,
    ppo_policy_loss,
    sampler_matched_loss,
)
from jaxrl_kernels.integrations.tunix.sampler import SamplerSettings, sampler_settings

_MISSING = object()


class KernelLogprobs:
    """What :func:`use_kernel_logprobs` changed on one cluster; ``restore()`` undoes it.

    ``patched``: the roles served by jaxrl_kernels ("reference", "rollout");
    ``skipped``: role -> why it was left to tunix; ``calls``: role -> how many log-prob
    batches jaxrl_kernels computed for it; ``sampler``: the :class:`.sampler.SamplerSettings`
    the passes match, None without sampler matching; ``loss``: the sampler-matched loss
    name set as the ``algo_config``'s ``policy_loss_fn`` (None without); ``active``: False
    once restored.
    """

    def __init__(self, sampler: SamplerSettings | None = None) -> None:
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self.calls: dict[str, int] = {}
        self.sampler = sampler
        self.loss: str | None = None
        self._undo: list[Callable[[], None]] = []

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def _set(self, obj, name: str, role: str, fn) -> None:
        def counted(*args, **kwargs):
            self.calls[role] += 1
            return fn(*args, **kwargs)

        counted.__name__ = counted.__qualname__ = name
        counted.__doc__ = fn.__doc__
        self._set_attribute(obj, name, counted)
        self.patched.append(role)
        self.calls[role] = 0

    def _set_attribute(self, obj, name: str, value) -> None:
        """Shadow a method with an instance attribute (restore: the class's again)."""
        before = obj.__dict__.get(name, _MISSING)

        def undo():
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)

        self._undo.append(undo)
        setattr(obj, name, value)

    def _set_field(self, obj, name: str, value) -> None:
        """Set a (dataclass, possibly slotted) field (restore: its value before)."""
        before = getattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, before))
        setattr(obj, name, value)

    def restore(self) -> None:
        """Give the cluster back tunix's own log-prob methods (idempotent)."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> KernelLogprobs:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (
            f"KernelLogprobs(patched={self.patched}, skipped={self.skipped}, "
            f"calls={self.calls}, sampler={self.sampler}, loss={self.loss!r}, "
            f"active={self.active})"
        )


def _reference(handle: KernelLogprobs, worker, backend, sampler) -> None:
    models = getattr(worker, "_models", {})
    model = models.get("reference")
    if model is None:
        handle.skipped["reference"] = "the cluster has no reference model"
        return
    check_model(model)
    truncation = {} if sampler is None else dict(sampler=sampler.sampler)

    def get_ref_per_token_logps(prompt_tokens, completion_tokens, pad_id, eos_id, temperature=1.0):
        """jaxrl_kernels' version of InferenceWorker.get_ref_per_token_logps (same result;
        with sampler matching, the log-probs of the sampler's truncated distribution at its
        temperature)."""
        graphdef, state = worker._model_states["reference"]
        return compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=temperature if sampler is None else sampler.temperature,
            backend=backend,
            **truncation,
        )

    handle._set(worker, "get_ref_per_token_logps", "reference", get_ref_per_token_logps)


def _rollout(handle: KernelLogprobs, rollout, backend, sampler) -> None:
    from tunix.rl.rollout import vanilla_rollout

    if not isinstance(rollout, vanilla_rollout.VanillaRollout):
        handle.skipped["rollout"] = (
            f"{type(rollout).__name__} keeps its own get_per_token_logps (only tunix's "
            "'vanilla' rollout is served)"
        )
        return
    check_model(rollout.model())
    # tunix: temperature 1 (the default); sampler-matched: the sampler's, and its truncation
    matched = (
        {} if sampler is None else dict(temperature=sampler.temperature, sampler=sampler.sampler)
    )

    def get_per_token_logps(prompt_tokens, completion_tokens):
        """jaxrl_kernels' version of VanillaRollout.get_per_token_logps (same result: tunix
        computes the old policy's log-probs at temperature 1 here; with sampler matching,
        those of the sampler's truncated distribution at its temperature)."""
        graphdef, state = rollout._sampler.model_def_and_state()
        return compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=rollout.pad_id(),
            eos_id=rollout.eos_id(),
            stop_gradient=True,
            backend=backend,
            **matched,
        )

    handle._set(rollout, "get_per_token_logps", "rollout", get_per_token_logps)


def _sampler_of(rl_cluster, sampler_matched) -> SamplerSettings | None:
    if sampler_matched is False or sampler_matched is None:
        return None
    if sampler_matched is True:
        return sampler_settings(rl_cluster)
    if isinstance(sampler_matched, SamplerSettings):
        return sampler_matched
    raise TypeError(
        f"sampler_matched: expected a bool or a SamplerSettings, got "
        f"{type(sampler_matched).__name__}"
    )


def _check_algo_config(rl_cluster, algo_config) -> None:
    if algo_config is None:
        raise ValueError(
            "use_kernel_logprobs(sampler_matched=...): pass algo_config= (the learner's "
            f"GRPOConfig / PPOConfig, policy_loss_fn {GRPO_LOSS_NAME!r} / {PPO_LOSS_NAME!r}), so "
            "that the policy loss takes the current policy's log-probs from the same "
            "distribution as the old-policy and reference log-probs"
        )
    loss = getattr(algo_config, "policy_loss_fn", None)
    if loss not in (GRPO_LOSS_NAME, PPO_LOSS_NAME):
        raise ValueError(
            f"use_kernel_logprobs(sampler_matched=...): algo_config.policy_loss_fn = {loss!r}; "
            f"expected {GRPO_LOSS_NAME!r} or {PPO_LOSS_NAME!r} (tunix's own losses take the "
            "current policy's log-probs over the whole vocabulary, and their ratio would "
            "compare them with the truncated old-policy log-probs)"
        )
    if _bound_plain_loss(rl_cluster):
        raise ValueError(
            "use_kernel_logprobs(sampler_matched=...): a learner has already taken "
            f"{loss!r} from the registry for this cluster's actor trainer; call "
            "use_kernel_logprobs before building the learner, so that it takes the "
            "sampler-matched variant"
        )


def _bound_plain_loss(rl_cluster) -> bool:
    """Whether the cluster's actor trainer already trains with our loss (not a variant):
    PPOLearner hands it the registered function, GRPOLearner a lambda that calls it."""
    loss_fn = getattr(getattr(rl_cluster, "actor_trainer", None), "loss_fn", None)
    if getattr(loss_fn, "sampler", None) is not None:  # a sampler-matched variant
        return False
    ours = (grpo_policy_loss, ppo_policy_loss)
    if any(loss_fn is fn for fn in ours):
        return True
    for cell in getattr(loss_fn, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(contents is fn for fn in ours):
            return True
    return False


def use_kernel_logprobs(
    rl_cluster,
    *,
    reference: bool = True,
    rollout: bool = True,
    backend: str | None = None,
    sampler_matched: bool | SamplerSettings = False,
    algo_config=None,
) -> KernelLogprobs:
    """Serve ``rl_cluster``'s reference and rollout-policy log-probs with jaxrl_kernels.

    ``reference`` / ``rollout``: which of the two passes to take over. ``backend``:
    jaxrl_kernels' backend for them (None: automatic). Raises ``NotImplementedError`` (and
    changes nothing) when a model it would serve lacks what the kernels need
    (:func:`.logprobs.check_model`). Returns the :class:`KernelLogprobs` handle; see the
    module docstring.

    ``sampler_matched``: False (default): tunix's log-probs (over the whole vocabulary; the
    old policy's at temperature 1). True: the log-probs of the distribution the rollout
    samples from, with the temperature, ``top_k`` and ``top_p`` of the cluster's training
    rollout config (:func:`.sampler.sampler_settings`); a :class:`.sampler.SamplerSettings`:
    that distribution (e.g. with a ``min_p``). It then needs ``algo_config``, the learner's
    GRPO / PPO config with ``policy_loss_fn`` "jaxrl_grpo" or "jaxrl_ppo", *before* the
    learner is built: its ``policy_loss_fn`` is set to the loss's sampler-matched variant
    (:func:`.losses.sampler_matched_loss`; ``restore()`` sets it back), so that the loss's
    current-policy log-probs come from the same distribution (``ValueError`` if a learner
    already took the plain loss for this cluster). ``algo_config`` is not read without
    sampler matching.
    """
    sampler = _sampler_of(rl_cluster, sampler_matched)
    if sampler is not None:
        _check_algo_config(rl_cluster, algo_config)
    handle = KernelLogprobs(sampler)
    try:
        if reference:
            _reference(handle, rl_cluster.inference_worker, backend, sampler)
        if rollout:
            _rollout(handle, rl_cluster.rollout, backend, sampler)
        if sampler is not None:
            handle.loss = sampler_matched_loss(algo_config.policy_loss_fn, sampler)
            handle._set_field(algo_config, "policy_loss_fn", handle.loss)
    except BaseException:
        handle.restore()
        raise
    return handle
