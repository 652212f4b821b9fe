"""tunix's token-level reductions and KL estimates, on [B, T] arrays.

These are tunix's definitions, which differ from our in places, so the registered losses
reproduce tunix's numbers. Where the two agree, our op is used (:func:`jaxrl_kernels.aggregate`,
:func:`jaxrl_kernels.kl_penalty`). With m the completion mask, x per-token values, n_b = Σ_t m_bt,
R = max(#{b : n_b > 0}, 1) (rows with a completion token) and T the completion length:

* ``masked_mean``: Σ m·x / (Σ m + 1e-8)  (tunix's diagnostics and PPO loss)
* ``"token-mean"``: Σ m·x / max(Σ m, 1)  (= docs/api.md "token_mean")
* ``"sequence-mean-token-mean"``: Σ_b [Σ_t m·x / max(n_b, 1)] / R  (= docs/api.md "seq_mean_token_mean")
* ``"sequence-mean-token-scale"``: Σ_b [Σ_t m·x / T] / R
* ``"seq-mean-token-sum"``: Σ_{b: n_b > 0} Σ_t m·x / R
* ``"sequence-mean-token-sum-norm"``: Σ m·x / R

KL methods, d = ref_logp - logp: ``"kl"``: -d (docs/api.md "k1"); ``"mse_kl"``: d²/2 (docs/api.md "k2");
``"low_var_kl"``: exp(d) - d - 1 with no clip on d (our "k3" clips d to [-20, 20] first).
A ``clamp_value`` c then clips the estimate to [-c, c].

Also here: the policy term as tunix computes it (its clipped surrogate with the dual clip,
GRPO's and GSPO's log-ratio) and the diagnostics tunix's GRPO loss reports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxrl_kernels as jk

AGG_MODES = (
    "token-mean",
    "sequence-mean-token-mean",
    "sequence-mean-token-scale",
    "seq-mean-token-sum",
    "sequence-mean-token-sum-norm",
)
KL_METHODS = ("kl", "mse_kl", "low_var_kl")
_SPEC_MODES = {"token-mean": "token_mean", "sequence-mean-token-mean": "seq_mean_token_mean"}
_SPEC_KL = {"kl": "k1", "mse_kl": "k2"}


def check_option(name: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"{name}: unknown option {value!r}; valid: {', '.join(valid)}")


def masked_mean(values, mask):
    """Σ m·x / (Σ m + 1e-8), float32."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(values.astype(jnp.float32) * mask) / (jnp.sum(mask) + 1e-8)


def masked_max(values, mask, empty):
    """max of x over m > 0; ``empty`` (the identity of the max: -inf, or 0 for ratios) elsewhere."""
    return jnp.max(jnp.where(mask > 0, values, empty))


def masked_min(values, mask):
    """min of x over m > 0; +inf when the mask is empty."""
    return jnp.min(jnp.where(mask > 0, values, jnp.inf))


def aggregate(values, mask, mode: str):
    """tunix's ``loss_agg_mode`` reduction of per-token [B, T] values (see the module doc)."""
    check_option("loss_agg_mode", mode, AGG_MODES)
    if mode in _SPEC_MODES:
        return jk.aggregate(values.astype(jnp.float32), mask, _SPEC_MODES[mode])
    mask = mask.astype(jnp.float32)
    row_sums = jnp.sum(values.astype(jnp.float32) * mask, axis=-1)
    has_tokens = jnp.sum(mask, axis=-1) > 0
    rows = jnp.maximum(jnp.sum(has_tokens), 1).astype(jnp.float32)
    if mode == "sequence-mean-token-scale":
        return jnp.sum(row_sums / values.shape[-1]) / rows
    if mode == "seq-mean-token-sum":
        return jnp.sum(jnp.where(has_tokens, row_sums, 0.0)) / rows
    return jnp.sum(row_sums) / rows  # sequence-mean-token-sum-norm


def kl_divergence(logp, ref_logp, method: str, clamp_value=None):
    """tunix's per-token KL estimate of the policy from the reference (see the module doc)."""
    check_option("kl_loss_mode", method, KL_METHODS)
    logp = logp.astype(jnp.float32)
    ref_logp = ref_logp.astype(jnp.float32)
    if method in _SPEC_KL:
        kl = jk.kl_penalty(logp, ref_logp, _SPEC_KL[method])
    else:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
    if clamp_value is not None:
        kl = jnp.clip(kl, -clamp_value, clamp_value)
    return kl


# -- the policy term and its diagnostics, as tunix computes them ------------------------------

LOG_RATIO_CLIP = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def surrogate(ratio, adv, clip_low, clip_high, dual_clip):
    """(pg, unclipped, clipped, dual_clipped): tunix's clipped surrogate with optional dual clip."""
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    pg = jnp.maximum(unclipped, clipped).astype(jnp.float32)
    if dual_clip is None:
        return pg, unclipped, clipped, jnp.zeros(pg.shape, jnp.float32)
    bound = -dual_clip * adv
    dual = ((pg > bound) & (adv < 0.0)).astype(jnp.float32)
    return jnp.where(adv < 0.0, jnp.minimum(bound, pg), pg), unclipped, clipped, dual


def grpo_log_ratio(logp, old, mask, loss_algo):
    """(clipped log-ratio ℓ used for the ratio, tunix's ppo_kl diagnostic)."""
    log_ratio = logp - old
    ppo_kl = masked_mean(-log_ratio, mask)
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    if loss_algo == "gspo-token":
        per_seq = jnp.sum(log_ratio * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1)
        log_ratio = jnp.minimum(
            logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(per_seq)[:, None],
            GSPO_LOG_RATIO_MAX,
        )
    return log_ratio, ppo_kl


def grpo_diagnostics(ratio, log_ratio, adv, unclipped, clipped, mask):
    adv = jnp.broadcast_to(adv, mask.shape)
    return {
        "is_ratio/mean": masked_mean(ratio, mask),
        "is_ratio/max": masked_max(ratio, mask, 0.0),
        "is_ratio/min": masked_min(ratio, mask),
        "log_ratio/abs_mean": masked_mean(jnp.abs(log_ratio), mask),
        "pg_loss/unclipped_mean": masked_mean(unclipped, mask),
        "pg_loss/clipped_mean": masked_mean(clipped, mask),
        "advantage/abs_mean": masked_mean(jnp.abs(adv), mask),
        "advantage/max": masked_max(adv, mask, -jnp.inf),
        "advantage/min": masked_min(adv, mask),
        "advantage/nonzero_frac": masked_mean((jnp.abs(adv) > 1e-8).astype(jnp.float32), mask),
    }
