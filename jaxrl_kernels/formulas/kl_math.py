"""The per-token KL estimators, written once for tiles and whole arrays (float32).

With d = ref_logp − logp (docs/api.md): ``"k1"`` = −d, ``"abs"`` = |d|, ``"k2"`` = d²/2 and
``"k3"`` = exp(d') − d' − 1 with d' = clip(d, −20, 20). ``estimator`` arrives checked
(``validation``).
"""

from __future__ import annotations

import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
KL_LOG_RATIO_CLIP = 20.0


def kl_penalty(logp, ref_logp, estimator: str = "k3"):
    """Per-token KL estimate with d = ref_logp - logp (see docs/api.md)."""
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "abs":
        return jnp.abs(d)
    if estimator == "k2":
        return 0.5 * d * d
    assert estimator == "k3", estimator  # one of KL_ESTIMATORS, checked at the public op
    d = jnp.clip(d, -KL_LOG_RATIO_CLIP, KL_LOG_RATIO_CLIP)
    return jnp.exp(d) - d - 1.0
