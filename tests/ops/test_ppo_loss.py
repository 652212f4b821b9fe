"""ppo_loss (every option, every metric) and policy_gradient_loss against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.conftest import (
    as_jnp,
    assert_close,
    assert_f32,
    assert_zero,
    call,
    cotangent,
    dtype_id,
    pallas_sample,
    ppo_token_inputs,
    random_mask,
)
from tests.support import oracle

DTYPES = [jnp.float32, jnp.bfloat16]
MODES = [
    "token_mean",
    "seq_mean_token_mean",
    "sequence_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
]
BASE_METRICS = {"clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean"}

# Option sets; "rollout"/"ref"/"entropy" = True means "pass that array".
CONFIGS = {
    "default": {},
    "asym_clip": dict(clip_low=0.1, clip_high=0.35),
    "zero_low_clip": dict(clip_low=0.0, clip_high=0.28),
    "dual_clip": dict(dual_clip=3.0),
    "tis": dict(rollout=True, tis_cap=1.5),
    "kl_k1": dict(ref=True, kl_coef=0.1, kl_estimator="k1"),
    "kl_abs": dict(ref=True, kl_coef=0.2, kl_estimator="abs"),
    "kl_k2": dict(ref=True, kl_coef=0.3, kl_estimator="k2"),
    "kl_k3": dict(ref=True, kl_coef=0.05),
    "ref_zero_coef": dict(ref=True),
    "entropy": dict(entropy=True, entropy_coef=0.01),
    "everything": dict(
        clip_low=0.15,
        clip_high=0.25,
        dual_clip=2.5,
        rollout=True,
        tis_cap=2.0,
        ref=True,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy=True,
        entropy_coef=0.02,
        max_len=13,
    ),
}


def make_batch(rng, b, t, dtype, *, adv_rank=2, spread=0.3, empty_rows=(1,)):
    """logp, old_logp near logp (ratios on both sides of the clip range), advantages, mask, ..."""
    lp64 = -np.abs(rng.standard_normal((b, t))) * 2 - 0.05
    # |logp - old_logp| >= 0.08 > 1 bf16 ulp (|logp| < 16): r != 1 after rounding, so no tie at
    # the kink of clip_low = 0
    sign = rng.choice([-1, 1], (b, t))
    old64 = lp64 + sign * (0.08 + spread * np.abs(rng.standard_normal((b, t))))
    return ppo_token_inputs(rng, lp64, old64, dtype, adv_rank=adv_rank, empty_rows=empty_rows)


def split_options(cfg, arrays):
    """Library kwargs (jax arrays) and oracle kwargs (float64) for a CONFIGS entry."""
    lib, orc = {}, {}
    for key, value in cfg.items():
        if key in ("rollout", "ref", "entropy"):
            name = {"rollout": "rollout_logp", "ref": "ref_logp", "entropy": "entropy"}[key]
            lib[name], orc[name] = arrays[name]
        else:
            lib[key] = orc[key] = value
    return lib, orc


def check_ppo(backend, rng, arrays, mask, dtype, lib_kw, orc_kw):
    """ppo_loss(**lib_kw) against oracle.ppo_loss(**orc_kw): the loss, the exact set of
    metrics and each value, d logp and d entropy for a random cotangent."""
    lp, lp64 = arrays["logp"]
    old, old64 = arrays["old_logp"]
    adv, adv64 = arrays["advantages"]
    m = jnp.asarray(mask)
    lib_kw = dict(lib_kw)
    ent = lib_kw.pop("entropy", None)

    def f(lp, ent):
        kw = dict(lib_kw) if ent is None else dict(lib_kw, entropy=ent)
        return jk.ppo_loss(lp, old, adv, m, backend=backend, **kw)

    (loss, metrics), vjp = jax.vjp(f, lp, ent)
    assert_f32(loss, *metrics.values())
    assert loss.shape == () and all(v.shape == () for v in metrics.values())

    want = oracle.ppo_loss(lp64, old64, adv64, mask, **orc_kw)
    want32 = oracle.ppo_loss(lp64, old64, adv64, mask, dt=np.float32, **orc_kw)
    w_loss, w_metrics, w_dlp, w_dent, per_token = want
    mode = orc_kw.get("loss_agg_mode", "token_mean")
    loss_scale = oracle.aggregate(np.abs(per_token), mask, mode, orc_kw.get("max_len"))
    assert_close(loss, w_loss, in_dtype=dtype, want32=want32[0], scale=loss_scale, name="loss")

    assert BASE_METRICS <= set(metrics), f"missing metrics: {BASE_METRICS - set(metrics)}"
    assert set(metrics) == set(w_metrics), f"metrics {set(metrics) ^ set(w_metrics)}"
    kl_scale = oracle.kl_metric_scales(lp64, old64, mask, orc_kw.get("ref_logp"))
    for key, w in w_metrics.items():
        assert_close(
            metrics[key],
            w,
            in_dtype=dtype,
            want32=want32[1][key],
            scale=kl_scale.get(key),
            name=f"metrics[{key}]",
        )

    g = cotangent(rng, ())
    d_lp, d_ent = vjp((g, jax.tree.map(jnp.zeros_like, metrics)))
    assert d_lp.dtype == lp.dtype
    gf = float(g)
    assert_close(d_lp, gf * w_dlp, in_dtype=dtype, want32=gf * want32[2], name="d_logp")
    if ent is not None:
        assert_close(d_ent, gf * w_dent, in_dtype=dtype, want32=gf * want32[3], name="d_entropy")
    return loss, metrics, d_lp


# pallas (interpret mode is slow) runs each option set once, float32 and bfloat16 in turn; the
# other dtype of each is pallas_slow.
PALLAS_OPTIONS = {(c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(CONFIGS)}


@pytest.mark.parametrize("config,dtype", pallas_sample(PALLAS_OPTIONS, list(CONFIGS), DTYPES))
@pytest.mark.op("ppo_loss")
def test_ppo_loss_options(backend, rng, config, dtype):
    arrays, mask = make_batch(rng, 4, 9, dtype)
    lib_kw, orc_kw = split_options(CONFIGS[config], arrays)
    check_ppo(backend, rng, arrays, mask, dtype, lib_kw, orc_kw)


# pallas (interpret mode is slow) runs every mode, both advantage ranks and max_len on the mode
# that reads it; the rest of the grid is pallas_slow.
PALLAS_AGG = {
    ("token_mean", None, 2),
    ("seq_mean_token_mean", 20, 1),
    ("sequence_mean", None, 1),
    ("seq_mean_token_sum", None, 2),
    ("seq_mean_token_sum_norm", 20, 1),
    ("seq_mean_token_sum_norm", None, 2),
}


@pytest.mark.parametrize(
    "mode,max_len,adv_rank", pallas_sample(PALLAS_AGG, MODES, (None, 20), (1, 2))
)
@pytest.mark.op("ppo_loss")
def test_ppo_loss_agg_modes(backend, rng, mode, max_len, adv_rank):
    arrays, mask = make_batch(rng, 5, 7, jnp.float32, adv_rank=adv_rank, empty_rows=(0, 3))
    cfg = dict(CONFIGS["everything"], loss_agg_mode=mode, max_len=max_len)
    lib_kw, orc_kw = split_options(cfg, arrays)
    check_ppo(backend, rng, arrays, mask, jnp.float32, lib_kw, orc_kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.op("ppo_loss")
def test_ppo_loss_all_masked(backend, rng, mode):
    """Nothing valid: loss 0, metrics 0, zero gradients."""
    arrays, _ = make_batch(rng, 3, 5, jnp.float32)
    mask = np.zeros((3, 5), np.float32)
    lib_kw, orc_kw = split_options(dict(CONFIGS["everything"], loss_agg_mode=mode), arrays)
    loss, metrics, d_lp = check_ppo(backend, rng, arrays, mask, jnp.float32, lib_kw, orc_kw)
    assert float(loss) == 0.0
    assert all(float(v) == 0.0 for v in metrics.values())
    assert_zero(d_lp)


@pytest.mark.op("ppo_loss")
def test_ppo_loss_extreme_log_ratio(backend, rng):
    """|logp - old_logp| > 20 is clipped: finite loss/metrics, zero gradient at those tokens."""
    arrays, mask = make_batch(rng, 2, 6, jnp.float32, empty_rows=())
    lp64 = np.asarray(arrays["logp"][1]).copy()
    old64 = lp64.copy() + 0.1
    old64[0, :3] = lp64[0, :3] - 25.0  # r = e^20 (clipped log-ratio)
    old64[1, :3] = lp64[1, :3] + 30.0  # r = e^-20
    adv64 = np.where(rng.random((2, 6)) < 0.5, -1.0, 1.0)
    arrays["old_logp"] = as_jnp(old64, jnp.float32)
    arrays["advantages"] = as_jnp(adv64, jnp.float32)
    for cfg in ({}, {"dual_clip": 3.0}, {"ref": True, "kl_coef": 0.1}):
        lib_kw, orc_kw = split_options(cfg, arrays)
        loss, metrics, d_lp = check_ppo(backend, rng, arrays, mask, jnp.float32, lib_kw, orc_kw)
        assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
        if not cfg.get("ref"):
            assert_zero(np.asarray(d_lp)[:, :3], "gradient where the log-ratio is clipped")


@pytest.mark.op("ppo_loss")
def test_ppo_loss_no_gradient_to_constants(backend, rng):
    """Gradients never flow to old_logp, rollout_logp, ref_logp or advantages."""
    arrays, mask = make_batch(rng, 3, 6, jnp.float32)
    lp = arrays["logp"][0]
    names = ("old_logp", "advantages", "rollout_logp", "ref_logp")
    consts = tuple(arrays[n][0] for n in names)

    def f(lp, old, adv, roll, ref):
        loss, _ = jk.ppo_loss(
            lp,
            old,
            adv,
            jnp.asarray(mask),
            rollout_logp=roll,
            tis_cap=2.0,
            ref_logp=ref,
            kl_coef=0.3,
            dual_clip=3.0,
            backend=backend,
        )
        return loss

    grads = jax.grad(f, argnums=(1, 2, 3, 4))(lp, *consts)
    for name, g in zip(names, grads):
        assert_zero(g, f"gradient to {name}")


@pytest.mark.op("ppo_loss")
def test_ppo_loss_bool_mask_and_grad_of_metrics_free(backend, rng):
    """A bool mask equals the float mask; the loss works under value_and_grad(has_aux=True)."""
    arrays, mask = make_batch(rng, 3, 6, jnp.float32)
    lp, old, adv = arrays["logp"][0], arrays["old_logp"][0], arrays["advantages"][0]
    f = lambda lp, m: jk.ppo_loss(lp, old, adv, m, backend=backend)
    (l1, m1), g1 = jax.value_and_grad(f, has_aux=True)(lp, jnp.asarray(mask))
    (l2, m2), g2 = jax.value_and_grad(f, has_aux=True)(lp, jnp.asarray(mask > 0))
    assert float(l1) == float(l2)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))
    assert set(m1) == set(m2)


# ----------------------------------------------------------------------------- policy gradient


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.op("policy_gradient_loss")
def test_policy_gradient_loss(backend, rng, mode, adv_rank, dtype):
    arrays, mask = make_batch(rng, 4, 7, dtype, adv_rank=adv_rank, empty_rows=(2,))
    lp, lp64 = arrays["logp"]
    adv, adv64 = arrays["advantages"]
    m = jnp.asarray(mask)
    max_len = 9 if mode == "seq_mean_token_sum_norm" else None
    loss, vjp = jax.vjp(
        lambda x: call(
            jk.policy_gradient_loss, backend, x, adv, m, loss_agg_mode=mode, max_len=max_len
        ),
        lp,
    )
    assert_f32(loss)
    w_loss, w_d = oracle.policy_gradient_loss(
        lp64, adv64, mask, loss_agg_mode=mode, max_len=max_len
    )
    w32 = oracle.policy_gradient_loss(
        lp64, adv64, mask, loss_agg_mode=mode, max_len=max_len, dt=np.float32
    )
    a2 = adv64 if adv_rank == 2 else adv64[:, None]
    scale = oracle.aggregate(np.abs(a2 * lp64), mask, mode, max_len)
    assert_close(loss, w_loss, in_dtype=dtype, want32=w32[0], scale=scale, name="loss")
    g = cotangent(rng, ())
    (d,) = vjp(g)
    assert_close(d, float(g) * w_d, in_dtype=dtype, want32=float(g) * w32[1], name="d_logp")


@pytest.mark.parametrize("kind", ["reinforce_baseline", "reward_weighted", "best_of_n"])
@pytest.mark.op("policy_gradient_loss")
def test_policy_gradient_variants(backend, rng, kind):
    """REINFORCE with a baseline, reward-weighted and best-of-N fine-tuning are all this loss."""
    b, t = 6, 5
    lp64 = -np.abs(rng.standard_normal((b, t)))
    reward = rng.standard_normal(b)
    adv = {
        "reinforce_baseline": reward - reward.mean(),
        "reward_weighted": np.exp(reward),
        "best_of_n": (reward == reward.max()).astype(np.float64),
    }[kind]
    mask = random_mask(rng, b, t, empty_rows=())
    lp = as_jnp(lp64, jnp.float32)[0]
    adv_j, mask_j = jnp.asarray(adv, jnp.float32), jnp.asarray(mask)
    loss, g = jax.value_and_grad(
        lambda x: call(jk.policy_gradient_loss, backend, x, adv_j, mask_j)
    )(lp)
    w_loss, w_d = oracle.policy_gradient_loss(lp64, adv, mask)
    assert_close(loss, w_loss, scale=oracle.aggregate(np.abs(adv[:, None] * lp64), mask))
    assert_close(g, w_d)
