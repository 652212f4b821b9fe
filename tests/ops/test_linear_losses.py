"""linear_ppo_loss and linear_grpo_loss against the float64 oracle (d_hidden, d_weight, d_bias)."""

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

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def make_head(rng, b, t, v, d, dtype, layout, with_bias):
    hidden, h64 = rand(rng, (b, t, d), dtype)
    weight, w64 = rand(rng, (v, d) if layout == "vd" else (d, v), dtype, scale=2.0 / np.sqrt(d))
    bias, b64 = rand(rng, (v,), dtype, scale=0.3) if with_bias else (None, None)
    acts = rng.integers(0, v, size=(b, t))
    mask = random_mask(rng, b, t, empty_rows=(1,) if b > 2 else ())
    lp_now, _ = oracle.linear_logprobs(h64, w64, acts, b64, weight_layout=layout)
    old64 = lp_now + 0.3 * rng.standard_normal((b, t))
    return dict(
        hidden=(hidden, h64),
        weight=(weight, w64),
        bias=(bias, b64),
        actions=(jnp.asarray(acts, jnp.int32), acts),
        mask=(jnp.asarray(mask), mask),
        old_logp=as_jnp(old64, jnp.float32),
        lp_now=lp_now,
    )


def _grads_check(grads, primals, want, want32, dtype):
    names = ("d_hidden", "d_weight", "d_bias")
    for name, got, p, w, w32 in zip(names, grads, primals, want, want32):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w, in_dtype=dtype, want32=w32, name=name)


def big(*values):
    """A large case (the vocabulary-chunked paths): pallas_slow, and slow on the reference
    (plain jnp on the whole vocabulary, the same code as at the small sizes)."""
    return pytest.param(*values, marks=[pytest.mark.pallas_slow, pytest.mark.slow_on("reference")])


# ----------------------------------------------------------------------------- linear_ppo_loss

PPO_OPTIONS = {
    "default": {},
    "entropy_temp": dict(entropy_coef=0.05, temperature=0.8),
    "kl_dual": dict(ref=True, kl_coef=0.1, kl_estimator="k2", dual_clip=3.0, clip_low=0.1),
    "tis_seqmean": dict(rollout=True, tis_cap=1.5, loss_agg_mode="seq_mean_token_mean"),
    "everything": dict(
        entropy_coef=0.02,
        temperature=1.3,
        ref=True,
        kl_coef=0.05,
        dual_clip=2.5,
        rollout=True,
        tis_cap=2.0,
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=9,
    ),
}


def _split_options(rng, x, options, **special):
    """(library kwargs, oracle kwargs) for ``options``: ``ref`` draws a ref_logp near the
    current log-probs; a key in ``special`` maps to ``(name, (jax value, float64 value))``."""
    b, t = x["actions"][1].shape
    lib_kw, orc_kw = {}, {}
    for key, value in options.items():
        if key == "ref":
            lib_kw["ref_logp"], orc_kw["ref_logp"] = as_jnp(
                x["lp_now"] + rng.choice([-1, 1], (b, t)) * (0.1 + 0.3 * rng.random((b, t))),
                jnp.float32,
            )
        elif key in special:
            name, (lib_kw[name], orc_kw[name]) = special[key](value)
        else:
            lib_kw[key] = orc_kw[key] = value
    return lib_kw, orc_kw


def _head_case(x):
    """The arrays of a case (jax, float64 pairs) and the primals of the head."""
    (h, h64), (w, w64), (bias, b64) = x["hidden"], x["weight"], x["bias"]
    primals = (h, w) if bias is None else (h, w, bias)
    return (h, h64), (w, w64), (bias, b64), x["actions"], x["mask"], x["old_logp"], primals


def check_linear_ppo(backend, rng, x, dtype, layout, options):
    (h, h64), (w, w64), (bias, b64), (actions, acts), (mask, m64), (old, old64), primals = (
        _head_case(x)
    )
    b, t = acts.shape
    adv, adv64 = as_jnp(rng.standard_normal(b), jnp.float32)
    lib_kw, orc_kw = _split_options(
        rng,
        x,
        options,
        rollout=lambda _: (
            "rollout_logp",
            as_jnp(old64 + 0.3 * rng.standard_normal((b, t)), jnp.float32),
        ),
    )

    def f(h, w, bb=None):
        return jk.linear_ppo_loss(
            h, w, actions, old, adv, mask, bias=bb, weight_layout=layout, backend=backend, **lib_kw
        )

    (loss, metrics), vjp = jax.vjp(f, *primals)
    assert_f32(loss, *metrics.values())
    w_loss, w_metrics, w_vjp, scale = oracle.linear_ppo_loss(
        h64, w64, acts, old64, adv64, m64, bias=b64, weight_layout=layout, **orc_kw
    )
    w32 = oracle.linear_ppo_loss(
        h64, w64, acts, old64, adv64, m64, bias=b64, weight_layout=layout, dt=np.float32, **orc_kw
    )
    z = oracle.linear_logits(h64, w64, b64, weight_layout=layout) / orc_kw.get("temperature", 1.0)
    zs = np.abs(z).max()
    assert_close(loss, w_loss, in_dtype=dtype, want32=w32[0], scale=scale * zs, name="loss")
    for key in ("clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean"):
        assert key in metrics, key
    for key in ("kl", "tis_weight_mean"):
        assert (key in metrics) == (key in w_metrics), f"metric {key!r} presence"
    if orc_kw.get("entropy_coef", 0) != 0:
        assert "entropy" in metrics, "entropy metric missing although entropy_coef != 0"
    # logp carries an absolute error O(eps * max|z|): metrics are checked at that scale.
    for key, wv in w_metrics.items():
        if key in metrics:
            assert_close(
                metrics[key],
                wv,
                in_dtype=dtype,
                want32=w32[1][key],
                scale=zs * (1.0 if key in ("approx_kl", "kl") else abs(wv)),
                name=f"metrics[{key}]",
            )
    g = float(cotangent(rng, ()))
    grads = vjp((jnp.float32(g), jax.tree.map(jnp.zeros_like, metrics)))
    _grads_check(grads, primals, w_vjp(g), w32[2](g), dtype)


DTYPE_LAYOUTS = [(jnp.float32, "vd"), (jnp.bfloat16, "dv")]


def pallas_cases(options, both, covered=()):
    """Each option set on both dtype-layouts; pallas (interpret mode is slow) runs each once,
    the dtype-layouts in turn, and ``both`` on both; the sets in ``covered`` (their options
    all in ``both``) on neither."""
    pallas = {(o, *DTYPE_LAYOUTS[i % 2]) for i, o in enumerate(options) if o not in covered}
    pallas |= {(both, *dl) for dl in DTYPE_LAYOUTS}
    return pallas_sample(pallas, list(options), DTYPE_LAYOUTS)


# pallas: entropy_temp's entropy_coef and temperature are in "everything" (both dtype-layouts)
@pytest.mark.parametrize(
    "options,dtype,layout", pallas_cases(PPO_OPTIONS, "everything", covered=("entropy_temp",))
)
def test_linear_ppo_loss(backend, rng, options, dtype, layout):
    x = make_head(rng, 4, 5, 37, 8, dtype, layout, with_bias=options != "default")
    check_linear_ppo(backend, rng, x, dtype, layout, PPO_OPTIONS[options])


@pytest.mark.parametrize(
    "b,t,v,d,layout",
    [
        (2, 3, 1000, 16, "dv"),
        (1, 1, 1, 4, "vd"),
        (3, 1, 7, 5, "dv"),
        big(1, 2, 32003, 8, "vd"),
        big(16, 128, 1000, 8, "dv"),
    ],
)
def test_linear_ppo_loss_shapes(backend, rng, b, t, v, d, layout):
    x = make_head(rng, b, t, v, d, jnp.float32, layout, with_bias=True)
    check_linear_ppo(backend, rng, x, jnp.float32, layout, PPO_OPTIONS["everything"])


def test_linear_ppo_loss_all_masked(backend, rng):
    x = make_head(rng, 2, 3, 9, 4, jnp.float32, "vd", with_bias=True)
    h, w, bb = x["hidden"][0], x["weight"][0], x["bias"][0]

    def f(h, w, bb):
        loss, _ = jk.linear_ppo_loss(
            h,
            w,
            x["actions"][0],
            x["old_logp"][0],
            jnp.ones(2),
            jnp.zeros((2, 3)),
            bias=bb,
            entropy_coef=0.1,
            backend=backend,
        )
        return loss

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, bb)
    assert float(loss) == 0.0
    for g in grads:
        assert_zero(g)


def test_linear_ppo_loss_matches_unfused(backend, rng):
    """linear_ppo_loss == ppo_loss(linear_logprobs(...)) on the same backend."""
    x = make_head(rng, 3, 4, 21, 6, jnp.float32, "vd", with_bias=True)
    h, w, bb = x["hidden"][0], x["weight"][0], x["bias"][0]
    actions, old, mask = x["actions"][0], x["old_logp"][0], x["mask"][0]
    adv = jnp.asarray(rng.standard_normal(3).astype(np.float32))
    fused, fm = jk.linear_ppo_loss(
        h, w, actions, old, adv, mask, bias=bb, entropy_coef=0.1, temperature=0.9, backend=backend
    )
    lp, ent = jk.linear_logprobs(
        h, w, actions, bb, temperature=0.9, return_entropy=True, backend=backend
    )
    unfused, um = jk.ppo_loss(lp, old, adv, mask, entropy=ent, entropy_coef=0.1, backend=backend)
    np.testing.assert_allclose(float(fused), float(unfused), rtol=1e-5, atol=1e-6)
    for key in um:
        np.testing.assert_allclose(float(fm[key]), float(um[key]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- linear_grpo_loss

GRPO_OPTIONS = {
    "default": dict(group_size=2),
    "ref_k3": dict(group_size=2, ref=True, beta=0.1),
    "bounds_single_k1_dual": dict(
        group_boundaries=[0, 1, 4], ref=True, beta=0.2, kl_estimator="k1", dual_clip=2.0
    ),
    "given_adv_seqmean": dict(
        advantages=True, ref=True, beta=0.05, loss_agg_mode="seq_mean_token_mean"
    ),
    "nostd_tokensum": dict(
        group_size=4, normalize_std=False, eps=1e-3, loss_agg_mode="seq_mean_token_sum"
    ),
}


def check_linear_grpo(backend, rng, x, dtype, layout, options):
    (h, h64), (w, w64), (bias, b64), (actions, acts), (mask, m64), (old, old64), primals = (
        _head_case(x)
    )
    b, t = acts.shape
    rewards, r64 = as_jnp(rng.standard_normal(b), jnp.float32)
    lib_kw, orc_kw = _split_options(
        rng,
        x,
        options,
        advantages=lambda _: ("advantages", as_jnp(rng.standard_normal(b), jnp.float32)),
        group_boundaries=lambda v: ("group_boundaries", (jnp.asarray(v), v)),
    )

    def f(h, w, bb=None):
        return jk.linear_grpo_loss(
            h,
            w,
            actions,
            old,
            rewards,
            mask,
            bias=bb,
            weight_layout=layout,
            backend=backend,
            **lib_kw,
        )

    outs, vjp = jax.vjp(f, *primals)
    assert len(outs) == 3
    assert_f32(*outs)
    w_outs, w_vjp, scale = oracle.linear_grpo_loss(
        h64, w64, acts, old64, r64, m64, bias=b64, weight_layout=layout, **orc_kw
    )
    w32_outs, w32_vjp, _ = oracle.linear_grpo_loss(
        h64, w64, acts, old64, r64, m64, bias=b64, weight_layout=layout, dt=np.float32, **orc_kw
    )
    zs = np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)).max()
    for name, got, wv, w32 in zip(("loss", "policy_loss", "kl"), outs, w_outs, w32_outs):
        assert_close(got, wv, in_dtype=dtype, want32=w32, scale=(scale + 1e-3) * zs, name=name)
    if "ref_logp" not in lib_kw:
        assert float(outs[2]) == 0.0, "kl must be 0 without ref_logp"
    gs = [float(cotangent(rng, ())) for _ in range(3)]
    grads = vjp(tuple(jnp.float32(g) for g in gs))
    _grads_check(grads, primals, w_vjp(*gs), w32_vjp(*gs), dtype)


@pytest.mark.parametrize(
    "options,dtype,layout", pallas_cases(GRPO_OPTIONS, "bounds_single_k1_dual")
)
def test_linear_grpo_loss(backend, rng, options, dtype, layout):
    x = make_head(rng, 4, 5, 37, 8, dtype, layout, with_bias=options != "default")
    check_linear_grpo(backend, rng, x, dtype, layout, GRPO_OPTIONS[options])


@pytest.mark.parametrize(
    "b,t,v,d",
    # pallas: V 1000 pallas_slow (test_linear_ppo_loss_shapes runs the head kernel at 2x3x1000)
    [
        pallas_slow(2, 3, 1000, 16),
        (2, 1, 1, 4),
        big(2, 1, 32003, 8),
        big(16, 128, 1000, 8),
    ],
)
def test_linear_grpo_loss_shapes(backend, rng, b, t, v, d):
    x = make_head(rng, b, t, v, d, jnp.float32, "vd", with_bias=True)
    check_linear_grpo(backend, rng, x, jnp.float32, "vd", dict(group_size=2, ref=True, beta=0.1))
