"""memory="fast" (the head's logits kept for the backward) and linear_policy_gradient_loss.

* linear_logprobs(memory="fast") against the float64 oracle: both layouts, bias, temperature,
  entropy, ignore_index, odd V, N = 1, float32 / bfloat16 / float16, random cotangents.
* Every linear loss, every option, lean against fast: the same values and gradients for random
  cotangents on every output (float32, 1e-5 of scale), whichever backend serves "lean".
* linear_policy_gradient_loss against the oracle on every backend and aggregation mode.
* Under jit, vmap, sharded inputs (Auto / Explicit axes: rows, vocabulary, both) and inside
  shard_map with vocab_axis: the unsharded result.
* The memory choice: budgets, explain, the compiled temp memory, bad arguments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels import dispatch
from jaxrl_kernels.dispatch import memory as memory_lib
from jaxrl_kernels.dispatch.contract import Problem
from tests.conftest import (
    assert_close,
    assert_f32,
    assert_zero,
    cotangent,
    pallas_sample,
    rand,
    random_mask,
)
from tests.support import oracle


def _round(x64, dtype):
    return np.asarray(
        jnp.asarray(np.asarray(x64, np.float32)).astype(dtype).astype(jnp.float32), np.float64
    )


def fast_formula(
    h64, w64, b64, targets, g, g_ent, *, layout, temperature, ignore, dtype, loss_cotangent=None
):
    """docs/api.md's fast-mode formula in float64 with its two roundings to the head's dtype:
    the kept logits, and the logits' gradient before the GEMMs (the target logit stays
    exact). Returns ((logp, entropy), (d_hidden, d_weight, d_bias | None)).
    ``loss_cotangent`` c: the fused losses' backward (``g`` then being the cotangents for
    c = 1): ``d_hidden`` scaled by c before its one rounding, ``d_weight`` of ``c·h`` rounded,
    ``d_bias`` the column sums of the unrounded logits' gradient."""
    z_exact = oracle.linear_logits(h64, w64, None, weight_layout=layout)
    z = _round(z_exact, dtype)
    if b64 is not None:
        z = z + b64
        z_exact = z_exact + b64
    z, z_exact = z / temperature, z_exact / temperature
    m = z.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
    valid = targets != ignore
    t = np.where(valid, targets, 0)
    z_t = np.take_along_axis(z_exact, t[..., None], -1)[..., 0]
    p = np.exp(z - lse[..., None])
    ent = lse - (p * z).sum(-1)
    logp = np.where(valid, z_t - lse, 0.0)
    ent = np.where(valid, ent, 0.0)
    g = np.where(valid, g, 0.0)
    g_ent = np.where(valid, g_ent, 0.0)
    onehot = np.eye(z.shape[-1])[t]
    logp_all = z - lse[..., None]
    dz = g[..., None] * (onehot - p) - g_ent[..., None] * p * (logp_all + ent[..., None])
    exact_dz = dz / temperature
    dz = _round(exact_dz, dtype)
    d = h64.shape[-1]
    dz2, h2 = dz.reshape(-1, dz.shape[-1]), h64.reshape(-1, d)
    dh = dz2 @ (w64 if layout == "vd" else w64.T)
    db = None if b64 is None else dz2.sum(0)
    dw = dz2.T @ h2 if layout == "vd" else h2.T @ dz2
    if loss_cotangent is not None:  # c scales d_hidden's float32 result and h; d_bias of the
        c = loss_cotangent  # unrounded dz
        dh = c * dh
        h2c = _round(c * h2, dtype)
        dw = dz2.T @ h2c if layout == "vd" else h2c.T @ dz2
        db = None if db is None else c * exact_dz.reshape(dz2.shape).sum(0)
    return (logp, ent), (dh.reshape(h64.shape), dw, db)


def head(rng, lead, vocab, d, dtype, layout, with_bias):
    hidden, h64 = rand(rng, lead + (d,), dtype)
    weight, w64 = rand(
        rng, (vocab, d) if layout == "vd" else (d, vocab), dtype, scale=2.0 / np.sqrt(d)
    )
    bias, b64 = rand(rng, (vocab,), dtype, scale=0.5) if with_bias else (None, None)
    targets = rng.integers(0, vocab, size=lead)
    return hidden, h64, weight, w64, bias, b64, targets


CASES = [  # lead, V, D, temperature, bias
    ((5,), 7, 16, 1.0, False),
    ((1,), 1, 8, 1.0, True),
    ((3, 4), 37, 8, 0.7, True),
    ((2, 3), 1000, 16, 1.5, True),
    ((67,), 301, 24, 1.0, False),
]


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fast_linear_logprobs_matches_float64(rng, dtype, layout, case):
    lead, vocab, d, temp, with_bias = CASES[case]
    hidden, h64, weight, w64, bias, b64, targets = head(
        rng, lead, vocab, d, dtype, layout, with_bias
    )
    ignore = -100
    targets = np.where(rng.random(lead) < 0.2, ignore, targets)
    t = jnp.asarray(targets, jnp.int32)
    primals = (hidden, weight) + ((bias,) if with_bias else ())

    def f(h, w, b=None):
        return jk.linear_logprobs(
            h,
            w,
            t,
            b,
            weight_layout=layout,
            temperature=temp,
            ignore_index=ignore,
            return_entropy=True,
            memory="fast",
        )

    (logp, ent), vjp = jax.vjp(jax.jit(f), *primals)
    assert_f32(logp, ent)
    kw = dict(weight_layout=layout, temperature=temp, ignore_index=ignore)
    want = oracle.linear_logprobs(h64, w64, targets, b64, **kw)
    zs = np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)).max() / temp
    g, g_ent = cotangent(rng, lead), cotangent(rng, lead)
    grads = vjp((g, g_ent))
    ignored = targets == ignore
    g64 = np.where(ignored, 0.0, np.asarray(g, np.float64))
    ge64 = np.where(ignored, 0.0, np.asarray(g_ent, np.float64))
    want_g = oracle.linear_logprobs_vjp(h64, w64, targets, g64, ge64, b64, **kw)
    if dtype == jnp.float32:
        assert_close(logp, want[0], scale=zs, name="logp")
        assert_close(ent, want[1], scale=zs, name="entropy")
        for name, got, w in zip(("d_hidden", "d_weight", "d_bias"), grads, want_g):
            assert_close(got, w, name=name)
        return
    values, grads_f = fast_formula(
        h64,
        w64,
        b64,
        targets,
        g64,
        ge64,
        layout=layout,
        temperature=temp,
        ignore=ignore,
        dtype=dtype,
    )
    assert_close(logp, want[0], in_dtype=dtype, want32=values[0], scale=zs, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=values[1], scale=zs, name="entropy")
    for name, got, p, w, wf in zip(
        ("d_hidden", "d_weight", "d_bias"), grads, primals, want_g, grads_f
    ):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w, in_dtype=dtype, want32=wf, name=name)


# -- lean and fast: the same losses and gradients ------------------------------------------

GRPO_OPTIONS = {
    "default": {},
    "ref_dual_k2": dict(ref=True, beta=0.05, kl_estimator="k2", dual_clip=3.0),
    "gspo": dict(
        ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, loss_agg_mode="seq_mean_token_mean"
    ),
    "cispo_tis_seq_mask": dict(
        policy_loss="cispo",
        rollout=True,
        tis_cap=1.5,
        tis_level="sequence",
        tis_mode="mask",
        temperature=0.8,
    ),
    "tis_token_sum_norm": dict(rollout=True, tis_cap=2.0, loss_agg_mode="seq_mean_token_sum_norm"),
    "seq_sum": dict(loss_agg_mode="seq_mean_token_sum", ref=True, beta=0.1),
}
PPO_OPTIONS = {
    "default": {},
    "entropy_kl_dual": dict(
        entropy_coef=0.05, ref=True, kl_coef=0.1, dual_clip=2.5, temperature=1.3
    ),
    "gspo_entropy": dict(
        ratio_level="sequence", entropy_coef=0.02, loss_agg_mode="seq_mean_token_mean"
    ),
    "cispo_tis": dict(policy_loss="cispo", rollout=True, tis_cap=2.0, tis_mode="mask"),
    "tis_seq_sum_norm": dict(
        rollout=True, tis_cap=1.5, tis_level="sequence", loss_agg_mode="seq_mean_token_sum_norm"
    ),
}


def loss_inputs(rng, layout, with_bias, b=4, t=5, vocab=37, d=8):
    hidden, _, weight, _, bias, _, acts = head(
        rng, (b, t), vocab, d, jnp.float32, layout, with_bias
    )
    mask = jnp.asarray(random_mask(rng, b, t, empty_rows=(1,)))
    old = jnp.asarray(-np.log(vocab) + 0.5 * rng.standard_normal((b, t)), jnp.float32)
    extra = dict(
        ref_logp=jnp.asarray(old + 0.2 * rng.standard_normal((b, t)), jnp.float32),
        rollout_logp=jnp.asarray(old + 0.3 * rng.standard_normal((b, t)), jnp.float32),
    )
    return hidden, weight, bias, jnp.asarray(acts, jnp.int32), old, mask, extra


def _options(options, extra):
    kw = {}
    for key, value in options.items():
        if key == "ref":
            kw["ref_logp"] = extra["ref_logp"]
        elif key == "rollout":
            kw["rollout_logp"] = extra["rollout_logp"]
        else:
            kw[key] = value
    return kw


def assert_same_vjp(f, primals, rng):
    """f(*primals, memory=...) lean vs fast: outputs and the vjp of random cotangents on every
    (floating) output agree to float32 rounding."""
    outs = {}
    for mode in ("lean", "fast"):
        out, vjp = jax.vjp(lambda *p: f(*p, memory=mode), *primals)
        outs[mode] = (out, vjp)
    lean, fast = outs["lean"][0], outs["fast"][0]
    for a, b in zip(jax.tree.leaves(lean), jax.tree.leaves(fast)):
        assert_close(b, np.asarray(a, np.float64), scale=1.0, name="output")
    cot = jax.tree.map(lambda x: cotangent(rng, np.shape(x)), lean)
    for got, want in zip(outs["fast"][1](cot), outs["lean"][1](cot)):
        if got is None:
            assert want is None
            continue
        assert_close(got, np.asarray(want, np.float64), name="gradient")


# pallas (interpret mode is slow) runs each option set in one layout, the layouts in turn.
PALLAS_GRPO = {(o, ("vd", "dv")[i % 2]) for i, o in enumerate(GRPO_OPTIONS)}


@pytest.mark.parametrize(
    "options,layout", pallas_sample(PALLAS_GRPO, list(GRPO_OPTIONS), ["vd", "dv"])
)
def test_linear_grpo_loss_fast_equals_lean(backend, rng, options, layout):
    hidden, weight, bias, acts, old, mask, extra = loss_inputs(rng, layout, options != "default")
    rewards = jnp.asarray(rng.integers(0, 2, 4), jnp.float32)
    kw = _options(GRPO_OPTIONS[options], extra)
    backend_kw = {} if backend is None else {}

    def f(h, w, b=None, *, memory):
        with jk.use_backend(backend):
            return jk.linear_grpo_loss(
                h,
                w,
                acts,
                old,
                rewards,
                mask,
                bias=b,
                group_size=2,
                weight_layout=layout,
                memory=memory,
                **kw,
                **backend_kw,
            )

    assert_same_vjp(f, (hidden, weight) + ((bias,) if bias is not None else ()), rng)


@pytest.mark.parametrize("options", list(PPO_OPTIONS))
def test_linear_ppo_loss_fast_equals_lean(backend, rng, options):
    layout = "dv" if options in ("default", "cispo_tis") else "vd"
    hidden, weight, bias, acts, old, mask, extra = loss_inputs(rng, layout, True)
    adv = cotangent(rng, (4,))
    kw = _options(PPO_OPTIONS[options], extra)

    def f(h, w, b, *, memory):
        with jk.use_backend(backend):
            return jk.linear_ppo_loss(
                h, w, acts, old, adv, mask, bias=b, weight_layout=layout, memory=memory, **kw
            )

    assert_same_vjp(f, (hidden, weight, bias), rng)


# -- linear_policy_gradient_loss --------------------------------------------------------------


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("memory", ["lean", "fast"])
def test_linear_policy_gradient_loss_matches_float64(backend, rng, mode, memory):
    if memory == "fast" and backend != "reference":
        pytest.skip("memory='fast' takes no backend: run once")
    b, t, vocab, d = 3, 4, 29, 8
    hidden, h64, weight, w64, bias, b64, acts = head(rng, (b, t), vocab, d, jnp.float32, "vd", True)
    mask64 = random_mask(rng, b, t, empty_rows=(2,))
    adv64 = rng.standard_normal(b)
    temp = 0.9
    kw = dict(bias=bias, temperature=temp, loss_agg_mode=mode, max_len=6)

    def f(h, w, bb):
        kw2 = dict(kw, bias=bb)
        if memory == "fast":
            return jk.linear_policy_gradient_loss(
                h,
                w,
                jnp.asarray(acts),
                jnp.asarray(adv64, jnp.float32),
                jnp.asarray(mask64),
                memory="fast",
                **kw2,
            )
        return jk.linear_policy_gradient_loss(
            h,
            w,
            jnp.asarray(acts),
            jnp.asarray(adv64, jnp.float32),
            jnp.asarray(mask64),
            backend=backend,
            **kw2,
        )

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(hidden, weight, bias)
    assert_f32(loss)
    lp, _ = oracle.linear_logprobs(h64, w64, acts, b64, temperature=temp)
    want, g_logp = oracle.policy_gradient_loss(lp, adv64, mask64, loss_agg_mode=mode, max_len=6)
    z = np.abs(oracle.linear_logits(h64, w64, b64)).max() / temp
    assert_close(loss, want, scale=z * np.abs(adv64).max(), name="loss")
    want_g = oracle.linear_logprobs_vjp(h64, w64, acts, g_logp, None, b64, temperature=temp)
    for name, got, w in zip(("d_hidden", "d_weight", "d_bias"), grads, want_g):
        assert_close(got, w, name=name)


def test_linear_policy_gradient_loss_sft_is_the_masked_nll(rng):
    """A = 1: plain NLL / SFT, token-mean over the response mask."""
    hidden, h64, weight, w64, _, _, acts = head(rng, (2, 5), 11, 4, jnp.float32, "dv", False)
    mask = jnp.asarray(random_mask(rng, 2, 5, empty_rows=()))
    loss = jk.linear_policy_gradient_loss(
        hidden, weight, jnp.asarray(acts), jnp.ones(2), mask, weight_layout="dv"
    )
    lp, _ = oracle.linear_logprobs(h64, w64, acts, weight_layout="dv")
    m = np.asarray(mask, np.float64)
    assert_close(loss, -(lp * m).sum() / m.sum(), scale=5.0, name="nll")


def test_linear_policy_gradient_loss_bad_input(rng):
    hidden, _, weight, _, _, _, acts = head(rng, (2, 3), 7, 4, jnp.float32, "vd", False)
    acts = jnp.asarray(acts)
    mask = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="actions"):
        jk.linear_policy_gradient_loss(hidden, weight, acts + 7, jnp.ones(2), mask)
    with pytest.raises(ValueError, match="advantages"):
        jk.linear_policy_gradient_loss(hidden, weight, acts, jnp.ones(3), mask)
    with pytest.raises(ValueError, match="hidden"):
        jk.linear_policy_gradient_loss(hidden[0], weight, acts[0], jnp.ones(2), mask)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        jk.linear_policy_gradient_loss(hidden, weight, acts, jnp.ones(2), mask, loss_agg_mode="sum")


# -- transformations and sharding -------------------------------------------------------------


def test_fast_under_vmap(rng):
    hidden, _, weight, _, bias, _, acts = head(rng, (3, 6), 41, 8, jnp.float32, "vd", True)
    t = jnp.asarray(acts, jnp.int32)

    def f(h, tt, w, b):
        return jk.linear_logprobs(h, w, tt, b, return_entropy=True, memory="fast")

    def loss(h, w, b):
        lp, ent = jax.vmap(f, in_axes=(0, 0, None, None))(h, t, w, b)
        return jnp.sum(lp * jnp.arange(6)) + jnp.sum(ent)

    def loss_loop(h, w, b):
        outs = [f(h[i], t[i], w, b) for i in range(3)]
        return sum(jnp.sum(lp * jnp.arange(6)) + jnp.sum(ent) for lp, ent in outs)

    got = jax.grad(loss, argnums=(0, 1, 2))(hidden, weight, bias)
    want = jax.jit(jax.grad(loss_loop, argnums=(0, 1, 2)))(
        hidden, weight, bias
    )  # the loop, one compile
    for a, b in zip(got, want):
        assert_close(a, np.asarray(b, np.float64), name="vmap gradient")


LAYOUTS = {
    "rows": (("data", None), None),
    "vocab": ((None, None), "model"),
    "both": (("data", None), "model"),
}


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fast_sharded_equals_unsharded(rng, kind, layout):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
    b, t, vocab, d = 4, 6, 512, 16
    hidden, _, weight, _, bias, _, acts = head(rng, (b, t), vocab, d, jnp.float32, "vd", True)
    acts = jnp.asarray(acts, jnp.int32)
    old = jnp.asarray(-6.0 + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    mask = jnp.asarray(random_mask(rng, b, t, empty_rows=(0,)))
    rewards = jnp.asarray(rng.integers(0, 2, b), jnp.float32)
    rows, vocab_axis = LAYOUTS[layout]

    def loss(h, w, bb, acts, old, mask):
        out = jk.linear_grpo_loss(
            h, w, acts, old, rewards, mask, bias=bb, group_size=2, memory="fast", dual_clip=3.0
        )
        return out[0] + 0.5 * out[1]

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want = fn(hidden, weight, bias, acts, old, mask)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (
        put(hidden, P(*rows, None)),
        put(weight, P(vocab_axis, None)),
        put(bias, P(vocab_axis)),
        put(acts, P(*rows)),
        put(old, P(*rows)),
        put(mask, P(*rows)),
    )
    got = fn(*args)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, np.asarray(b_, np.float64), scale=1.0, name="sharded")
    grads = got[1]
    for g, a in zip(grads, args[:3]):
        assert g.sharding.spec == a.sharding.spec or kind == "Auto", (g.sharding, a.sharding)


def test_fast_inside_shard_map_with_vocab_axis(rng):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    n, vocab, d = 8, 256, 8
    hidden, h64, weight, w64, bias, b64, targets = head(
        rng, (n,), vocab, d, jnp.float32, "vd", True
    )
    t = jnp.asarray(targets, jnp.int32)

    def local(h, w, b, t):
        return jk.linear_logprobs(
            h, w, t, b, return_entropy=True, vocab_axis="model", memory="fast"
        )

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P("data"), P("model"), P("model"), P("data")),
        out_specs=(P("data"), P("data")),
    )

    def loss(h, w, b):
        lp, ent = mapped(h, w, b, t)
        return jnp.sum(lp * jnp.arange(n)) + jnp.sum(ent)

    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    t = put(t, P("data"))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        put(hidden, P("data")), put(weight, P("model")), put(bias, P("model"))
    )
    t = jnp.asarray(targets, jnp.int32)

    def plain(h, w, b):
        lp, ent = jk.linear_logprobs(h, w, t, b, return_entropy=True, memory="fast")
        return jnp.sum(lp * jnp.arange(n)) + jnp.sum(ent)

    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(hidden, weight, bias)
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, np.asarray(b_, np.float64), scale=1.0, name="shard_map")


# -- the memory choice -------------------------------------------------------------------------


def test_memory_budget_and_explain(rng):
    hidden, _, weight, _, _, _, acts = head(rng, (4, 8), 100, 16, jnp.bfloat16, "vd", False)
    acts = jnp.asarray(acts)
    kept = 4 * 8 * 100 * 2  # bfloat16 logits
    args = (hidden, weight, acts)
    # the default, "auto", is lean where the device reports no memory size (CPU)
    assert "memory: lean (memory='auto': the device reports no memory size)" in jk.explain(
        "linear_logprobs", *args
    )
    text = jk.explain("linear_logprobs", *args, memory="fast")
    assert text.startswith(
        "linear_logprobs: memory fast (memory='fast'): the head's logits kept "
        "as bfloat16 [4, 8, 100]"
    ), text
    assert "3 per forward+backward" in text
    assert "7/8" not in text  # 32 rows: none skipped, no branch copies
    many = jnp.zeros((2, 512, 16), jnp.bfloat16), weight, jnp.zeros((2, 512), jnp.int32)
    assert "the peak holds up to about 7/8 of that again" in jk.explain(
        "linear_logprobs", *many, memory="fast"
    )
    assert "memory fast" in jk.explain("linear_logprobs", *args, memory=kept)
    assert "memory: lean (memory=" in jk.explain("linear_logprobs", *args, memory=kept - 1)
    old = jnp.zeros((4, 8))
    text = jk.explain(
        "linear_grpo_loss",
        hidden,
        weight,
        acts,
        old,
        jnp.ones(4),
        jnp.ones((4, 8)),
        group_size=2,
        memory="fast",
    )
    assert "\nlinear_grpo_loss: memory fast" in text, text
    with jk.use_backend("chunked"):
        text = jk.explain("linear_logprobs", *args, memory="fast")
    assert "the backend override 'chunked' applies to memory='lean' only" in text


@pytest.mark.parametrize("op", ["linear_logprobs", "linear_grpo_loss"])
def test_fast_mode_chooses_who_makes_the_kept_logits(rng, op, monkeypatch):
    """The kept logits are the ``kept_logits`` primitive's, chosen automatically (a backend
    override does not reach it): the reference's here; ffi's where it serves the call (its
    availability patched in, the call only traced) from ``KEPT_LOGITS_MIN_ROWS`` rows, the
    others declining."""
    from jaxrl_kernels.backends import ffi
    from jaxrl_kernels.backends.ffi import linear as ffi_linear

    def call(rows, dtype=jnp.bfloat16):
        hidden, _, weight, _, _, _, acts = head(rng, (4, rows), 96, 16, dtype, "vd", False)
        args = (hidden, weight, jnp.asarray(acts))
        if op == "linear_grpo_loss":
            args += (jnp.zeros((4, rows)), jnp.ones(4), jnp.ones((4, rows)))
        kw = dict(group_size=2) if op == "linear_grpo_loss" else {}
        return jk.explain(op, *args, memory="fast", **kw)

    many = ffi_linear.KEPT_LOGITS_MIN_ROWS // 4
    with jk.use_backend("chunked"):
        text = call(many)
    assert "\nkept_logits: reference (automatic)" in text, text
    assert "backend 'chunked' does not implement 'kept_logits'" in text
    lines = text.splitlines()  # the op's layout under the op's line, not under kept_logits'
    at_op = next(i for i, line in enumerate(lines) if line.startswith(f"{op}: memory fast"))
    assert lines[at_op + 1].startswith("  layout: "), text
    monkeypatch.setattr(
        ffi, "BACKEND", dataclasses.replace(ffi.BACKEND, unavailable_reason=lambda: None)
    )
    assert "\nkept_logits: ffi (automatic)" in call(many)
    problem = Problem(
        n_rows=4 * many, vocab=96, hidden_dim=16, dtype="bfloat16", weight_dtype="bfloat16"
    )
    request = memory_lib.Request("fast", 1, (4 * many, 96), jnp.bfloat16)
    assert (
        dispatch.resolve(op, problem, memory=request, kept="kept_logits").impl
        is ffi_linear.kept_logits
    )
    text = call(many - 1)
    assert (
        "\nkept_logits: reference (automatic)" in text
        and f"ffi declined: {4 * many - 4} rows < {4 * many}" in text
    ), text
    text = call(many, jnp.float32)
    assert (
        "\nkept_logits: reference (automatic)" in text and "ffi declined: hidden is float32" in text
    )


@pytest.mark.parametrize("op", ["linear_logprobs", "linear_grpo_loss", "linear_distill_loss"])
def test_explain_keeps_a_budgets_reason(rng, op):
    """A byte budget that resolves to lean: one memory line, with the budget's comparison,
    after the backend's (the mode is decided once per call, by dispatch)."""
    hidden, _, weight, _, _, _, acts = head(rng, (4, 8), 100, 16, jnp.bfloat16, "vd", False)
    acts = jnp.asarray(acts)
    kept = 4 * 8 * 100 * 2
    args = {
        "linear_logprobs": (hidden, weight, acts),
        "linear_grpo_loss": (
            hidden,
            weight,
            acts,
            jnp.zeros((4, 8)),
            jnp.ones(4),
            jnp.ones((4, 8)),
        ),
        "linear_distill_loss": (hidden, weight, hidden, weight, jnp.ones((4, 8))),
    }[op]
    extra = {"group_size": 2} if op == "linear_grpo_loss" else {}
    text = jk.explain(op, *args, memory=kept - 1, **extra)
    lines = [l for l in text.splitlines() if "memory" in l]
    assert len(lines) == 1, text
    assert lines[0].startswith(f"  memory: lean (memory={kept - 1}: a budget of "), text
    assert f"< the {kept / 1024:.1f} KiB" in lines[0], text
    backend_line = next(i for i, l in enumerate(text.splitlines()) if l.startswith(f"{op}: "))
    assert text.splitlines().index(lines[0]) > backend_line, text
    fast = jk.explain(op, *args, memory=kept, **extra)
    assert f"\n{op}: memory fast (memory={kept}: a budget of " in "\n" + fast, fast


@pytest.mark.parametrize(
    "memory,match",
    [
        ("medium", "memory: expected 'lean', 'fast'"),
        (-1, "budget must be >= 0"),
        (True, "memory"),
        (1.5, "memory"),
    ],
)
def test_memory_bad_values(rng, memory, match):
    hidden, _, weight, _, _, _, acts = head(rng, (3,), 10, 4, jnp.float32, "vd", False)
    with pytest.raises(ValueError, match=match):
        jk.linear_logprobs(hidden, weight, jnp.asarray(acts), memory=memory)


def test_fast_with_explicit_backend_is_an_error(rng):
    hidden, _, weight, _, _, _, acts = head(rng, (3,), 10, 4, jnp.float32, "vd", False)
    with pytest.raises(ValueError, match="serves memory='lean' only"):
        jk.linear_logprobs(hidden, weight, jnp.asarray(acts), backend="chunked", memory="fast")
    # a budget that resolves to lean keeps the requested backend
    jk.linear_logprobs(hidden, weight, jnp.asarray(acts), backend="chunked", memory=0)


def test_fast_keeps_the_logits_and_lean_does_not(rng):
    n, vocab, d = 256, 65536, 8
    hidden, _, weight, _, _, _, acts = head(rng, (n,), vocab, d, jnp.bfloat16, "vd", False)
    t = jnp.asarray(acts)

    def temp(memory):
        def loss(h, w):
            return jnp.sum(jk.linear_logprobs(h, w, t, backend=None, memory=memory))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, weight).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    kept = n * vocab * 2
    assert temp("fast") >= kept
    with jk.use_backend("chunked"):
        assert temp("lean") < kept


def test_fully_masked_rows_get_no_gradient_fast(rng):
    hidden, _, weight, _, bias, _, acts = head(rng, (2, 3), 9, 4, jnp.float32, "vd", True)

    def f(h, w, bb):
        loss, _ = jk.linear_ppo_loss(
            h,
            w,
            jnp.asarray(acts),
            jnp.zeros((2, 3)),
            jnp.ones(2),
            jnp.zeros((2, 3)),
            bias=bb,
            entropy_coef=0.1,
            memory="fast",
        )
        return loss

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(hidden, weight, bias)
    assert float(loss) == 0.0
    for g in grads:
        assert_zero(g)


# -- on a GPU: XLA's GEMM (cuBLAS) rounds its float32 accumulator to the head's dtype -----------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_fast_matches_its_float64_formula(dtype, layout):
    rng = np.random.default_rng(7)
    n, vocab, d, temp = 1024, 32003, 256, 0.8
    hidden, h64, weight, w64, bias, b64, targets = head(rng, (n,), vocab, d, dtype, layout, True)
    t = jnp.asarray(targets, jnp.int32)
    g, g_ent = cotangent(rng, (n,)), cotangent(rng, (n,))

    def f(h, w, b):
        return jk.linear_logprobs(
            h, w, t, b, weight_layout=layout, temperature=temp, return_entropy=True, memory="fast"
        )

    (logp, ent), vjp = jax.vjp(jax.jit(f), hidden, weight, bias)
    grads = vjp((g, g_ent))
    kw = dict(weight_layout=layout, temperature=temp)
    want = oracle.linear_logprobs(h64, w64, targets, b64, **kw)
    g64, ge64 = np.asarray(g, np.float64), np.asarray(g_ent, np.float64)
    want_g = oracle.linear_logprobs_vjp(h64, w64, targets, g64, ge64, b64, **kw)
    values, grads_f = fast_formula(
        h64, w64, b64, targets, g64, ge64, layout=layout, temperature=temp, ignore=-100, dtype=dtype
    )
    zs = np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)).max() / temp
    assert_close(logp, want[0], in_dtype=dtype, want32=values[0], scale=zs, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=values[1], scale=zs, name="entropy")
    for name, got, w, wf in zip(("d_hidden", "d_weight", "d_bias"), grads, want_g, grads_f):
        assert_close(got, w, in_dtype=dtype, want32=wf, name=name)
