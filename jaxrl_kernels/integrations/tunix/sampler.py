"""The distribution a tunix rollout samples from, for sampler-matched ("processed") log-probs.

tunix's log-prob passes and losses take log-probs of ``softmax(z / T)`` over the whole
vocabulary, whatever the rollout's ``top_k`` / ``top_p``. The rollout samples from that
distribution *truncated* (to its top-k, then its nucleus) and renormalised. Sampler
matching, an option (off by default), makes the reference and old-policy passes and the
"jaxrl_grpo" / "jaxrl_ppo" losses return the log-probs (and entropy) of the truncated
distribution instead, by :func:`jaxrl_kernels.linear_logprobs`' ``top_k`` / ``top_p`` /
``min_p``. :class:`SamplerSettings` holds it; :func:`sampler_settings` reads it from an
RLCluster's rollout config, mapping tunix's conventions to ours:

=================  ==========================================  ===========================
RolloutConfig      tunix                                       SamplerSettings
=================  ==========================================  ===========================
``temperature``    T (0: greedy in vLLM, a division by 0 in    T, > 0 (0 is refused)
                   tunix's sampler)
``top_k``          None, 0 or -1: off                          None (off) or an int >= 1
``top_p``          1.0: off; None: off in vLLM, greedy in      None (off) or a float in
                   tunix's own ("vanilla") sampler             (0, 1)
(none)             tunix has no min-p                          ``min_p``: None unless given
=================  ==========================================  ===========================

The losses take it as their ``sampler`` keyword; tunix's learners pass their loss no keywords,
so :func:`.losses.sampler_matched_loss` registers a variant of "jaxrl_grpo" / "jaxrl_ppo" that
passes it (a config's ``policy_loss_fn`` names it), which :func:`.cluster.use_kernel_logprobs`
does with ``sampler_matched=True``. docs/tunix.md ("Sampler-matched log-probs") has the rest,
including where tunix's sampler's tie rules differ from the vLLM rule the kernels follow.
"""

from __future__ import annotations

import dataclasses
import math

import jaxrl_kernels as jk


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """The distribution a rollout samples each token from: ``softmax(z / temperature)``
    truncated by min-p, then top-k, then top-p (vLLM's order; None fields are off) and
    renormalised.

    ``temperature`` > 0; ``top_k`` None or an int >= 1; ``top_p`` None or in (0, 1] (1 is
    stored as None); ``min_p`` None or in [0, 1] (0 is stored as None). Build it from tunix's
    rollout config with :meth:`from_rollout_config` / :func:`sampler_settings`, or directly
    (e.g. with the ``min_p`` a vLLM rollout gets from ``rollout_vllm_sampling_kwargs``).
    """

    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (math.isfinite(t) and t > 0)
        ):
            raise ValueError(f"temperature: expected a finite float > 0, got {t!r}")
        truncation = self.sampler.truncation()  # checks the fields
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", None if truncation is None else truncation.top_p)
        object.__setattr__(self, "min_p", None if truncation is None else truncation.min_p)

    @property
    def sampler(self) -> jk.Sampler:
        """The truncation as ``jk.linear_logprobs``' ``sampler=`` takes it."""
        return jk.Sampler(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    @property
    def truncation(self):
        """The kernels' truncation (None: the whole vocabulary is kept)."""
        return self.sampler.truncation()

    @classmethod
    def from_rollout_config(cls, rollout_config) -> SamplerSettings:
        """The settings of a tunix ``RolloutConfig`` (see the module docstring's table):
        ``top_k`` None / <= 0 and ``top_p`` None / >= 1 are off; ``temperature`` 0 (greedy
        decoding: every sampled token has probability 1) and ``top_p`` <= 0 raise
        ``ValueError``. A vanilla rollout's ``top_p=None`` (greedy) is refused by
        :func:`sampler_settings`, which knows the engine."""
        temperature = rollout_config.temperature
        if temperature == 0:
            raise ValueError(
                "sampler-matched log-probs: the rollout's temperature is 0 (greedy decoding), "
                "so the sampled distribution puts probability 1 on each sampled token; there "
                "is nothing to match. Sample at a temperature > 0, or leave sampler matching "
                "off"
            )
        top_k = rollout_config.top_k
        top_k = None if top_k is None or int(top_k) <= 0 else int(top_k)
        top_p = rollout_config.top_p
        if top_p is not None and top_p <= 0:
            raise ValueError(
                f"rollout_config.top_p: expected None or a float in (0, 1], got {top_p!r}"
            )
        top_p = None if top_p is None or top_p >= 1 else float(top_p)
        return cls(float(temperature), top_k, top_p)


def sampler_settings(rl_cluster) -> SamplerSettings:
    """The :class:`SamplerSettings` of ``rl_cluster``'s training rollout config
    (``rl_cluster.get_rollout_config(Mode.TRAIN)``; see
    :meth:`SamplerSettings.from_rollout_config`).

    tunix's own sampler (the "vanilla" engine) decodes greedily when ``top_p`` is None, so
    that is refused there (``ValueError``) as temperature 0 is; a vLLM engine treats it as 1
    (off). Settings an engine takes from elsewhere (vLLM's ``rollout_vllm_sampling_kwargs``,
    a model's generation config) are not seen: pass a :class:`SamplerSettings` then.
    """
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.rollout import vanilla_rollout

    config = rl_cluster.get_rollout_config(rl_cluster_lib.Mode.TRAIN)
    if config.top_p is None and isinstance(
        getattr(rl_cluster, "rollout", None), vanilla_rollout.VanillaRollout
    ):
        raise ValueError(
            "sampler-matched log-probs: the rollout config's top_p is None, and tunix's "
            "vanilla sampler then decodes greedily (probability 1 for each sampled token); "
            "set top_p (1.0: no nucleus truncation) or leave sampler matching off"
        )
    return SamplerSettings.from_rollout_config(config)


def loss_sampler(kwargs) -> SamplerSettings | None:
    """A loss's ``sampler`` keyword: a :class:`SamplerSettings`, or None / absent (tunix's
    log-probs)."""
    sampler = kwargs.get("sampler")
    if sampler is not None and not isinstance(sampler, SamplerSettings):
        raise TypeError(
            f"sampler: expected a SamplerSettings or None, got {type(sampler).__name__}"
        )
    return sampler
