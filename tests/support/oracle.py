"""An independent NumPy implementation of every docs/api.md op and of its gradients.

Written from the formulas of docs/api.md only; it never imports ``jaxrl_kernels``
nor jax. Every function takes ``dt`` (default float64): with ``dt=np.float32``
it evaluates *the same formula* in float32, which is what the low-precision
tolerance of docs/api.md "Numerics" is measured against.

Gradients are analytic (no finite differences, no autodiff):

* ``d logp / d z = onehot - p`` and ``d H / d z = -p (z - sum(p z))``, each
  divided by the temperature for the logits.
* The PPO surrogate is piecewise smooth; on the piece that a token is on, the
  derivative w.r.t. ``logp`` is ``-A r`` (unclipped branch, log-ratio inside
  [-20, 20]) or 0 (clipped / dual-clipped branch or clipped log-ratio), times
  the stop-gradient TIS weight. With our sequence-level ratio, ``-A exp(l_b)``
  on the unclipped branch (our stop-gradient form: no factor for a clipped l_b,
  no coupling between tokens); with CISPO, ``-A clip(r)`` on every token.
* ``aggregate`` is linear in its values: ``aggregate(x) = sum(w * x)`` with
  weights :func:`aggregate_weights` that depend on the mask only.
"""

from __future__ import annotations

import numpy as np

F64 = np.float64

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
AGG_ALIASES = {"sequence_mean": "seq_mean_token_mean"}
LOG_RATIO_CLIP = 20.0
K3_CLIP = 20.0


def f64(x):
    """Any array (numpy, jax, bf16, bool, ...) as a float64 numpy array (exact upcast)."""
    return np.asarray(x).astype(F64)


# ----------------------------------------------------------------------------- log-probs


def _softmax_stats(z):
    """Row-wise ``(p, lse, mean_z)`` of logits z[..., V], in z's dtype."""
    zmax = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - zmax)
    s = np.sum(e, axis=-1, keepdims=True)
    lse = zmax + np.log(s)
    p = e / s
    mean_z = np.sum(p * z, axis=-1, keepdims=True)
    return p, lse, mean_z


def _row_status(targets, vocab, ignore_index):
    t = np.asarray(targets).astype(np.int64)
    ignored = np.zeros(t.shape, bool) if ignore_index is None else t == ignore_index
    bad = ~ignored & ((t < 0) | (t >= vocab))
    safe = np.where(ignored | bad, 0, t)
    return safe, ignored, bad


def token_logprobs(logits, targets, *, temperature=1.0, ignore_index=None, dt=F64):
    """``(logp, entropy)`` of shape targets.shape.

    z = logits / T; logp = z[t] - logsumexp(z); H = logsumexp(z) - sum(softmax(z) z).
    Ignored targets give 0; other targets outside [0, V) give NaN.
    """
    z = np.asarray(f64(logits), dtype=dt) / dt(temperature)
    vocab = z.shape[-1]
    safe, ignored, bad = _row_status(targets, vocab, ignore_index)
    _, lse, mean_z = _softmax_stats(z)
    zt = np.take_along_axis(z, safe[..., None], axis=-1)
    logp = (zt - lse)[..., 0]
    ent = (lse - mean_z)[..., 0]
    logp = np.where(ignored, 0, np.where(bad, np.nan, logp)).astype(dt)
    ent = np.where(ignored, 0, np.where(bad, np.nan, ent)).astype(dt)
    return logp, ent


def token_logprobs_vjp(
    logits, targets, g_logp, g_ent=None, *, temperature=1.0, ignore_index=None, dt=F64
):
    """Cotangent of the logits for cotangents ``g_logp`` (and ``g_ent``) of (logp, entropy)."""
    temp = dt(temperature)
    z = np.asarray(f64(logits), dtype=dt) / temp
    vocab = z.shape[-1]
    safe, ignored, bad = _row_status(targets, vocab, ignore_index)
    p, _, mean_z = _softmax_stats(z)
    onehot = np.zeros_like(z)
    np.put_along_axis(onehot, safe[..., None], 1, axis=-1)
    keep = (~ignored & ~bad)[..., None]
    g = np.asarray(g_logp, dtype=dt)[..., None]
    dz = g * (onehot - p)
    if g_ent is not None:
        ge = np.asarray(g_ent, dtype=dt)[..., None]
        dz = dz + ge * (-p * (z - mean_z))
    return np.where(keep, dz / temp, 0).astype(dt)


def linear_logits(hidden, weight, bias=None, *, weight_layout="vd", dt=F64):
    """hidden[..., D] @ W^T (+ bias): W is [V, D] for "vd", [D, V] for "dv"."""
    h = np.asarray(f64(hidden), dtype=dt)
    w = np.asarray(f64(weight), dtype=dt)
    logits = h @ (w.T if weight_layout == "vd" else w)
    if bias is not None:
        logits = logits + np.asarray(f64(bias), dtype=dt)
    return logits


def linear_logprobs(
    hidden,
    weight,
    targets,
    bias=None,
    *,
    weight_layout="vd",
    temperature=1.0,
    ignore_index=None,
    dt=F64,
):
    logits = linear_logits(hidden, weight, bias, weight_layout=weight_layout, dt=dt)
    return token_logprobs(
        logits, targets, temperature=temperature, ignore_index=ignore_index, dt=dt
    )


def linear_logprobs_vjp(
    hidden,
    weight,
    targets,
    g_logp,
    g_ent=None,
    bias=None,
    *,
    weight_layout="vd",
    temperature=1.0,
    ignore_index=None,
    dt=F64,
):
    """``(d_hidden, d_weight, d_bias)``; d_bias is None when bias is None."""
    h = np.asarray(f64(hidden), dtype=dt)
    w = np.asarray(f64(weight), dtype=dt)
    logits = linear_logits(h, w, bias, weight_layout=weight_layout, dt=dt)
    dl = token_logprobs_vjp(
        logits, targets, g_logp, g_ent, temperature=temperature, ignore_index=ignore_index, dt=dt
    )
    d = h.shape[-1]
    h2 = h.reshape(-1, d)
    dl2 = dl.reshape(-1, dl.shape[-1])
    if weight_layout == "vd":  # logits = h W^T, W [V, D]
        dh = dl2 @ w
        dw = dl2.T @ h2
    else:  # logits = h W,   W [D, V]
        dh = dl2 @ w.T
        dw = h2.T @ dl2
    db = None if bias is None else dl2.sum(0)
    return dh.reshape(h.shape), dw, db


def _head_vjp(h, w, dl, weight_layout, with_bias):
    """(d_hidden, d_weight, d_bias) of logits = h W^T (+ b) for a logits cotangent ``dl``."""
    d = h.shape[-1]
    h2, dl2 = h.reshape(-1, d), dl.reshape(-1, dl.shape[-1])
    if weight_layout == "vd":
        dh, dw = dl2 @ w, dl2.T @ h2
    else:
        dh, dw = dl2 @ w.T, h2.T @ dl2
    return dh.reshape(h.shape), dw, (dl2.sum(0) if with_bias else None)


def linear_id_logprobs(
    hidden, weight, ids, bias=None, *, weight_layout="vd", temperature=1.0, dt=F64
):
    """K ids per position: ``(logp [..., K], entropy [...])``. logp = z[id] - logsumexp(z) at
    each id >= 0 (0 at ids < 0); the entropy of each position with an id >= 0 (0 elsewhere)."""
    z = linear_logits(hidden, weight, bias, weight_layout=weight_layout, dt=dt) / dt(temperature)
    ids = np.asarray(ids).astype(np.int64)
    valid = ids >= 0
    _, lse, mean_z = _softmax_stats(z)
    logp = np.take_along_axis(z, np.where(valid, ids, 0), axis=-1) - lse
    ent = (lse - mean_z)[..., 0]
    return (np.where(valid, logp, 0).astype(dt), np.where(valid.any(-1), ent, 0).astype(dt))


def linear_id_logprobs_vjp(
    hidden,
    weight,
    ids,
    g_logp,
    g_ent=None,
    bias=None,
    *,
    weight_layout="vd",
    temperature=1.0,
    dt=F64,
):
    """``(d_hidden, d_weight, d_bias)`` of :func:`linear_id_logprobs` for cotangents ``g_logp``
    [..., K] and ``g_ent`` [...]: dz = (sum_k g_k (onehot_k - p) - g_H p (z - sum p z)) / T over
    the valid ids (a repeated id adds its one-hot twice)."""
    h = np.asarray(f64(hidden), dtype=dt)
    w = np.asarray(f64(weight), dtype=dt)
    temp = dt(temperature)
    z = linear_logits(h, w, bias, weight_layout=weight_layout, dt=dt) / temp
    ids = np.asarray(ids).astype(np.int64)
    valid = ids >= 0
    p, _, mean_z = _softmax_stats(z)
    g = np.where(valid, np.asarray(g_logp, dt), 0)
    dz = -g.sum(-1, keepdims=True) * p
    flat_dz, flat_ids, flat_g = (
        dz.reshape(-1, z.shape[-1]),
        ids.reshape(-1, ids.shape[-1]),
        g.reshape(-1, ids.shape[-1]),
    )
    for r in range(flat_dz.shape[0]):
        for k in range(flat_ids.shape[1]):
            if flat_ids[r, k] >= 0:
                flat_dz[r, flat_ids[r, k]] += flat_g[r, k]
    dz = flat_dz.reshape(z.shape)
    if g_ent is not None:
        ge = np.where(valid.any(-1), np.asarray(g_ent, dt), 0)[..., None]
        dz = dz - ge * p * (z - mean_z)
    return _head_vjp(h, w, dz / temp, weight_layout, bias is not None)


def topk_distill_terms(student_logp, teacher_logp, ids, tail="drop", dt=F64):
    """Per position: ``(d, dd/dlogp_s [..., K])`` of the forward KL over the valid ids (>= 0),
    d = sum_k p_t (log p_t - log p_s) (+ tail "bucket": r_t (log r_t - log r_s),
    r = 1 - sum_k p; 0 where r_t <= 0)."""
    ls = np.asarray(f64(student_logp), dt)
    lt = np.asarray(f64(teacher_logp), dt)
    valid = np.asarray(ids) >= 0
    p_t = np.where(valid, np.exp(lt), 0)
    with np.errstate(invalid="ignore"):
        d = np.sum(np.where(p_t > 0, p_t * (lt - ls), 0), axis=-1)
    grad = -p_t
    if tail == "bucket":
        r_t = 1 - p_t.sum(-1)
        p_s = np.where(valid, np.exp(ls), 0)
        r_s = 1 - p_s.sum(-1)
        some = r_t > 0
        safe_t, safe_s = np.where(some, r_t, 1), np.where(some, r_s, 1)
        d = d + np.where(some, r_t * (np.log(safe_t) - np.log(safe_s)), 0)
        grad = grad + np.where(some, r_t / safe_s, 0)[..., None] * p_s
    return d.astype(dt), grad.astype(dt)


# ----------------------------------------------------------------------------- RL math


def kl_penalty(logp, ref_logp, estimator="k3", dt=F64):
    """d = ref_logp - logp; k1 = -d, abs = |d|, k2 = d^2/2, k3 = exp(dc) - dc - 1
    with dc = clip(d, -20, 20)."""
    d = np.asarray(f64(ref_logp), dt) - np.asarray(f64(logp), dt)
    if estimator == "k1":
        return -d
    if estimator == "abs":
        return np.abs(d)
    if estimator == "k2":
        return d * d / 2
    if estimator == "k3":
        dc = np.clip(d, -K3_CLIP, K3_CLIP)
        return np.exp(dc) - dc - 1
    raise ValueError(estimator)


def kl_penalty_grad(logp, ref_logp, estimator="k3", dt=F64):
    """d kl / d logp (ref_logp constant); ambiguous exactly at |d| = 20 (k3) and d = 0 (abs)."""
    d = np.asarray(f64(ref_logp), dt) - np.asarray(f64(logp), dt)
    if estimator == "k1":
        return np.ones_like(d)
    if estimator == "abs":
        return -np.sign(d)
    if estimator == "k2":
        return -d
    if estimator == "k3":
        inside = np.abs(d) < K3_CLIP
        return np.where(inside, -(np.exp(np.clip(d, -K3_CLIP, K3_CLIP)) - 1), 0)
    raise ValueError(estimator)


def aggregate_weights(mask, mode="token_mean", max_len=None, dt=F64):
    """w with aggregate(x, mask, mode) == sum(w * x) for every x."""
    m = np.asarray(f64(mask), dt)
    mode = AGG_ALIASES.get(mode, mode)
    b, t = m.shape
    if mode == "token_mean":
        return m / max(m.sum(), 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = m.sum(1, keepdims=True)
        valid = per_seq > 0
        n_valid = valid.sum()
        if n_valid == 0:
            return np.zeros_like(m)
        return np.where(valid, m / np.where(valid, per_seq, 1), 0) / n_valid
    if mode == "seq_mean_token_sum":
        return m / b
    if mode == "seq_mean_token_sum_norm":
        return m / (b * (t if max_len is None else max_len))
    raise ValueError(mode)


def aggregate(values, mask, mode="token_mean", max_len=None, dt=F64):
    """our loss aggregation; see :func:`aggregate_weights`."""
    x = np.asarray(f64(values), dt)
    w = aggregate_weights(mask, mode, max_len, dt)
    return np.sum(w * x, dtype=dt)


def masked_mean(x, mask, dt=F64):
    """sum(m x) / max(sum(m), 1)."""
    return aggregate(x, mask, "token_mean", dt=dt)


def kl_metric_scales(logp, old_logp, mask, ref_logp=None):
    """The scales assert_close takes for the approx_kl / kl metrics: their estimators cancel
    for small d, so the masked mean of exp|d| + |d| + 1 (d clipped to ±20)."""
    cond = lambda d: np.exp(np.abs(np.clip(d, -20, 20))) + np.abs(np.clip(d, -20, 20)) + 1
    scales = {"approx_kl": masked_mean(cond(f64(old_logp) - f64(logp)), mask)}
    if ref_logp is not None:
        scales["kl"] = masked_mean(cond(f64(ref_logp) - f64(logp)), mask)
    return scales


def _segments(b, group_size=None, group_boundaries=None):
    if group_size is not None:
        return np.repeat(np.arange(b // group_size), group_size)
    bounds = np.asarray(group_boundaries)
    seg = np.zeros(b, np.int64)
    for g, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        seg[s:e] = g
    return seg


def _groups_of_several(b, group_size=None, group_boundaries=None):
    """A boolean mask [b] per group of two or more members (a group of one gets 0)."""
    seg = _segments(b, group_size, group_boundaries)
    for g in np.unique(seg):
        if np.sum(seg == g) > 1:
            yield seg == g


def group_advantages(
    rewards,
    *,
    group_size=None,
    group_boundaries=None,
    normalize_std=True,
    std_ddof=0,
    eps=1e-6,
    dt=F64,
):
    """adv = r - mean_g (/ (std_g + eps)); a group of one gets 0."""
    r = np.asarray(f64(rewards), dt)
    adv = np.zeros_like(r)
    for idx in _groups_of_several(r.shape[0], group_size, group_boundaries):
        n = idx.sum()
        c = r[idx] - r[idx].mean()
        if normalize_std:
            std = np.sqrt(np.sum(c * c) / (n - std_ddof))
            c = c / (std + dt(eps))
        adv[idx] = c
    return adv


def group_advantages_vjp(
    rewards, g, *, group_size=None, group_boundaries=None, normalize_std=True, std_ddof=0, eps=1e-6
):
    """Cotangent of rewards (float64). Needs std_g > 0 in groups of two or more."""
    r = f64(rewards)
    g = f64(g)
    out = np.zeros_like(r)
    for idx in _groups_of_several(r.shape[0], group_size, group_boundaries):
        n = idx.sum()
        gi = g[idx]
        if not normalize_std:
            out[idx] = gi - gi.mean()
            continue
        c = r[idx] - r[idx].mean()
        s = np.sqrt(np.sum(c * c) / (n - std_ddof))
        den = s + eps
        # a_i = c_i / den; ds/dr_k = c_k / ((n - ddof) s)  (sum c = 0)
        out[idx] = (gi - gi.mean()) / den - np.sum(gi * c) / den**2 * c / ((n - std_ddof) * s)
    return out


# ----------------------------------------------------------------------------- PPO


def ppo_token_terms(
    logp,
    old_logp,
    advantages,
    *,
    mask=None,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    rollout_logp=None,
    tis_cap=None,
    ratio_level="token",
    policy_loss="ppo",
    tis_level="token",
    tis_mode="truncate",
    dt=F64,
):
    """Per-token surrogate pieces: dict with pg, dpg (d pg / d logp), r, clipped, dual, tis.

    docs/api.md "Policy-loss variants": ``ratio_level="sequence"``: r_bt = exp(l_b) with
    l_b = clip(sum_t m (logp - old) / max(sum_t m, 1), -20, 20), and d r_bt / d logp_bt =
    exp(l_b) (our stop-gradient form). ``policy_loss="cispo"``: pg = -A clip(r) logp with
    clip(r) constant, so d pg / d logp = -A clip(r); "clipped" = r outside the clip range.
    TIS log-weight: old - rollout per token, or clip(sum_t m (old - rollout), -20, 20) per
    sequence; weight min(exp(w), cap) ("truncate") or [exp(w) <= cap] ("mask"); pg and its
    derivative are multiplied by the weight. ``r`` is always the token-level ratio (for
    ratio_mean); ``r_used`` the one the surrogate uses.
    """
    lp = np.asarray(f64(logp), dt)
    old = np.asarray(f64(old_logp), dt)
    a = np.asarray(f64(advantages), dt)
    if a.ndim == 1 and lp.ndim == 2:
        a = a[:, None]
    a = np.broadcast_to(a, lp.shape)
    m = None if mask is None else np.asarray(f64(mask), dt)
    raw = lp - old
    lr = np.clip(raw, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    lr_inside = np.abs(raw) < LOG_RATIO_CLIP
    r_tok = np.exp(lr)
    if ratio_level == "sequence":
        count = np.maximum(m.sum(1, keepdims=True), 1)
        ell = np.clip((m * raw).sum(1, keepdims=True) / count, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
        r = np.broadcast_to(np.exp(ell), lp.shape)
        dr = r
    else:
        r, dr = r_tok, r_tok * lr_inside
    low, high = dt(1 - clip_low), dt(1 + clip_high)
    dual_taken = np.zeros(lp.shape, bool)
    if policy_loss == "cispo":
        w = np.clip(r, low, high)
        pg = -a * w * lp
        dpg = -a * w
        clip_taken = (r < low) | (r > high)
    else:
        unclipped = -a * r
        clipped_val = -a * np.clip(r, low, high)
        clip_taken = clipped_val > unclipped
        pg = np.maximum(unclipped, clipped_val)
        dpg = np.where(clip_taken, 0, -a * dr)
        if dual_clip is not None:
            cap = -a * dt(dual_clip)
            dual_taken = (a < 0) & (cap < pg)
            pg = np.where(dual_taken, cap, pg)
            dpg = np.where(dual_taken, 0, dpg)
    tis = None
    if rollout_logp is not None and tis_cap is not None:
        log_w = old - np.asarray(f64(rollout_logp), dt)
        if tis_level == "sequence":
            log_w = np.broadcast_to(np.clip((m * log_w).sum(1, keepdims=True), -20, 20), lp.shape)
        if tis_mode == "mask":
            tis = (np.exp(log_w) <= dt(tis_cap)).astype(dt)
        else:
            tis = np.minimum(np.exp(log_w), dt(tis_cap))
        pg = pg * tis
        dpg = dpg * tis
    return dict(pg=pg, dpg=dpg, r=r_tok, r_used=r, clipped=clip_taken, dual=dual_taken, tis=tis)


def ppo_loss(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    rollout_logp=None,
    tis_cap=None,
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy=None,
    entropy_coef=0.0,
    loss_agg_mode="token_mean",
    max_len=None,
    ratio_level="token",
    policy_loss="ppo",
    tis_level="token",
    tis_mode="truncate",
    dt=F64,
):
    """``(loss, metrics, d_logp, d_entropy, per_token)``; d_entropy is None without entropy."""
    t = ppo_token_terms(
        logp,
        old_logp,
        advantages,
        mask=mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        rollout_logp=rollout_logp,
        tis_cap=tis_cap,
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        tis_level=tis_level,
        tis_mode=tis_mode,
        dt=dt,
    )
    per_token = t["pg"].copy()
    d_tok = t["dpg"].copy()
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator, dt)
        per_token = per_token + dt(kl_coef) * kl
        d_tok = d_tok + dt(kl_coef) * kl_penalty_grad(logp, ref_logp, kl_estimator, dt)
    if entropy is not None:
        per_token = per_token - dt(entropy_coef) * np.asarray(f64(entropy), dt)
    w = aggregate_weights(mask, loss_agg_mode, max_len, dt)
    loss = aggregate(per_token, mask, loss_agg_mode, max_len, dt)
    d_logp = w * d_tok
    d_ent = None if entropy is None else -dt(entropy_coef) * w
    metrics = {
        "clip_fraction": masked_mean(t["clipped"], mask, dt),
        "dual_clip_fraction": masked_mean(t["dual"], mask, dt),
        "approx_kl": masked_mean(kl_penalty(logp, old_logp, "k3", dt), mask, dt),
        "ratio_mean": masked_mean(t["r"], mask, dt),
    }
    if kl is not None:
        metrics["kl"] = masked_mean(kl, mask, dt)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask, dt)
    if t["tis"] is not None:
        metrics["tis_weight_mean"] = masked_mean(t["tis"], mask, dt)
        if tis_mode == "mask":
            metrics["tis_mask_fraction"] = masked_mean(t["tis"] == 0, mask, dt)
    return loss, metrics, d_logp, d_ent, per_token


def policy_gradient_loss(
    logp, advantages, mask, *, loss_agg_mode="token_mean", max_len=None, dt=F64
):
    """``(loss, d_logp)`` of aggregate(-A logp)."""
    lp = np.asarray(f64(logp), dt)
    a = np.asarray(f64(advantages), dt)
    if a.ndim == 1 and lp.ndim == 2:
        a = a[:, None]
    a = np.broadcast_to(a, lp.shape)
    w = aggregate_weights(mask, loss_agg_mode, max_len, dt)
    return aggregate(-a * lp, mask, loss_agg_mode, max_len, dt), -a * w


# ----------------------------------------------------------------------------- fused ops


def ratio_kl(
    policy_logits,
    ref_logits,
    actions,
    old_logp,
    mask,
    *,
    kl_estimator="k3",
    temperature=1.0,
    dt=F64,
):
    """``(ratio, kl, vjp)``; masked positions give ratio 1, kl 0 and never read their action."""
    m = f64(mask) != 0
    acts = np.where(m, np.asarray(actions), 0)
    lp, _ = token_logprobs(policy_logits, acts, temperature=temperature, dt=dt)
    lr, _ = token_logprobs(ref_logits, acts, temperature=temperature, dt=dt)
    old = np.asarray(f64(old_logp), dt)
    ratio = np.where(m, np.exp(np.where(m, lp - old, 0)), 1)
    kl = np.where(m, kl_penalty(lp, lr, kl_estimator, dt), 0)

    def vjp(g_ratio, g_kl):
        dkl = kl_penalty_grad(lp, lr, kl_estimator, dt)
        g_lp = np.where(m, f64(g_ratio) * ratio + f64(g_kl) * dkl, 0)
        return token_logprobs_vjp(policy_logits, acts, g_lp, temperature=temperature, dt=dt)

    return ratio, kl, vjp


def _grpo_from_logp(
    lp,
    ref_lp,
    old_logp,
    rewards,
    mask,
    *,
    group_size,
    group_boundaries,
    advantages,
    clip_low,
    clip_high,
    dual_clip,
    beta,
    kl_estimator,
    loss_agg_mode,
    normalize_std,
    eps,
    dt,
    max_len=None,
    **variants,
):
    if advantages is None:
        adv = group_advantages(
            rewards,
            group_size=group_size,
            group_boundaries=group_boundaries,
            normalize_std=normalize_std,
            eps=eps,
            dt=dt,
        )
    else:
        adv = np.asarray(f64(advantages), dt)
    t = ppo_token_terms(
        lp,
        old_logp,
        adv,
        mask=mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        dt=dt,
        **variants,
    )
    if ref_lp is None:
        kl = np.zeros_like(lp)
        dkl = np.zeros_like(lp)
    else:
        kl = kl_penalty(lp, ref_lp, kl_estimator, dt)
        dkl = kl_penalty_grad(lp, ref_lp, kl_estimator, dt)
    w = aggregate_weights(mask, loss_agg_mode, max_len, dt)
    loss = aggregate(t["pg"] + dt(beta) * kl, mask, loss_agg_mode, max_len, dt)
    pl = aggregate(t["pg"], mask, loss_agg_mode, max_len, dt)
    kla = aggregate(kl, mask, loss_agg_mode, max_len, dt)

    def d_logp(g_loss, g_pl, g_kl):
        return w * ((g_loss + g_pl) * t["dpg"] + (g_loss * beta + g_kl) * dkl)

    scale = aggregate(np.abs(t["pg"]) + abs(beta) * np.abs(kl), mask, loss_agg_mode, max_len, dt)
    return (loss, pl, kla), d_logp, scale


def grpo_loss(
    policy_logits,
    ref_logits,
    actions,
    old_logp,
    rewards,
    mask,
    *,
    group_size=None,
    group_boundaries=None,
    advantages=None,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    beta=0.0,
    kl_estimator="k3",
    loss_agg_mode="token_mean",
    normalize_std=True,
    eps=1e-6,
    dt=F64,
    **variants,
):
    """``((loss, policy_loss, kl), vjp, scale)``; vjp(g_loss, g_pl, g_kl) -> d policy_logits.

    ``variants``: ratio_level, policy_loss, tis_level, tis_mode, rollout_logp, tis_cap."""
    lp, _ = token_logprobs(policy_logits, actions, dt=dt)
    ref_lp, _ = token_logprobs(ref_logits, actions, dt=dt)
    outs, d_logp, scale = _grpo_from_logp(
        lp,
        ref_lp,
        old_logp,
        rewards,
        mask,
        group_size=group_size,
        group_boundaries=group_boundaries,
        advantages=advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        beta=beta,
        kl_estimator=kl_estimator,
        loss_agg_mode=loss_agg_mode,
        normalize_std=normalize_std,
        eps=eps,
        dt=dt,
        **variants,
    )

    def vjp(g_loss, g_pl, g_kl):
        return token_logprobs_vjp(policy_logits, actions, d_logp(g_loss, g_pl, g_kl), dt=dt)

    return outs, vjp, scale


def linear_ppo_loss(
    hidden,
    weight,
    actions,
    old_logp,
    advantages,
    mask,
    *,
    bias=None,
    weight_layout="vd",
    temperature=1.0,
    entropy_coef=0.0,
    dt=F64,
    **ppo_kw,
):
    """``(loss, metrics, vjp, scale)``; vjp(g) -> (d_hidden, d_weight, d_bias)."""
    lp, ent = linear_logprobs(
        hidden, weight, actions, bias, weight_layout=weight_layout, temperature=temperature, dt=dt
    )
    use_ent = entropy_coef != 0
    loss, metrics, d_lp, d_ent, per_token = ppo_loss(
        lp,
        old_logp,
        advantages,
        mask,
        entropy=ent if use_ent else None,
        entropy_coef=entropy_coef,
        dt=dt,
        **ppo_kw,
    )

    def vjp(g):
        return linear_logprobs_vjp(
            hidden,
            weight,
            actions,
            g * d_lp,
            None if d_ent is None else g * d_ent,
            bias,
            weight_layout=weight_layout,
            temperature=temperature,
            dt=dt,
        )

    scale = aggregate(
        np.abs(per_token),
        mask,
        ppo_kw.get("loss_agg_mode", "token_mean"),
        ppo_kw.get("max_len"),
        dt,
    )
    return loss, metrics, vjp, scale


def linear_grpo_loss(
    hidden,
    weight,
    actions,
    old_logp,
    rewards,
    mask,
    *,
    bias=None,
    weight_layout="vd",
    ref_logp=None,
    group_size=None,
    group_boundaries=None,
    advantages=None,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    beta=0.0,
    kl_estimator="k3",
    loss_agg_mode="token_mean",
    normalize_std=True,
    eps=1e-6,
    dt=F64,
    **variants,
):
    """``((loss, policy_loss, kl), vjp, scale)``; vjp(g_loss, g_pl, g_kl) -> (dh, dw, db)."""
    lp, _ = linear_logprobs(hidden, weight, actions, bias, weight_layout=weight_layout, dt=dt)
    outs, d_logp, scale = _grpo_from_logp(
        lp,
        None if ref_logp is None else np.asarray(f64(ref_logp), dt),
        old_logp,
        rewards,
        mask,
        group_size=group_size,
        group_boundaries=group_boundaries,
        advantages=advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        beta=beta,
        kl_estimator=kl_estimator,
        loss_agg_mode=loss_agg_mode,
        normalize_std=normalize_std,
        eps=eps,
        dt=dt,
        **variants,
    )

    def vjp(g_loss, g_pl, g_kl):
        return linear_logprobs_vjp(
            hidden,
            weight,
            actions,
            d_logp(g_loss, g_pl, g_kl),
            None,
            bias,
            weight_layout=weight_layout,
            dt=dt,
        )

    return outs, vjp, scale


# ----------------------------------------------------------------------------- sampler-matched


def kept_set(z, *, top_k=None, top_p=None, min_p=None):
    """Which entries of each row of ``z`` [..., V] (already divided by the temperature) a
    sampler keeps, docs/api.md "Sampler-matched log-probs": min-p (``p >= min_p · max p``),
    then top-k (values at least the k-th largest of those), then top-p (a value is kept
    when the mass of the kept values strictly above it is below ``top_p`` of theirs)."""
    z = f64(z)
    keep = np.ones(z.shape, bool)
    for idx in np.ndindex(z.shape[:-1]):
        row, k = z[idx], np.ones(z.shape[-1], bool)
        m = row.max()
        if min_p:
            k &= np.exp(row - m) >= min_p
        if top_k and top_k < k.sum():
            k &= row >= np.sort(row[k])[::-1][top_k - 1]
        if top_p and top_p < 1:
            e = np.where(k, np.exp(row - m), 0.0)
            order = np.argsort(-row, kind="stable")
            above = np.empty_like(e)
            total = 0.0
            for j, v in enumerate(row[order]):  # mass strictly above each distinct value
                if j == 0 or v != row[order[j - 1]]:
                    level = total
                above[order[j]] = level
                total += e[order[j]]
            k &= above < top_p * e.sum()
        keep[idx] = k
    return keep


def sampler_logprobs(
    hidden,
    weight,
    targets,
    bias=None,
    *,
    weight_layout="vd",
    temperature=1.0,
    ignore_index=None,
    top_k=None,
    top_p=None,
    min_p=None,
    logits=None,
    dt=F64,
):
    """``(logp, entropy, kept)`` under the processed distribution ``q = softmax(z)`` on the
    kept set: logp = z[t] - logsumexp(z[kept]) (also for a target outside it), entropy of q,
    kept: the target is in the kept set. ``logits``: given directly instead of a head."""
    if logits is None:
        logits = linear_logits(hidden, weight, bias, weight_layout=weight_layout)
    z = np.asarray(f64(logits), dtype=dt) / dt(temperature)
    keep = kept_set(z, top_k=top_k, top_p=top_p, min_p=min_p)
    safe, ignored, bad = _row_status(targets, z.shape[-1], ignore_index)
    zk = np.where(keep, z, -np.inf)
    m = np.max(zk, axis=-1, keepdims=True)
    e = np.exp(zk - m)
    lse = m + np.log(e.sum(-1, keepdims=True))
    q = np.exp(zk - lse)
    ent = -np.sum(np.where(keep, q * (z - lse), 0.0), axis=-1)
    logp = (np.take_along_axis(z, safe[..., None], -1) - lse)[..., 0]
    inside = np.take_along_axis(keep, safe[..., None], -1)[..., 0] & ~ignored & ~bad
    logp = np.where(ignored, 0, np.where(bad, np.nan, logp)).astype(dt)
    ent = np.where(ignored, 0, np.where(bad, np.nan, ent)).astype(dt)
    return logp, ent, inside


def sampler_logprobs_vjp(
    hidden,
    weight,
    targets,
    g_logp,
    g_ent=None,
    bias=None,
    *,
    weight_layout="vd",
    temperature=1.0,
    ignore_index=None,
    top_k=None,
    top_p=None,
    min_p=None,
    logits=None,
    dt=F64,
):
    """Cotangents of :func:`sampler_logprobs` with the kept set held fixed: ``d logp / dz =
    onehot - q``, ``d H / dz = -q (log q + H)`` (q = 0 outside the kept set); ``(d_hidden,
    d_weight, d_bias)``, or the logits' cotangent when ``logits`` is given."""
    head = logits is None
    if head:
        h, w = np.asarray(f64(hidden), dtype=dt), np.asarray(f64(weight), dtype=dt)
        logits = linear_logits(h, w, bias, weight_layout=weight_layout, dt=dt)
    temp = dt(temperature)
    z = np.asarray(f64(logits), dtype=dt) / temp
    keep = kept_set(z, top_k=top_k, top_p=top_p, min_p=min_p)
    safe, ignored, bad = _row_status(targets, z.shape[-1], ignore_index)
    zk = np.where(keep, z, -np.inf)
    m = np.max(zk, axis=-1, keepdims=True)
    lse = m + np.log(np.exp(zk - m).sum(-1, keepdims=True))
    q = np.exp(zk - lse)
    logq = np.where(keep, z - lse, 0.0)
    ent = -np.sum(q * logq, axis=-1, keepdims=True)
    onehot = np.zeros_like(z)
    np.put_along_axis(onehot, safe[..., None], 1, axis=-1)
    dz = np.asarray(g_logp, dtype=dt)[..., None] * (onehot - q)
    if g_ent is not None:
        dz = dz - np.asarray(g_ent, dtype=dt)[..., None] * q * (logq + ent)
    dz = np.where((~ignored & ~bad)[..., None], dz / temp, 0).astype(dt)
    return _head_vjp(h, w, dz, weight_layout, bias is not None) if head else dz
