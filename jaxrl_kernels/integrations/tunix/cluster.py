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

What it covers: the reference model (any model :func:`.logprobs.check_model` accepts) and the
``"vanilla"`` rollout engine (tunix's own sampler). A vLLM rollout returns the engine's own
log-probs (no [B, T, V] array in JAX), and other engines keep their own method; both are
left alone and listed in ``KernelLogprobs.skipped``. Not covered: the sampler's generation
itself (its prefill computes the prompt's logits and each decoding step one [B, V] row) and
``RLCluster.get_actor_per_token_logps`` (used by tunix's agentic learner only).
"""

from __future__ import annotations

from typing import Any

from jaxrl_kernels.integrations.tunix.logprobs import check_model, compute_per_token_logps

_MISSING = object()


class KernelLogprobs:
    """What :func:`use_kernel_logprobs` changed on one cluster; ``restore()`` undoes it.

    ``patched``: the roles served by jaxrl_kernels ("reference", "rollout");
    ``skipped``: role -> why it was left to tunix; ``calls``: role -> how many log-prob
    batches jaxrl_kernels computed for it; ``active``: False once restored.
    """

    def __init__(self) -> None:
        self.patched: list[str] = []
        self.skipped: dict[str, str] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def _set(self, obj, name: str, role: str, fn) -> None:
        def counted(*args, **kwargs):
            self.calls[role] += 1
            return fn(*args, **kwargs)

        counted.__name__ = counted.__qualname__ = name
        counted.__doc__ = fn.__doc__
        self._undo.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, counted)
        self.patched.append(role)
        self.calls[role] = 0

    def restore(self) -> None:
        """Give the cluster back tunix's own log-prob methods (idempotent)."""
        while self._undo:
            obj, name, before = self._undo.pop()
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, before)

    def __enter__(self) -> "KernelLogprobs":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return (f"KernelLogprobs(patched={self.patched}, skipped={self.skipped}, "
                f"calls={self.calls}, active={self.active})")


def _reference(handle: KernelLogprobs, worker, backend) -> None:
    models = getattr(worker, "_models", {})
    model = models.get("reference")
    if model is None:
        handle.skipped["reference"] = "the cluster has no reference model"
        return
    check_model(model)

    def get_ref_per_token_logps(prompt_tokens, completion_tokens, pad_id, eos_id,
                                temperature=1.0):
        """jaxrl_kernels' version of InferenceWorker.get_ref_per_token_logps (same result)."""
        graphdef, state = worker._model_states["reference"]
        return compute_per_token_logps(
            graphdef, state, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            pad_id=pad_id, eos_id=eos_id, stop_gradient=True, temperature=temperature,
            backend=backend)

    handle._set(worker, "get_ref_per_token_logps", "reference", get_ref_per_token_logps)


def _rollout(handle: KernelLogprobs, rollout, backend) -> None:
    from tunix.rl.rollout import vanilla_rollout

    if not isinstance(rollout, vanilla_rollout.VanillaRollout):
        handle.skipped["rollout"] = (
            f"{type(rollout).__name__} keeps its own get_per_token_logps (only tunix's "
            "'vanilla' rollout is served)")
        return
    check_model(rollout.model())

    def get_per_token_logps(prompt_tokens, completion_tokens):
        """jaxrl_kernels' version of VanillaRollout.get_per_token_logps (same result: tunix
        computes the old policy's log-probs at temperature 1 here)."""
        graphdef, state = rollout._sampler.model_def_and_state()
        return compute_per_token_logps(
            graphdef, state, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            pad_id=rollout.pad_id(), eos_id=rollout.eos_id(), stop_gradient=True,
            backend=backend)

    handle._set(rollout, "get_per_token_logps", "rollout", get_per_token_logps)


def use_kernel_logprobs(rl_cluster, *, reference: bool = True, rollout: bool = True,
                        backend: str | None = None) -> KernelLogprobs:
    """Serve ``rl_cluster``'s reference and rollout-policy log-probs with jaxrl_kernels.

    ``reference`` / ``rollout``: which of the two passes to take over. ``backend``:
    jaxrl_kernels' backend for them (None: automatic). Raises ``NotImplementedError`` (and
    changes nothing) when a model it would serve lacks what the kernels need
    (:func:`.logprobs.check_model`). Returns the :class:`KernelLogprobs` handle; see the
    module docstring.
    """
    handle = KernelLogprobs()
    try:
        if reference:
            _reference(handle, rl_cluster.inference_worker, backend)
        if rollout:
            _rollout(handle, rl_cluster.rollout, backend)
    except BaseException:
        handle.restore()
        raise
    return handle
