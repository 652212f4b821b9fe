"""ratio_kl and grpo_loss (from logits) against the float64 oracle."""

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
    cotangent,
    pallas_sample,
    pallas_slow,
    rand,
    random_mask,
)
from tests.support import oracle

MODES = [
    "token_mean",
    "seq_mean_token_mean",
    "sequence_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
]


def make_logits(rng, b, t, v, dtype, *, garbage_actions_where_masked=False):
    pol, p64 = rand(rng, (b, t, v), dtype, scale=2.0)
    ref, r64 = as_jnp(p64 + 0.7 * rng.standard_normal((b, t, v)), dtype)
    mask = random_mask(rng, b, t, empty_rows=(1,) if b > 1 else ())
    acts = rng.integers(0, v, size=(b, t))
    if garbage_actions_where_masked:
        junk = rng.choice([-7, -1, v, v + 100, 2**30], size=(b, t))
        acts = np.where(mask > 0, acts, junk)
    lp_now, _ = oracle.token_logprobs(p64, np.where(mask > 0, acts, 0))
    old, old64 = as_jnp(lp_now + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    return pol, p64, ref, r64, jnp.asarray(acts, jnp.int32), acts, old, old64, mask


# ----------------------------------------------------------------------------- ratio_kl

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
RATIO_CASES = [
    (3, 5, 7, "k3", 1.0, F32),
    (3, 5, 7, "k3", 1.0, BF16),
    (1, 1, 1, "k3", 1.0, F32),
    (1, 1, 1, "k3", 1.0, F16),
    (2, 4, 33, "k1", 0.8, F32),
    (2, 4, 33, "k1", 0.8, F16),
    (2, 3, 1000, "abs", 1.0, F32),
    (2, 3, 1000, "k2", 1.3, BF16),
]
# pallas: each shape and estimator once, the dtypes in turn (the other dtype pallas_slow)
RATIO_CASES = [pallas_slow(*c) if i in (0, 2, 5) else c for i, c in enumerate(RATIO_CASES)]


def big(*values):
    """A large case: pallas_slow, and slow on the reference (plain jnp on the whole
    vocabulary, the same code as at the small sizes)."""
    return pytest.param(*values, marks=[pytest.mark.pallas_slow, pytest.mark.slow_on("reference")])


# Large vocabularies / many rows (the vocabulary-chunked paths), float32 / bf16 only.
RATIO_BIG = [
    big(1, 2, 32003, "k3", 1.0, jnp.float32),
    big(1, 2, 32003, "k2", 1.0, jnp.bfloat16),
    big(16, 128, 1000, "k3", 0.9, jnp.float32),
]


@pytest.mark.parametrize("b,t,v,estimator,temperature,dtype", RATIO_CASES)
def test_ratio_kl(backend, rng, b, t, v, estimator, temperature, dtype):
    pol, p64, ref, r64, actions, acts, old, old64, mask = make_logits(
        rng, b, t, v, dtype, garbage_actions_where_masked=True
    )
    m = jnp.asarray(mask)

    def f(pl, rl):
        return jk.ratio_kl(
            pl,
            rl,
            actions,
            old,
            m,
            kl_estimator=estimator,
            temperature=temperature,
            backend=backend,
        )

    (ratio, kl), vjp = jax.vjp(f, pol, ref)
    assert_f32(ratio, kl)
    assert ratio.shape == (b, t) and kl.shape == (b, t)
    kw = dict(kl_estimator=estimator, temperature=temperature)
    w_ratio, w_kl, w_vjp = oracle.ratio_kl(p64, r64, acts, old64, mask, **kw)
    w32 = oracle.ratio_kl(p64, r64, acts, old64, mask, dt=np.float32, **kw)
    # logp_pi - old_logp and logp_pi - logp_ref are differences of O(max|z|) terms.
    zs = max(np.abs(p64).max(), np.abs(r64).max()) / temperature
    assert_close(ratio, w_ratio, in_dtype=dtype, want32=w32[0], scale=w_ratio * zs, name="ratio")
    kl_scale = np.exp(np.abs(np.clip(w_kl, -20, 20))) * zs if estimator == "k3" else zs
    assert_close(kl, w_kl, in_dtype=dtype, want32=w32[1], scale=kl_scale, name="kl")
    off = mask == 0
    assert np.all(np.asarray(ratio)[off] == 1.0) and np.all(np.asarray(kl)[off] == 0.0)

    g_r, g_k = cotangent(rng, (b, t)), cotangent(rng, (b, t))
    d_pol, d_ref = vjp((g_r, g_k))
    assert d_pol.dtype == pol.dtype
    assert_close(
        d_pol,
        w_vjp(np.asarray(g_r), np.asarray(g_k)),
        in_dtype=dtype,
        want32=w32[2](np.asarray(g_r), np.asarray(g_k)),
        name="d_policy_logits",
    )
    assert_zero(d_ref, "gradient to ref_logits")
    assert_zero(np.asarray(d_pol)[off], "gradient at masked tokens")


@pytest.mark.parametrize("b,t,v,estimator,temperature,dtype", RATIO_BIG)
def test_ratio_kl_big(backend, rng, b, t, v, estimator, temperature, dtype):
    test_ratio_kl(backend, rng, b, t, v, estimator, temperature, dtype)


def test_ratio_kl_no_gradient_to_old_logp(backend, rng):
    pol, _, ref, _, actions, _, old, _, mask = make_logits(rng, 2, 3, 5, jnp.float32)
    g = jax.grad(
        lambda o: jnp.sum(
            jnp.stack(jk.ratio_kl(pol, ref, actions, o, jnp.asarray(mask), backend=backend))
        )
    )(old)
    assert_zero(g, "gradient to old_logp")


# ----------------------------------------------------------------------------- grpo_loss

# (B, T, V, group kwargs)
GROUPINGS = {
    "size2": dict(group_size=2),
    "size1": dict(group_size=1),
    "bounds_single": dict(group_boundaries=[0, 3, 4, 6]),
    "given_adv": dict(advantages=True),
}
OPTION_SETS = {
    "default": {},
    "beta_k3": dict(beta=0.04),
    "beta_k1_dual": dict(beta=0.1, kl_estimator="k1", dual_clip=3.0, clip_low=0.1, clip_high=0.3),
    "beta_abs_nostd": dict(beta=0.2, kl_estimator="abs", normalize_std=False),
    "beta_k2_eps": dict(beta=0.05, kl_estimator="k2", eps=1e-2, loss_agg_mode="seq_mean_token_sum"),
}


def check_grpo(backend, rng, b, t, v, dtype, kw, okw):
    pol, p64, ref, r64, actions, acts, old, old64, mask = make_logits(rng, b, t, v, dtype)
    rewards = jnp.asarray(rng.standard_normal(b).astype(np.float32))
    r64_rew = np.asarray(rewards, np.float64)
    if kw.pop("advantages", None):
        adv = rng.standard_normal(b).astype(np.float32)
        kw["advantages"], okw["advantages"] = jnp.asarray(adv), adv.astype(np.float64)
    m = jnp.asarray(mask)

    def f(pl, rl, o, rw):
        return jk.grpo_loss(pl, rl, actions, o, rw, m, backend=backend, **kw)

    outs, vjp = jax.vjp(f, pol, ref, old, rewards)
    assert len(outs) == 3
    assert_f32(*outs)
    w_outs, w_vjp, scale = oracle.grpo_loss(p64, r64, acts, old64, r64_rew, mask, **okw)
    w32_outs, w32_vjp, _ = oracle.grpo_loss(
        p64, r64, acts, old64, r64_rew, mask, dt=np.float32, **okw
    )
    zs = max(np.abs(p64).max(), np.abs(r64).max())
    for name, got, w, w32 in zip(("loss", "policy_loss", "kl"), outs, w_outs, w32_outs):
        assert_close(got, w, in_dtype=dtype, want32=w32, scale=scale * zs, name=name)
    gs = [float(cotangent(rng, ())) for _ in range(3)]
    d_pol, d_ref, d_old, d_rew = vjp(tuple(jnp.float32(g) for g in gs))
    assert_close(d_pol, w_vjp(*gs), in_dtype=dtype, want32=w32_vjp(*gs), name="d_policy_logits")
    assert_zero(d_ref, "gradient to ref_logits")
    assert_zero(d_old, "gradient to old_logp")
    assert_zero(d_rew, "gradient to rewards")
    return outs


# pallas (interpret mode is slow) runs every grouping and every option set, each at least once,
# normalize_std=False and eps on rewards it normalises; the rest of the grid is pallas_slow.
PALLAS_OPTIONS = {
    ("size2", "default"),
    ("size1", "beta_k3"),
    ("given_adv", "beta_k1_dual"),
    ("bounds_single", "beta_abs_nostd"),
    ("size2", "beta_k2_eps"),
}


@pytest.mark.parametrize(
    "grouping,options", pallas_sample(PALLAS_OPTIONS, list(GROUPINGS), list(OPTION_SETS))
)
def test_grpo_loss_options(backend, rng, grouping, options):
    kw = dict(GROUPINGS[grouping], **OPTION_SETS[options])
    okw = dict(kw)
    if "group_boundaries" in kw:
        kw["group_boundaries"] = jnp.asarray(kw["group_boundaries"])
    check_grpo(backend, rng, 6, 4, 11, jnp.float32, kw, okw)


@pytest.mark.parametrize("mode", MODES)
def test_grpo_loss_agg_modes(backend, rng, mode):
    kw = dict(group_size=2, beta=0.1, loss_agg_mode=mode)
    check_grpo(backend, rng, 4, 5, 9, jnp.float32, dict(kw), dict(kw))


@pytest.mark.parametrize(
    "b,t,v,dtype",
    [
        (4, 3, 1000, jnp.float32),
        (4, 3, 1000, jnp.bfloat16),
        (4, 3, 1000, jnp.float16),
        (2, 1, 1, jnp.float32),
        big(2, 1, 32003, jnp.float32),
        big(16, 128, 1000, jnp.float32),
    ],
)
def test_grpo_loss_dtypes_and_vocab(backend, rng, b, t, v, dtype):
    kw = dict(group_size=2, beta=0.05)
    check_grpo(backend, rng, b, t, v, dtype, dict(kw), dict(kw))


def test_grpo_loss_all_masked(backend, rng):
    pol, _, ref, _, actions, _, old, _, _ = make_logits(rng, 4, 3, 6, jnp.float32)
    rewards = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    f = lambda p: jk.grpo_loss(
        p, ref, actions, old, rewards, jnp.zeros((4, 3)), group_size=2, beta=0.1, backend=backend
    )
    outs = f(pol)
    assert all(float(o) == 0.0 for o in outs)
    assert_zero(jax.grad(lambda p: f(p)[0])(pol))


def test_grpo_loss_matches_ppo_pieces(backend, rng):
    """grpo_loss == ppo_loss(token_logprobs(policy), ..., group_advantages) + beta * kl."""
    pol, _, ref, _, actions, _, old, _, mask = make_logits(rng, 4, 5, 13, jnp.float32)
    rewards = jnp.asarray(rng.standard_normal(4).astype(np.float32))
    m = jnp.asarray(mask)
    loss, pl, kl = jk.grpo_loss(
        pol, ref, actions, old, rewards, m, group_size=2, beta=0.1, backend=backend
    )
    lp = jk.token_logprobs(pol, actions, backend=backend)
    rlp = jk.token_logprobs(ref, actions, backend=backend)
    adv = jk.group_advantages(rewards, group_size=2)
    ppo, metrics = jk.ppo_loss(lp, old, adv, m, ref_logp=rlp, kl_coef=0.1, backend=backend)
    np.testing.assert_allclose(float(loss), float(ppo), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(kl), float(metrics["kl"]), rtol=2e-5, atol=1e-6)


def test_ratio_kl_and_grpo_extreme_logits_stay_finite(backend, rng):
    """Policy / reference logits of +-1e4: finite ratio, kl, losses and gradients."""
    b, t, v = 2, 3, 6
    pol = jnp.asarray(rng.choice([-1e4, 1e4, 0.0], size=(b, t, v)).astype(np.float32))
    ref = jnp.asarray(rng.choice([-1e4, 1e4, 0.0], size=(b, t, v)).astype(np.float32))
    actions = jnp.asarray(np.argmax(np.asarray(pol), -1), jnp.int32)  # logp_pi near 0
    old = jnp.full((b, t), -0.1, jnp.float32)
    mask = jnp.ones((b, t))
    (ratio, kl), vjp = jax.vjp(
        lambda p: jk.ratio_kl(p, ref, actions, old, mask, backend=backend), pol
    )
    (d,) = vjp((jnp.ones((b, t)), jnp.ones((b, t))))
    for name, x in (("ratio", ratio), ("kl", kl), ("d_policy_logits", d)):
        assert np.isfinite(np.asarray(x)).all(), f"{name} not finite"
    p64, r64 = np.asarray(pol, np.float64), np.asarray(ref, np.float64)
    w_ratio, w_kl, _ = oracle.ratio_kl(
        p64, r64, np.asarray(actions), np.asarray(old, np.float64), np.ones((b, t))
    )
    assert_close(ratio, w_ratio, scale=1e4 * np.abs(w_ratio).max(), name="ratio")
    rewards = jnp.arange(b, dtype=jnp.float32)
    loss, g = jax.value_and_grad(
        lambda p: jk.grpo_loss(
            p, ref, actions, old, rewards, mask, group_size=2, beta=0.1, backend=backend
        )[0]
    )(pol)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()
