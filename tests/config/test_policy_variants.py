"""Policy-loss variants (docs/api.md "Policy-loss variants") against the float64 oracle.

``ratio_level`` (token / sequence = GSPO), ``policy_loss`` (ppo / cispo), ``tis_level``
(token / sequence) and ``tis_mode`` (truncate / mask) on ppo_loss: the full cross-product
with the four aggregations, advantages [B] and [B, T], with and without fully masked
sequences, on reference (chunked runs the same function, ppo_math.ppo_loss: conftest's ``op``
marker skips it unless JAXRL_TEST_SLOW=1); a covering subset on pallas (interpret mode; the
rest of the grid carries ``pallas_slow``). Values, every metric and the gradient (docs/api.md's
stop-gradient semantics) each time. Then grpo_loss, linear_ppo_loss and linear_grpo_loss
with the options through their fused paths, and every bad combination's ValueError.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.conftest import (
    as_jnp,
    assert_bitwise,
    assert_close,
    assert_f32,
    assert_zero,
    cotangent,
    dtype_id,
    ppo_token_inputs,
    random_mask,
)
from tests.ops import test_ppo_loss
from tests.support import oracle

RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("ppo", "cispo")
TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask")
VARIANTS = list(itertools.product(RATIO_LEVELS, POLICY_LOSSES, TIS_LEVELS, TIS_MODES))
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def variant_kw(variant):
    return dict(zip(("ratio_level", "policy_loss", "tis_level", "tis_mode"), variant))


def variant_id(variant):
    return "-".join(variant)


# ----------------------------------------------------------------------------- inputs


def make_batch(rng, b, t, dtype=jnp.float32, *, adv_rank=2, empty_rows=(1,), shift=0.35):
    """Per-token inputs whose token ratios, sequence ratios exp(l_b) and TIS weights (token
    and sequence) fall on both sides of the clip range / the cap.

    Each sequence's log-ratio is offset by +-(0.05 .. 0.05 + shift), so l_b (a mean over the
    sequence) is spread too; tokens add +-(0.08 + 0.3|N|) on top.
    """
    lp64 = -np.abs(rng.standard_normal((b, t))) * 2 - 0.05
    seq_shift = rng.choice([-1, 1], (b, 1)) * (0.05 + shift * rng.random((b, 1)))
    noise = rng.choice([-1, 1], (b, t)) * (0.08 + 0.3 * np.abs(rng.standard_normal((b, t))))
    old64 = lp64 - seq_shift - noise
    return ppo_token_inputs(rng, lp64, old64, dtype, adv_rank=adv_rank, empty_rows=empty_rows)


def check_ppo(
    backend, rng, arrays, mask, dtype, options, *, use=("rollout_logp", "ref_logp", "entropy")
):
    """``test_ppo_loss.check_ppo`` on ppo_loss(**options, the arrays named in ``use``)."""
    lib = dict(options, **{k: arrays[k][0] for k in use})
    orc = dict(options, **{k: arrays[k][1] for k in use})
    return test_ppo_loss.check_ppo(backend, rng, arrays, mask, dtype, lib, orc)


# ----------------------------------------------------------------------------- ppo_loss grid

# A covering subset for pallas (interpret mode is slow): every option value, every
# aggregation, both advantage ranks and fully masked sequences each appear at least twice.
PALLAS_GRID = {
    (("token", "ppo", "token", "truncate"), "token_mean", 2, False),
    (("sequence", "ppo", "token", "truncate"), "seq_mean_token_mean", 1, True),
    (("sequence", "cispo", "sequence", "mask"), "seq_mean_token_sum", 2, True),
    (("token", "cispo", "sequence", "truncate"), "seq_mean_token_sum_norm", 1, False),
    (("sequence", "ppo", "sequence", "mask"), "token_mean", 1, True),
    (("token", "cispo", "token", "mask"), "seq_mean_token_mean", 2, False),
    (("sequence", "cispo", "token", "truncate"), "seq_mean_token_sum_norm", 2, True),
    (("token", "ppo", "sequence", "mask"), "seq_mean_token_sum", 1, False),
}


def _grid():
    """Every combination; pallas runs PALLAS_GRID. The reference (chunked runs its function)
    runs half: each variant × aggregation with two of the four advantage rank × masking
    pairs, in turn, so that each pair meets every variant and every aggregation; the other
    half slow on it."""
    for (i, variant), (j, mode), adv_rank, empty in itertools.product(
        enumerate(VARIANTS), enumerate(MODES), (1, 2), (False, True)
    ):
        case = (variant, mode, adv_rank, empty)
        cid = f"{variant_id(variant)}-{mode}-adv{adv_rank}-{'empty' if empty else 'dense'}"
        marks = [] if case in PALLAS_GRID else [pytest.mark.pallas_slow]
        if (i + j + adv_rank + empty) % 2:
            marks.append(pytest.mark.slow_on("reference"))
        yield pytest.param(*case, id=cid, marks=marks)


@pytest.mark.parametrize("variant,mode,adv_rank,empty", list(_grid()))
@pytest.mark.op("ppo_loss")
def test_ppo_variant_grid(backend, rng, variant, mode, adv_rank, empty):
    """Every combination: loss, every metric, d logp, d entropy (with TIS, KL and entropy)."""
    arrays, mask = make_batch(rng, 5, 9, adv_rank=adv_rank, empty_rows=(1, 3) if empty else ())
    options = dict(
        variant_kw(variant),
        tis_cap=1.5,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode=mode,
        max_len=11 if mode.endswith("norm") else None,
    )
    check_ppo(backend, rng, arrays, mask, jnp.float32, options)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(
            v,
            id=variant_id(v),
            marks=()
            if v
            in (("sequence", "cispo", "sequence", "mask"), ("token", "ppo", "token", "truncate"))
            else pytest.mark.pallas_slow,
        )
        for v in VARIANTS
    ],
)
@pytest.mark.op("ppo_loss")
def test_ppo_variant_dtypes_no_extras(backend, rng, variant, dtype):
    """The policy term alone (TIS on, no KL / entropy), float32 and bfloat16 inputs."""
    arrays, mask = make_batch(rng, 4, 7, dtype, empty_rows=(2,))
    options = dict(variant_kw(variant), tis_cap=1.5)
    check_ppo(backend, rng, arrays, mask, dtype, options, use=("rollout_logp",))


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.op("ppo_loss")
def test_variants_without_rollout(backend, rng, ratio_level, policy_loss):
    """No rollout correction: no tis metrics; dual clip (ppo) or asymmetric clip (both)."""
    arrays, mask = make_batch(rng, 6, 8, shift=1.2)  # l_b up to +-1.25: dual clip is reached
    options = dict(
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        clip_low=0.1,
        clip_high=0.28,
        loss_agg_mode="seq_mean_token_mean",
    )
    if policy_loss == "ppo":
        options["dual_clip"] = 2.0
    _, metrics, _ = check_ppo(backend, rng, arrays, mask, jnp.float32, options, use=())
    assert "tis_weight_mean" not in metrics and "tis_mask_fraction" not in metrics


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(
            v,
            id=variant_id(v),
            marks=()
            if v
            in (("sequence", "ppo", "sequence", "mask"), ("token", "cispo", "token", "truncate"))
            else pytest.mark.pallas_slow,
        )
        for v in VARIANTS
    ],
)
@pytest.mark.op("ppo_loss")
def test_ppo_variant_all_masked(backend, rng, variant):
    """Nothing valid: loss 0, every metric 0, zero gradients."""
    arrays, _ = make_batch(rng, 3, 5)
    mask = np.zeros((3, 5), np.float32)
    options = dict(
        variant_kw(variant),
        tis_cap=1.5,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode="seq_mean_token_mean",
    )
    loss, metrics, d_lp = check_ppo(backend, rng, arrays, mask, jnp.float32, options)
    assert float(loss) == 0.0
    assert all(float(v) == 0.0 for v in metrics.values())
    assert_zero(d_lp)


# ----------------------------------------------------------------------------- the kernels' math


@pytest.mark.parametrize("adv_rank", [1, 2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_one_pass_forward_math(rng, variant, mode, adv_rank):
    """The pallas forward's math in plain jnp, every combination: per-sequence sums of
    ``ppo_math.forward_summands`` -> ``sums_to_token_terms`` -> ``loss_and_metrics`` equals
    the oracle (this is what the kernel computes tile by tile; pallas itself runs a subset
    in interpret mode). Dual clip on for ppo so its bound is reached by sequence ratios."""
    from jaxrl_kernels.formulas import aggregation_math, ppo_math

    arrays, mask = make_batch(rng, 6, 9, adv_rank=adv_rank, empty_rows=(2,), shift=1.2)
    kw = dict(
        variant_kw(variant),
        tis_cap=1.5,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode=mode,
        max_len=11 if mode.endswith("norm") else None,
    )
    if variant[1] == "ppo":
        kw["dual_clip"] = 2.0
    get = lambda k: arrays[k][0]
    adv = get("advantages")
    x = ppo_math.PPOInputs(
        get("logp"),
        get("old_logp"),
        jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, mask.shape),
        jnp.asarray(mask),
        get("rollout_logp"),
        get("ref_logp"),
        get("entropy"),
    )
    cfg = ppo_math.PPOConfig(**kw)
    sums = aggregation_math.masked_row_sums(ppo_math.forward_summands(x, cfg), x.mask)
    loss, metrics = ppo_math.loss_and_metrics(
        ppo_math.sums_to_token_terms(sums, cfg), cfg, mask.shape[1]
    )
    w_loss, w_metrics, _, _, per_token = oracle.ppo_loss(
        *(arrays[k][1] for k in ("logp", "old_logp", "advantages")),
        mask,
        **{k: arrays[k][1] for k in ("rollout_logp", "ref_logp", "entropy")},
        **kw,
    )
    assert_close(
        loss,
        w_loss,
        scale=oracle.aggregate(np.abs(per_token), mask, mode, kw["max_len"]),
        name="loss",
    )
    assert set(metrics) == set(w_metrics)
    for key, w in w_metrics.items():
        scale = oracle.kl_metric_scales(arrays["logp"][1], arrays["old_logp"][1], mask)["approx_kl"]
        assert_close(metrics[key], w, scale=scale if key == "approx_kl" else None, name=key)


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_weights_are_the_aggregate_derivative(rng, mode):
    """The backward's per-sequence coefficients: aggregate(x) = sum_b w_b sum_t m x."""
    from jaxrl_kernels.formulas import aggregation_math

    mask = random_mask(rng, 5, 7, empty_rows=(0, 3))
    counts = jnp.asarray(mask.sum(1), jnp.float32)
    max_len = 9 if mode.endswith("norm") else None
    got = aggregation_math.aggregation_weights(counts, mode, 7, max_len)
    want = oracle.aggregate_weights(mask, mode, max_len)
    assert_close(got[:, None] * mask, want)


# ----------------------------------------------------------------------------- docs/api.md semantics


@pytest.mark.op("ppo_loss")
def test_sequence_ratio_gradient_is_exp_of_sequence_log_ratio(backend, rng):
    """ratio_level="sequence", no clipping reached: loss = token_mean(-A_b exp(l_b)), and
    d loss / d logp_bt = -A_b exp(l_b) m_bt / sum(m) (no 1/|sequence| factor: docs/api.md's
    stop-gradient form r = sg(exp(l_b)) exp(logp - sg(logp)))."""
    b, t = 4, 6
    lp64 = -np.abs(rng.standard_normal((b, t))) - 0.1
    old64 = lp64 + 0.3 * rng.standard_normal((b, t))
    mask = random_mask(rng, b, t, empty_rows=(2,))
    adv64 = rng.standard_normal(b)
    lp, lp64 = as_jnp(lp64, jnp.float32)
    old, old64 = as_jnp(old64, jnp.float32)
    adv, adv64 = as_jnp(adv64, jnp.float32)
    (loss, metrics), g = jax.value_and_grad(
        lambda x: jk.ppo_loss(
            x,
            old,
            adv,
            jnp.asarray(mask),
            clip_low=0.99,
            clip_high=100.0,
            ratio_level="sequence",
            backend=backend,
        ),
        has_aux=True,
    )(lp)
    count = mask.sum(1)
    ell = (mask * (lp64 - old64)).sum(1) / np.maximum(count, 1)
    want_grad = -adv64[:, None] * np.exp(ell)[:, None] * mask / mask.sum()
    want_loss = np.sum(-adv64 * np.exp(ell) * count) / mask.sum()
    assert_close(loss, want_loss, scale=np.sum(np.abs(adv64) * np.exp(ell) * count) / mask.sum())
    assert_close(g, want_grad)
    assert float(metrics["clip_fraction"]) == 0.0
    # ratio_mean stays token level
    assert_close(metrics["ratio_mean"], oracle.masked_mean(np.exp(lp64 - old64), mask))


@pytest.mark.op("ppo_loss")
def test_cispo_clipped_tokens_keep_their_gradient(backend, rng):
    """CISPO: tokens with r outside the clip range have gradient -A clip(r) m / sum(m) != 0,
    where PPO's surrogate gives them none."""
    b, t = 3, 8
    lp64 = -np.abs(rng.standard_normal((b, t))) - 0.1
    old64 = lp64 - rng.choice([-1, 1], (b, t)) * (0.5 + rng.random((b, t)))  # |log r| >= 0.5
    mask = np.ones((b, t), np.float32)
    adv64 = np.abs(rng.standard_normal((b, t))) + 0.1  # A > 0: r > 1.2 clips in PPO
    lp, old, adv = (jnp.asarray(x, jnp.float32) for x in (lp64, old64, adv64))
    lp64, old64, adv64 = (np.asarray(x, np.float64) for x in (lp, old, adv))
    grads = {}
    for loss_name in POLICY_LOSSES:
        grads[loss_name] = np.asarray(
            jax.grad(
                lambda x: jk.ppo_loss(
                    x, old, adv, jnp.asarray(mask), policy_loss=loss_name, backend=backend
                )[0]
            )(lp)
        )
    r = np.exp(lp64 - old64)
    high = r > 1.2
    assert high.any()
    assert_zero(grads["ppo"][high], "PPO gradient where r > 1 + clip_high and A > 0")
    assert_close(grads["cispo"], -adv64 * np.clip(r, 0.8, 1.2) / mask.sum())


@pytest.mark.parametrize("policy_loss", POLICY_LOSSES)
@pytest.mark.op("ppo_loss")
def test_extreme_sequence_log_ratio_and_tis_weight(backend, rng, policy_loss):
    """l_b and the sequence TIS log-weight beyond +-20 are clipped: finite values, and the
    oracle's gradients (exp(20) * A on an unclipped branch)."""
    arrays, mask = make_batch(rng, 4, 6, empty_rows=())
    lp64 = arrays["logp"][1]
    old64 = lp64 + 0.1
    old64[0] = lp64[0] - 25.0  # l_0 = 25 -> 20
    old64[1] = lp64[1] + 30.0  # l_1 = -30 -> -20
    roll64 = old64 - 0.05
    roll64[2] = old64[2] - 8.0  # sequence log-weight 48 -> 20
    roll64[3] = old64[3] + 9.0  # -54 -> -20
    arrays["old_logp"] = as_jnp(old64, jnp.float32)
    arrays["rollout_logp"] = as_jnp(roll64, jnp.float32)
    arrays["advantages"] = as_jnp(np.where(rng.random((4, 6)) < 0.5, -1.0, 1.0), jnp.float32)
    # a cap above exp(20) tells the clipped log-weight (20) from the raw one (48)
    for tis_mode, tis_cap in (("truncate", 1e9), ("mask", 2.0), ("mask", 1e9)):
        options = dict(
            ratio_level="sequence",
            policy_loss=policy_loss,
            tis_level="sequence",
            tis_mode=tis_mode,
            tis_cap=tis_cap,
        )
        if policy_loss == "ppo":
            options["dual_clip"] = 3.0
        loss, metrics, d_lp = check_ppo(
            backend, rng, arrays, mask, jnp.float32, options, use=("rollout_logp",)
        )
        assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
        assert np.isfinite(np.asarray(d_lp)).all()


@pytest.mark.parametrize(
    "ratio_level,policy_loss", [("sequence", "ppo"), ("token", "cispo"), ("sequence", "cispo")]
)
@pytest.mark.op("ppo_loss")
def test_variants_no_gradient_to_constants(backend, rng, ratio_level, policy_loss):
    """old_logp (which l_b depends on), rollout_logp, ref_logp and advantages get none."""
    arrays, mask = make_batch(rng, 3, 6)
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
            ratio_level=ratio_level,
            policy_loss=policy_loss,
            tis_level="sequence",
            backend=backend,
        )
        return loss

    grads = jax.grad(f, argnums=(1, 2, 3, 4))(arrays["logp"][0], *consts)
    for name, g in zip(names, grads):
        assert_zero(g, f"gradient to {name}")


@pytest.mark.op("ppo_loss")
def test_tis_options_inert_without_rollout(backend, rng):
    """tis_level / tis_mode without rollout_logp + tis_cap change nothing (bitwise)."""
    arrays, mask = make_batch(rng, 3, 5)
    lp, old, adv = (arrays[k][0] for k in ("logp", "old_logp", "advantages"))
    m = jnp.asarray(mask)
    f = lambda **kw: jax.value_and_grad(
        lambda x: jk.ppo_loss(x, old, adv, m, ratio_level="sequence", backend=backend, **kw)[0]
    )(lp)
    assert_bitwise(f(), f(tis_level="sequence", tis_mode="mask"), "tis options")


@pytest.mark.op("ppo_loss")
def test_variants_under_jit(backend, rng):
    """Under jit (the kernels' traced path) the sequence variants equal the eager call."""
    arrays, mask = make_batch(rng, 4, 7, empty_rows=(0,))
    lp, old, adv, roll = (arrays[k][0] for k in ("logp", "old_logp", "advantages", "rollout_logp"))
    m = jnp.asarray(mask)
    kw = dict(
        ratio_level="sequence",
        policy_loss="cispo",
        tis_level="sequence",
        tis_mode="mask",
        rollout_logp=roll,
        tis_cap=1.5,
        backend=backend,
    )
    fn = jax.value_and_grad(lambda x: jk.ppo_loss(x, old, adv, m, **kw), has_aux=True)
    (l1, m1), g1 = fn(lp)
    (l2, m2), g2 = jax.jit(fn)(lp)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-6, atol=1e-9)
    assert set(m1) == set(m2) and "tis_mask_fraction" in m1


# ----------------------------------------------------------------------------- GRPO from logits


def make_logits(rng, b, t, v):
    pol = rng.standard_normal((b, t, v)) * 2.0
    ref = pol + 0.7 * rng.standard_normal((b, t, v))
    pol, p64 = as_jnp(pol, jnp.float32)
    ref, r64 = as_jnp(ref, jnp.float32)
    acts = rng.integers(0, v, size=(b, t))
    mask = random_mask(rng, b, t, empty_rows=(1,))
    lp_now, _ = oracle.token_logprobs(p64, acts)
    seq_shift = rng.choice([-1, 1], (b, 1)) * (0.05 + 0.35 * rng.random((b, 1)))
    old, old64 = as_jnp(lp_now - seq_shift + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    roll, roll64 = as_jnp(old64 + 0.4 * rng.standard_normal((b, t)), jnp.float32)
    return pol, p64, ref, r64, acts, old, old64, roll, roll64, mask


# The losses built on the same per-token math: every value of every option, twice, in
# different company (the full cross-product runs on ppo_loss above); the last is
# pallas_slow (interpret mode is slow).
FUSED_VARIANTS = [
    ("token", "ppo", "token", "truncate"),
    ("sequence", "cispo", "sequence", "mask"),
    ("sequence", "ppo", "token", "mask"),
    ("token", "cispo", "sequence", "truncate"),
]
GRPO_VARIANTS = [
    pytest.param(v, id=variant_id(v), marks=() if i < 3 else pytest.mark.pallas_slow)
    for i, v in enumerate(FUSED_VARIANTS)
]


@pytest.mark.parametrize("variant", GRPO_VARIANTS)
def test_grpo_loss_variants(backend, rng, variant):
    """grpo_loss with each variant and rollout correction, through the paired-logprobs path."""
    b, t, v = 6, 5, 11
    pol, p64, ref, r64, acts, old, old64, roll, roll64, mask = make_logits(rng, b, t, v)
    rewards, rw64 = as_jnp(rng.standard_normal(b), jnp.float32)
    options = dict(variant_kw(variant), group_size=3, beta=0.05, loss_agg_mode="token_mean")
    if variant[1] == "ppo":
        options["dual_clip"] = 3.0
    m = jnp.asarray(mask)

    def f(p):
        return jk.grpo_loss(
            p,
            ref,
            jnp.asarray(acts, jnp.int32),
            old,
            rewards,
            m,
            rollout_logp=roll,
            tis_cap=1.5,
            backend=backend,
            **options,
        )

    outs, vjp = jax.vjp(f, pol)
    assert_f32(*outs)
    w_outs, w_vjp, scale = oracle.grpo_loss(
        p64, r64, acts, old64, rw64, mask, rollout_logp=roll64, tis_cap=1.5, **options
    )
    zs = max(np.abs(p64).max(), np.abs(r64).max())
    for name, got, w in zip(("loss", "policy_loss", "kl"), outs, w_outs):
        assert_close(got, w, scale=scale * zs, name=name)
    gs = [float(cotangent(rng, ())) for _ in range(3)]
    (d_pol,) = vjp(tuple(jnp.float32(g) for g in gs))
    assert_close(d_pol, w_vjp(*gs), name="d_policy_logits")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(m, marks=() if m == "seq_mean_token_mean" else pytest.mark.pallas_slow)
        for m in MODES
    ],
)
def test_grpo_loss_sequence_variants_agg_modes(backend, rng, mode):
    """GSPO-style grpo_loss (given advantages [B], no reference) under each aggregation."""
    b, t, v = 4, 6, 9
    pol, p64, ref, r64, acts, old, old64, _, _, mask = make_logits(rng, b, t, v)
    adv, adv64 = as_jnp(rng.standard_normal(b), jnp.float32)
    options = dict(ratio_level="sequence", clip_low=0.05, clip_high=0.08, loss_agg_mode=mode)
    outs, vjp = jax.vjp(
        lambda p: jk.grpo_loss(
            p,
            ref,
            jnp.asarray(acts, jnp.int32),
            old,
            jnp.zeros(b),
            jnp.asarray(mask),
            advantages=adv,
            backend=backend,
            **options,
        ),
        pol,
    )
    w_outs, w_vjp, scale = oracle.grpo_loss(
        p64, r64, acts, old64, np.zeros(b), mask, advantages=adv64, **options
    )
    zs = max(np.abs(p64).max(), np.abs(r64).max())
    for name, got, w in zip(("loss", "policy_loss", "kl"), outs, w_outs):
        assert_close(got, w, scale=scale * zs, name=name)
    (d_pol,) = vjp((jnp.float32(1.0), jnp.float32(0.5), jnp.float32(-0.3)))
    assert_close(d_pol, w_vjp(1.0, 0.5, -0.3), name="d_policy_logits")


@pytest.mark.parametrize(
    "variant",
    [("sequence", "cispo", "sequence", "mask"), ("sequence", "ppo", "token", "truncate")],
    ids=variant_id,
)
def test_grpo_policy_loss_is_ppo_loss(backend, rng, variant):
    """grpo_loss's policy_loss == ppo_loss on token_logprobs with the same options (one math)."""
    b, t, v = 4, 5, 13
    pol, _, ref, _, acts, old, _, roll, _, mask = make_logits(rng, b, t, v)
    actions, m = jnp.asarray(acts, jnp.int32), jnp.asarray(mask)
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    kw = dict(variant_kw(variant), rollout_logp=roll, tis_cap=1.5)
    _, pg, _ = jk.grpo_loss(
        pol, ref, actions, old, jnp.zeros(b), m, advantages=adv, backend=backend, **kw
    )
    lp = jk.token_logprobs(pol, actions, backend=backend)
    ppo, _ = jk.ppo_loss(lp, old, adv, m, backend=backend, **kw)
    np.testing.assert_allclose(float(pg), float(ppo), rtol=2e-5, atol=1e-6)


# ----------------------------------------------------------------------------- from hidden states


def make_head(rng, b, t, v, d):
    hidden, h64 = as_jnp(rng.standard_normal((b, t, d)), jnp.float32)
    weight, w64 = as_jnp(rng.standard_normal((v, d)) * 2.0 / np.sqrt(d), jnp.float32)
    acts = rng.integers(0, v, size=(b, t))
    mask = random_mask(rng, b, t, empty_rows=(1,))
    lp_now, _ = oracle.linear_logprobs(h64, w64, acts)
    seq_shift = rng.choice([-1, 1], (b, 1)) * (0.05 + 0.35 * rng.random((b, 1)))
    old, old64 = as_jnp(lp_now - seq_shift + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    roll, roll64 = as_jnp(old64 + 0.4 * rng.standard_normal((b, t)), jnp.float32)
    return hidden, h64, weight, w64, acts, old, old64, roll, roll64, mask


LINEAR_VARIANTS = [
    pytest.param(v, id=variant_id(v), marks=() if i in (1, 2) else pytest.mark.pallas_slow)
    for i, v in enumerate(FUSED_VARIANTS)
]


@pytest.mark.parametrize("variant", LINEAR_VARIANTS)
def test_linear_ppo_loss_variants(backend, rng, variant):
    """linear_ppo_loss with each variant (+ TIS, entropy): loss, metrics, d hidden, d weight."""
    b, t, v, d = 4, 5, 23, 8
    hidden, h64, weight, w64, acts, old, old64, roll, roll64, mask = make_head(rng, b, t, v, d)
    adv, adv64 = as_jnp(rng.standard_normal(b), jnp.float32)
    options = dict(
        variant_kw(variant), tis_cap=1.5, entropy_coef=0.02, loss_agg_mode="seq_mean_token_sum"
    )

    def f(h, w):
        return jk.linear_ppo_loss(
            h,
            w,
            jnp.asarray(acts, jnp.int32),
            old,
            adv,
            jnp.asarray(mask),
            rollout_logp=roll,
            backend=backend,
            **options,
        )

    (loss, metrics), vjp = jax.vjp(f, hidden, weight)
    w_loss, w_metrics, w_vjp, scale = oracle.linear_ppo_loss(
        h64, w64, acts, old64, adv64, mask, rollout_logp=roll64, **options
    )
    zs = np.abs(oracle.linear_logits(h64, w64)).max()
    assert_close(loss, w_loss, scale=scale * zs, name="loss")
    assert set(metrics) == set(w_metrics)
    for key, wv in w_metrics.items():
        assert_close(
            metrics[key],
            wv,
            scale=zs * (1.0 if key == "approx_kl" else abs(wv)),
            name=f"metrics[{key}]",
        )
    g = float(cotangent(rng, ()))
    d_h, d_w = vjp((jnp.float32(g), jax.tree.map(jnp.zeros_like, metrics)))
    w_dh, w_dw, _ = w_vjp(g)
    assert_close(d_h, w_dh, name="d_hidden")
    assert_close(d_w, w_dw, name="d_weight")


@pytest.mark.parametrize("variant", LINEAR_VARIANTS)
def test_linear_grpo_loss_variants(backend, rng, variant):
    """linear_grpo_loss with each variant, rollout correction and a reference."""
    b, t, v, d = 4, 5, 23, 8
    hidden, h64, weight, w64, acts, old, old64, roll, roll64, mask = make_head(rng, b, t, v, d)
    rewards, rw64 = as_jnp(rng.standard_normal(b), jnp.float32)
    lp_now, _ = oracle.linear_logprobs(h64, w64, acts)
    ref, ref64 = as_jnp(lp_now + 0.2 * rng.standard_normal((b, t)), jnp.float32)
    options = dict(variant_kw(variant), group_size=2, beta=0.1, loss_agg_mode="token_mean")

    def f(h, w):
        return jk.linear_grpo_loss(
            h,
            w,
            jnp.asarray(acts, jnp.int32),
            old,
            rewards,
            jnp.asarray(mask),
            ref_logp=ref,
            rollout_logp=roll,
            tis_cap=1.5,
            backend=backend,
            **options,
        )

    outs, vjp = jax.vjp(f, hidden, weight)
    w_outs, w_vjp, scale = oracle.linear_grpo_loss(
        h64,
        w64,
        acts,
        old64,
        rw64,
        mask,
        ref_logp=ref64,
        rollout_logp=roll64,
        tis_cap=1.5,
        **options,
    )
    zs = np.abs(oracle.linear_logits(h64, w64)).max()
    for name, got, wv in zip(("loss", "policy_loss", "kl"), outs, w_outs):
        assert_close(got, wv, scale=(scale + 1e-3) * zs, name=name)
    gs = [float(cotangent(rng, ())) for _ in range(3)]
    d_h, d_w = vjp(tuple(jnp.float32(g) for g in gs))
    w_dh, w_dw, _ = w_vjp(*gs)
    assert_close(d_h, w_dh, name="d_hidden")
    assert_close(d_w, w_dw, name="d_weight")


# ----------------------------------------------------------------------------- bad input

B, T, V, D = 2, 3, 5, 4
OPS = ("ppo_loss", "grpo_loss", "linear_ppo_loss", "linear_grpo_loss")


def call_op(op, **kw):
    rng = np.random.default_rng(0)
    tok = jnp.asarray(-np.abs(rng.standard_normal((B, T))), jnp.float32)
    mask = jnp.ones((B, T))
    targets = jnp.zeros((B, T), jnp.int32)
    if op == "ppo_loss":
        return jk.ppo_loss(tok, tok, jnp.ones(B), mask, **kw)
    if op == "grpo_loss":
        logits = jnp.asarray(rng.standard_normal((B, T, V)), jnp.float32)
        return jk.grpo_loss(logits, logits, targets, tok, jnp.ones(B), mask, group_size=1, **kw)
    hidden = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
    if op == "linear_ppo_loss":
        return jk.linear_ppo_loss(hidden, weight, targets, tok, jnp.ones(B), mask, **kw)
    return jk.linear_grpo_loss(hidden, weight, targets, tok, jnp.ones(B), mask, group_size=1, **kw)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "name,valid",
    [
        ("ratio_level", RATIO_LEVELS),
        ("policy_loss", POLICY_LOSSES),
        ("tis_level", TIS_LEVELS),
        ("tis_mode", TIS_MODES),
    ],
)
def test_unknown_option_lists_valid_ones(op, name, valid):
    with pytest.raises(ValueError) as err:
        call_op(op, **{name: "bogus"})
    msg = str(err.value)
    assert msg.startswith(f"{name}:") and "'bogus'" in msg
    assert all(v in msg for v in valid), msg


@pytest.mark.parametrize("op", OPS)
def test_dual_clip_with_cispo_is_an_error(op):
    with pytest.raises(ValueError, match=r"^dual_clip:.*cispo"):
        call_op(op, policy_loss="cispo", dual_clip=3.0)
    call_op(op, policy_loss="cispo")  # without dual_clip: fine
    call_op(op, policy_loss="ppo", dual_clip=3.0)  # with ppo: fine


@pytest.mark.parametrize("op", ["grpo_loss", "linear_grpo_loss"])
def test_grpo_rollout_correction_arguments(op):
    tok = jnp.zeros((B, T))
    with pytest.raises(ValueError, match=r"^rollout_logp / tis_cap:"):
        call_op(op, rollout_logp=tok)
    with pytest.raises(ValueError, match=r"^rollout_logp / tis_cap:"):
        call_op(op, tis_cap=2.0)
    with pytest.raises(ValueError, match=r"^tis_cap: expected a value > 0"):
        call_op(op, rollout_logp=tok, tis_cap=0.0)
    with pytest.raises(ValueError, match=r"^rollout_logp: expected shape"):
        call_op(op, rollout_logp=jnp.zeros((B, T + 1)), tis_cap=2.0)
    with pytest.raises(TypeError, match=r"^rollout_logp:"):
        call_op(op, rollout_logp=jnp.zeros((B, T), jnp.int32), tis_cap=2.0)
