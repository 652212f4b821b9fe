"""The rollout sampler's truncation, as one value checked when it is built."""

from __future__ import annotations

import dataclasses

from jaxrl_kernels.config import deprecated as legacy
from jaxrl_kernels.formulas import sampler_math


@dataclasses.dataclass(frozen=True)
class Sampler:
    """The truncation a rollout sampler applied before it sampled (vLLM's order: min-p, then
    top-k, then top-p; ties at a threshold kept).

    Pass it as ``sampler=`` to ``token_logprobs``, ``linear_logprobs`` and the linear losses:
    their log-probs (and entropy) are then those of ``softmax(z)`` on each row's kept set,
    renormalised (docs/api.md, "Sampler-matched log-probs"). Frozen and hashable. The
    temperature stays the op's own ``temperature=``.

    Attributes:
      top_k: keep the ``top_k`` largest logits (an int >= 1), or ``None``.
      top_p: keep the smallest set of largest probabilities whose mass reaches ``top_p``
        (a float in (0, 1]; 1 keeps everything), or ``None``.
      min_p: keep the probabilities at least ``min_p`` times the largest (a float in [0, 1];
        0 keeps everything), or ``None``.

    Raises:
      ValueError: a value outside its range (``top_k: expected None or an int >= 1, got 0``).

    Example:
      >>> import jax.numpy as jnp, jaxrl_kernels as jk
      >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
      >>> logp = jk.token_logprobs(logits, jnp.array([0]), sampler=jk.Sampler(top_k=2))
      >>> round(float(logp[0]), 3)                         # log(0.5 / 0.8)
      -0.47
    """

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        sampler_math.truncation(self.top_k, self.top_p, self.min_p)

    def truncation(self) -> sampler_math.Truncation | None:
        """The kernels' :class:`sampler_math.Truncation`, or ``None`` when nothing is cut."""
        return sampler_math.truncation(self.top_k, self.top_p, self.min_p)


LEGACY = legacy.Keywords("sampler", Sampler, {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p"})
"""The deprecated keywords a ``Sampler`` replaces."""


def truncation_of(sampler: Sampler | None) -> sampler_math.Truncation | None:
    """The truncation of an op's ``sampler=`` (``None``: none)."""
    return None if sampler is None else sampler.truncation()
