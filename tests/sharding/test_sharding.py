"""Many devices (8 host devices, mesh data=2 × model=4): every op on sharded inputs.

For every op × backend (conftest's list: pallas in interpret mode with JAXRL_TEST_PALLAS=1)
× {Auto, Explicit} mesh axes × {rows over ``data``, vocabulary over ``model``, both}: values
and gradients (random cotangents) equal the unsharded call of the same backend (float32, 1e-5
of scale), the compiled program all-gathers none of the hidden states,
logits or weight (nor a device's share of them), and d_weight / d_logits come back sharded like
the weight / logits. Inside ``jax.shard_map`` with ``vocab_axis``: the global results, compared
with the unsharded call and with the float64 oracle, including entropy, temperature,
ignore_index and out-of-range targets under tracing (NaN exactly there).

Vocabulary sizes are chosen so that every kernel walks several vocabulary tiles per device
(chunked: ``CHUNK_BYTES`` is made small; pallas linear: 256-column tiles over V_local = 2048).

Pallas in interpret mode is slow: there each op runs the vocabulary split (the two tests of a
kernel one mesh type each, ``PALLAS_A`` / ``PALLAS_B``); the other pairs carry ``pallas_slow``
(JAXRL_TEST_PALLAS_SLOW=1). ppo_loss and group_advantages are one function on
reference and chunked: conftest's ``op`` marker runs it once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels.backends.chunked import logprobs as chunked
from tests.conftest import assert_close, pallas_sample, pallas_slow, rand, random_mask
from tests.support import oracle
from tests.support.sharding_support import collective_sizes, full_spec

B, T, D, V = 4, 8, 32, 8192
AXES = ("data", "model")
LAYOUTS = {"rows": ("data", None), "vocab": (None, "model"), "both": ("data", "model")}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 64 * 1024)  # 512 columns of 32 rows


def make_mesh(kind: str):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest forces 8 host devices on CPU)")
    return jax.make_mesh((2, 4), AXES, axis_types=(getattr(AxisType, kind),) * 2)


# -- the check ---------------------------------------------------------------------------------


def check_sharded(fn, args, specs, mesh, *, diff=(), big=(), like=(), low_rel=None):
    """``fn(*args)`` on arrays placed by ``specs`` against the unsharded call.

    diff: positions of args to differentiate (a scalar of the outputs with random weights);
    big: positions of the arrays no all-gather may rebuild (even a device's share);
    like: (grad index, arg position) pairs whose gradient must be sharded like the argument;
    low_rel: for bfloat16/float16 results (gradients of such inputs), the bound on
    ‖got − unsharded‖ / ‖unsharded‖ instead of the float32 rule: a rows-split d_weight is the
    sum of per-device partial sums, each rounded to the gradient's dtype (a vocabulary-split
    d_hidden's float32 sum is rounded once, in another order than the unsharded one's).
    """
    rng = np.random.default_rng(0)
    outs = jax.eval_shape(fn, *args)
    weights = [
        jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in jax.tree.leaves(outs)
    ]

    def scalar(*a):
        return sum(
            jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w)
            for o, w in zip(jax.tree.leaves(fn(*a)), weights)
        )

    def both(*a):
        out = fn(*a)
        return out, (jax.grad(scalar, argnums=diff)(*a) if diff else ())

    want_out, want_grad = jax.jit(both)(*args)
    placed = [
        x if s is None else jax.device_put(x, NamedSharding(mesh, P(*s)))
        for x, s in zip(args, specs)
    ]
    compiled = jax.jit(both).lower(*placed).compile()
    got_out, got_grad = compiled(*placed)
    for name, got, want in (("output", got_out, want_out), ("gradient", got_grad, want_grad)):
        for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            w = np.asarray(w, np.float64)
            fin = np.isfinite(w)
            np.testing.assert_array_equal(
                np.isnan(np.asarray(g)), np.isnan(w), err_msg=f"{name} {i}: NaN positions"
            )
            g64 = np.asarray(g, np.float64)[fin]
            if low_rel is not None and g.dtype in (jnp.bfloat16, jnp.float16):
                rel = float(np.linalg.norm(g64 - w[fin]) / max(np.linalg.norm(w[fin]), 1e-30))
                assert rel <= low_rel, f"{name} {i}: relative error {rel:.3e} > {low_rel}"
                continue
            scale = max(float(np.max(np.abs(w[fin]), initial=0.0)), 1e-3)
            err = float(np.max(np.abs(g64 - w[fin]), initial=0.0))
            assert err <= 1e-5 * scale, f"{name} {i}: max error {err:.3e} > 1e-5 × {scale:.3e}"
    if big:
        limit = min(args[i].size for i in big) // 8  # below any device's share
        gathers = [n for n in collective_sizes(compiled.as_text(), "all-gather") if n >= limit]
        assert not gathers, f"all-gathers of {gathers} elements (limit {limit})"
    for g_index, a_index in like:
        assert full_spec(got_grad[g_index]) == full_spec(placed[a_index]), (
            f"gradient {g_index} sharded {full_spec(got_grad[g_index])}, "
            f"argument {full_spec(placed[a_index])}"
        )
    return got_out


# -- inputs ---------------------------------------------------------------------------------


def head(rng, layout="vd"):
    h, _ = rand(rng, (B, T, D))
    w, _ = rand(rng, (V, D) if layout == "vd" else (D, V), scale=2.0 / np.sqrt(D))
    acts = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(random_mask(rng, B, T, empty_rows=(1,)))
    return h, w, acts, mask


def logits_inputs(rng):
    """Policy and reference logits [B, T, V], actions, old log-probs, rewards, a mask."""
    pol, _ = rand(rng, (B, T, V), scale=2.0)
    ref, _ = rand(rng, (B, T, V), scale=2.0)
    acts = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(random_mask(rng, B, T, empty_rows=(1,)))
    old, _ = rand(rng, (B, T), scale=0.3, loc=-9.0)
    rewards, _ = rand(rng, (B,))
    return pol, ref, acts, old, rewards, mask


def bad_targets(rng, b, t, vocab):
    """Targets [b, t] (int32) with one past the vocabulary and one negative (their log-probs
    are NaN) and one ignored (-100, log-prob 0)."""
    targets = np.asarray(rng.integers(0, vocab, (b, t)), np.int32)
    targets[0, 1], targets[1, 2], targets[3, 4] = vocab + 3, -7, -100
    return jnp.asarray(targets)


def w_spec(layout, vocab_entry):
    return (vocab_entry, None) if layout == "vd" else (None, vocab_entry)


MESHES = ["Auto", "Explicit"]


# On pallas each test below runs the vocabulary split only (the layout that moves the kernel's
# vocabulary offsets; the rows / both layouts run on reference and chunked, every pair with
# JAXRL_TEST_PALLAS_SLOW=1), the two tests of a kernel (logits: token_logprobs and grpo_loss;
# linear: linear_logprobs and the linear losses) one mesh type each.
PALLAS_A = {("Explicit", "vocab")}
PALLAS_B = {("Auto", "vocab")}
# chunked: the linear losses and grpo_loss / ratio_kl (its costliest tests here) one half of the
# mesh type × layout pairs each, every layout in both; the reference backend the other half, so
# that the two together run every pair of each test (every pair on both with JAXRL_TEST_SLOW=1)
CHUNKED_A = {("Auto", "rows"), ("Explicit", "vocab"), ("Auto", "both")}
CHUNKED_B = {("Explicit", "rows"), ("Auto", "vocab"), ("Explicit", "both")}


def mesh_layout_sample(pallas, chunked):
    """Every mesh type × layout pair as a ``pytest.param``: those not in ``pallas`` are
    ``pallas_slow``; those not in ``chunked`` slow on chunked, the others slow on reference."""
    return [
        pytest.param(
            kind,
            layout,
            id=f"{kind}-{layout}",
            marks=[pytest.mark.pallas_slow] * ((kind, layout) not in pallas)
            # one slow_on marker (conftest reads the closest only)
            + [pytest.mark.slow_on("reference" if (kind, layout) in chunked else "chunked")],
        )
        for kind in MESHES
        for layout in LAYOUTS
    ]


# linear_logprobs: "dv" runs only its 'vocab' layout in interpret mode (below), Auto here
PALLAS_LINEAR = {("vd", *pair) for pair in PALLAS_A} | {("dv", "Auto", "vocab")}
# and chunked the weight layout × mesh type × layout triples of CHUNKED_LINEAR, reference the
# other half (each backend every weight layout, mesh type and layout; all with JAXRL_TEST_SLOW=1)
CHUNKED_LINEAR = {("vd", *pair) for pair in CHUNKED_A} | {("dv", *pair) for pair in CHUNKED_B}


def _split_chunked_reference(params, chunked):
    """``params`` with slow_on("reference") on those in ``chunked``, slow_on("chunked") on the
    others."""
    return [
        pytest.param(
            *p.values,
            id=p.id,
            marks=[
                *p.marks,
                pytest.mark.slow_on("reference" if p.values in chunked else "chunked"),
            ],
        )
        for p in params
    ]


@pytest.mark.parametrize(
    "weight_layout,mesh_kind,layout",
    _split_chunked_reference(
        pallas_sample(PALLAS_LINEAR, ("vd", "dv"), MESHES, list(LAYOUTS)), CHUNKED_LINEAR
    ),
)
def test_linear_logprobs(rng, backend, mesh_kind, layout, weight_layout):
    if backend == "pallas" and weight_layout == "dv" and layout != "vocab":
        pytest.skip("pallas in interpret mode: the dv layout runs only in the 'vocab' layout")
    h, w, acts, _ = head(rng, weight_layout)
    b, _ = rand(rng, (V,), scale=0.3)
    rows, vocab = LAYOUTS[layout]
    fn = functools.partial(_linear_logprobs, backend=backend, weight_layout=weight_layout)
    check_sharded(
        fn,
        (h, w, b, acts),
        [(rows, None, None), w_spec(weight_layout, vocab), (vocab,), (rows, None)],
        make_mesh(mesh_kind),
        diff=(0, 1, 2),
        big=(0, 1),
        like=((1, 1), (2, 2)),
    )


def _linear_logprobs(h, w, b, acts, *, backend, weight_layout):
    return jk.linear_logprobs(
        h,
        w,
        acts,
        b,
        weight_layout=weight_layout,
        return_entropy=True,
        temperature=0.8,
        backend=backend,
    )


@pytest.mark.parametrize("mesh_kind,layout", pallas_sample(PALLAS_A, MESHES, list(LAYOUTS)))
def test_token_logprobs(rng, backend, mesh_kind, layout):
    logits, _ = rand(rng, (B, T, V), scale=2.0)
    t = np.asarray(rng.integers(0, V, (B, T)), np.int32)
    t[2, 3] = -100
    rows, vocab = LAYOUTS[layout]
    fn = lambda x, t: jk.token_logprobs(
        x, t, return_entropy=True, temperature=1.3, ignore_index=-100, backend=backend
    )
    check_sharded(
        fn,
        (logits, jnp.asarray(t)),
        [(rows, None, vocab), (rows, None)],
        make_mesh(mesh_kind),
        diff=(0,),
        big=(0,),
        like=((0, 0),),
    )


@pytest.mark.parametrize("mesh_kind,layout", mesh_layout_sample(PALLAS_B, CHUNKED_A))
def test_grpo_loss_and_ratio_kl(rng, backend, mesh_kind, layout):
    pol, ref, acts, old, rewards, mask = logits_inputs(rng)
    rows, vocab = LAYOUTS[layout]

    def fn(pol, ref, acts, old, rewards, mask):
        loss = jk.grpo_loss(
            pol, ref, acts, old, rewards, mask, group_size=2, beta=0.05, backend=backend
        )
        ratio, kl = jk.ratio_kl(pol, ref, acts, old, mask, backend=backend)
        return loss, ratio, kl

    logit_spec = (rows, None, vocab)
    check_sharded(
        fn,
        (pol, ref, acts, old, rewards, mask),
        [logit_spec, logit_spec, (rows, None), (rows, None), (rows,), (rows, None)],
        make_mesh(mesh_kind),
        diff=(0,),
        big=(0, 1),
        like=((0, 0),),
    )


@pytest.mark.parametrize("mesh_kind,layout", mesh_layout_sample(PALLAS_B, CHUNKED_B))
def test_linear_losses(rng, backend, mesh_kind, layout):
    h, w, acts, mask = head(rng)
    old, _ = rand(rng, (B, T), scale=0.3, loc=-9.0)
    adv, _ = rand(rng, (B,))
    ref, _ = rand(rng, (B, T), scale=0.3, loc=-9.0)
    rows, vocab = LAYOUTS[layout]
    check_sharded(
        *_linear_losses_case(backend, (h, w, acts, old, adv, ref, mask), rows, vocab),
        make_mesh(mesh_kind),
        diff=(0, 1),
        big=(0, 1),
        like=((1, 1),),
    )


def _linear_losses_case(backend, operands, rows, vocab):
    """linear_ppo_loss and linear_grpo_loss on (h, w, actions, old, adv, ref, mask), and the
    operands' specs: rows split over ``rows``, the vocabulary over ``vocab``."""

    def fn(h, w, acts, old, adv, ref, mask):
        ppo, metrics = jk.linear_ppo_loss(
            h,
            w,
            acts,
            old,
            adv,
            mask,
            entropy_coef=0.01,
            ref_logp=ref,
            kl_coef=0.1,
            dual_clip=3.0,
            loss_agg_mode="seq_mean_token_mean",
            backend=backend,
        )
        grpo = jk.linear_grpo_loss(
            h, w, acts, old, adv, mask, ref_logp=ref, group_size=2, beta=0.04, backend=backend
        )
        return ppo, metrics, grpo

    specs = [
        (rows, None, None),
        (vocab, None),
        (rows, None),
        (rows, None),
        (rows,),
        (rows, None),
        (rows, None),
    ]
    return fn, operands, specs


# pallas: Auto axes only (Explicit runs on reference; the grid runs pallas ppo_loss under shard_map)
@pytest.mark.parametrize("mesh_kind", ["Auto", pallas_slow("Explicit")])
@pytest.mark.op("ppo_loss", "group_advantages")
def test_ppo_loss_and_group_advantages(rng, backend, mesh_kind):
    logp, _ = rand(rng, (B, T), scale=0.3, loc=-5.0)
    old, _ = rand(rng, (B, T), scale=0.3, loc=-5.0)
    ent, _ = rand(rng, (B, T), scale=1.0, loc=3.0)
    rewards, _ = rand(rng, (B,))
    mask = jnp.asarray(random_mask(rng, B, T, empty_rows=(1,)))

    def fn(logp, old, ent, rewards, mask):
        adv = jk.group_advantages(rewards, group_size=2, backend=backend)
        return jk.ppo_loss(
            logp,
            old,
            adv,
            mask,
            entropy=ent,
            entropy_coef=0.01,
            loss_agg_mode="seq_mean_token_mean",
            backend=backend,
        ), adv

    check_sharded(
        fn,
        (logp, old, ent, rewards, mask),
        [("data", None), ("data", None), ("data", None), ("data",), ("data", None)],
        make_mesh(mesh_kind),
        diff=(0, 2, 3),
    )


# -- inside shard_map: vocab_axis ----------------------------------------------------------------


def _in_shard_map(fn, in_specs, out_specs, check_vma=True, mesh_kind="Explicit"):
    """``fn`` as a jitted shard_map over the test mesh, taking global arrays."""
    mesh = make_mesh(mesh_kind)
    inner = jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )

    def mapped(*args):  # traceable: reshards its (global) arguments to in_specs
        return inner(*(jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs)))

    return mapped, jax.jit(mapped)


# pallas and chunked: with shard_map's varying-axes checks only (the same kernel calls either
# way; reference runs both)
@pytest.mark.parametrize(
    "check_vma",
    [True, pytest.param(False, marks=[pytest.mark.pallas_slow, pytest.mark.slow_on("chunked")])],
)
def test_linear_logprobs_vocab_axis(rng, backend, check_vma):
    """Global log-probs and entropies (and, through jax.grad of the shard_map, the gradients of
    the row-split hidden states and of the weight slices) from vocabulary slices; bad traced
    targets give NaN, ignored ones 0. With and without shard_map's varying-axes types."""
    for weight_layout in ("vd", "dv"):
        h, w, _, _ = head(rng, weight_layout)
        t = bad_targets(rng, B, T, V)
        kw = dict(
            weight_layout=weight_layout,
            temperature=0.7,
            ignore_index=-100,
            return_entropy=True,
            backend=backend,
        )
        g_lp, g_ent = (jnp.asarray(rng.standard_normal((B, T)), jnp.float32) for _ in range(2))
        ws = P("model", None) if weight_layout == "vd" else P(None, "model")
        rows = P("data", None)
        sharded, _ = _in_shard_map(
            lambda h, w, t: jk.linear_logprobs(h, w, t, vocab_axis="model", **kw),
            (P("data", None, None), ws, rows),
            (rows, rows),
            check_vma=check_vma,
        )

        def scalar(out):
            fin = lambda x: jnp.where(jnp.isnan(x), 0.0, x)
            return jnp.sum(fin(out[0]) * g_lp) + jnp.sum(fin(out[1]) * g_ent)

        unsharded = lambda h, w, t: jk.linear_logprobs(h, w, t, **kw)
        mesh = make_mesh("Explicit")
        placed = (
            jax.device_put(h, NamedSharding(mesh, P("data", None, None))),
            jax.device_put(w, NamedSharding(mesh, ws)),
            jax.device_put(t, NamedSharding(mesh, rows)),
        )
        (lp, ent), (dh, dw) = jax.jit(
            lambda h, w, t: (
                sharded(h, w, t),
                jax.grad(lambda h, w: scalar(sharded(h, w, t)), (0, 1))(h, w),
            )
        )(*placed)
        (lp0, ent0), (dh0, dw0) = jax.jit(
            lambda h, w, t: (
                unsharded(h, w, t),
                jax.grad(lambda h, w: scalar(unsharded(h, w, t)), (0, 1))(h, w),
            )
        )(h, w, t)
        want = oracle.linear_logprobs(
            np.asarray(h, np.float64),
            np.asarray(w, np.float64),
            np.asarray(t),
            weight_layout=weight_layout,
            temperature=0.7,
            ignore_index=-100,
        )
        for got, base, w64, name in ((lp, lp0, want[0], "logp"), (ent, ent0, want[1], "entropy")):
            assert_close(got, w64, name=name, scale=10.0)
            assert_close(got, np.asarray(base), name=f"{name} vs unsharded")
        assert np.isnan(np.asarray(lp)[0, 1]) and np.isnan(np.asarray(lp)[1, 2])
        assert np.asarray(lp)[3, 4] == 0 and np.asarray(ent)[3, 4] == 0
        assert_close(dh, np.asarray(dh0), name="d_hidden vs unsharded")
        assert_close(dw, np.asarray(dw0), name="d_weight vs unsharded")
        assert full_spec(dw) == full_spec(placed[1])


def test_linear_logprobs_vocab_axis_grad_inside(rng, backend):
    """Gradients taken inside the shard_map body, the way a training step written per device
    does it: d_weight is summed over the row split, d_hidden over the vocabulary split."""
    h, w, t, _ = head(rng)

    def local(h, w, t):
        value, grads = jax.value_and_grad(
            lambda h, w: jnp.sum(jk.linear_logprobs(h, w, t, vocab_axis="model", backend=backend)),
            argnums=(0, 1),
        )(h, w)
        return jax.lax.psum(value, "data"), grads

    _, call = _in_shard_map(
        local,
        (P("data", None, None), P("model", None), P("data", None)),
        (P(), (P("data", None, None), P("model", None))),
    )
    got = call(h, w, t)
    want = jax.jit(
        jax.value_and_grad(
            lambda h, w: jnp.sum(jk.linear_logprobs(h, w, t, backend=backend)), argnums=(0, 1)
        )
    )(h, w)
    for g, wv in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, np.asarray(wv))


def test_logits_ops_vocab_axis(rng, backend):
    """token_logprobs, ratio_kl and grpo_loss on vocabulary slices of the logits."""
    pol, ref, acts, old, rewards, mask = logits_inputs(rng)

    def ops(pol, ref, acts, old, rewards, mask, vocab_axis=None):
        lp, ent = jk.token_logprobs(
            pol, acts, return_entropy=True, temperature=1.2, backend=backend, vocab_axis=vocab_axis
        )
        ratio, kl = jk.ratio_kl(pol, ref, acts, old, mask, backend=backend, vocab_axis=vocab_axis)
        loss, pg, grpo_kl = jk.grpo_loss(
            pol,
            ref,
            acts,
            old,
            rewards,
            mask,
            group_size=2,
            beta=0.1,
            backend=backend,
            vocab_axis=vocab_axis,
        )
        return lp, ent, ratio, kl, jnp.stack([loss, pg, grpo_kl])

    args = (pol, ref, acts, old, rewards, mask)
    vocab3, rows = P(None, None, "model"), P(None, None)
    specs = (vocab3, vocab3, rows, rows, P(None), rows)
    mapped, call = _in_shard_map(
        functools.partial(ops, vocab_axis="model"), specs, (rows,) * 4 + (P(),)
    )
    for g, w in zip(call(*args), jax.jit(ops)(*args)):
        assert_close(g, np.asarray(w))
    scalar = lambda out: jnp.sum(out[4]) + jnp.sum(jnp.log(out[2]))
    got = jax.jit(jax.grad(lambda p: scalar(mapped(p, *args[1:]))))(pol)
    want = jax.jit(jax.grad(lambda p: scalar(ops(p, *args[1:]))))(pol)
    assert_close(got, np.asarray(want), name="d_policy_logits")


def test_linear_losses_vocab_axis(rng, backend):
    h, w, acts, mask = head(rng)
    old, _ = rand(rng, (B, T), scale=0.3, loc=-9.0)
    adv, _ = rand(rng, (B,))

    def losses(h, w, vocab_axis=None):
        ppo, _ = jk.linear_ppo_loss(
            h, w, acts, old, adv, mask, entropy_coef=0.02, backend=backend, vocab_axis=vocab_axis
        )
        grpo, _, _ = jk.linear_grpo_loss(
            h, w, acts, old, adv, mask, group_size=2, backend=backend, vocab_axis=vocab_axis
        )
        return ppo + grpo

    mapped, _ = _in_shard_map(lambda h, w: losses(h, w, "model"), (P(), P("model", None)), P())
    got = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))(h, w)
    want = jax.jit(jax.value_and_grad(losses, argnums=(0, 1)))(h, w)
    for g, wv in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, np.asarray(wv))


def test_vocab_axis_errors(rng):
    h, w, acts, _ = head(rng)
    with pytest.raises(ValueError, match="vocab_axis='model' is only valid inside jax.shard_map"):
        jk.linear_logprobs(h, w, acts, vocab_axis="model")
    _, call = _in_shard_map(
        lambda h, w, t: jk.linear_logprobs(h, w, t, vocab_axis="tensor"),
        (P(), P("model", None), P()),
        P(),
    )
    with pytest.raises(ValueError, match="'tensor' is not an axis of the mesh"):
        call(h, w, acts)


def test_explain_says_how_a_sharded_call_is_served(rng):
    h, w, acts, _ = head(rng)
    mesh = make_mesh("Explicit")
    hh = jax.device_put(h, NamedSharding(mesh, P("data", None, None)))
    ww = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    tt = jax.device_put(acts, NamedSharding(mesh, P("data", None)))
    text = jk.explain("linear_logprobs", hh, ww, tt)
    assert "layout: Explicit mesh axes: shard_map" in text
    assert "rows split over dim 0: ['data']" in text
    assert "vocabulary split over ['model'] (vocabulary-parallel)" in text


@pytest.mark.parametrize("weight_layout", ["vd", pallas_slow("dv")])
def test_fsdp_head_in_shard_map(rng, backend, weight_layout):
    """A head sharded over the rows' axis inside a user's shard_map (docs/api.md, "A head
    sharded over the rows' axis"): the body all-gathers it, and jax's transpose of the gather
    reduce-scatters d_weight back to the head's split. Values and gradients are the unsharded
    ones; the head's split is on V for "vd" and on D for "dv" (both [D, V] dim 0)."""
    h, w, acts, _ = head(rng, weight_layout)
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )
    kw = dict(weight_layout=weight_layout, return_entropy=True, backend=backend)

    def body(h, w, t):
        w = jax.lax.all_gather(w, "data", axis=0, tiled=True)
        return jk.linear_logprobs(h, w, t, **kw)

    rows = P("data")
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(rows, P("data"), rows), out_specs=rows)
    g = [jnp.asarray(rng.standard_normal((B, T)), jnp.float32) for _ in range(2)]
    scalar = lambda f: lambda h, w, t: sum(jnp.sum(o * gi) for o, gi in zip(f(h, w, t), g))
    both = lambda f: jax.jit(lambda h, w, t: (f(h, w, t), jax.grad(scalar(f), (0, 1))(h, w, t)))
    placed = [jax.device_put(x, NamedSharding(mesh, rows)) for x in (h, w, acts)]
    compiled = both(mapped).lower(*placed).compile()
    got = compiled(*placed)
    want = both(lambda h, w, t: jk.linear_logprobs(h, w, t, **kw))(h, w, acts)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert_close(a, np.asarray(b, np.float64), name=f"leaf {i}")
    assert full_spec(got[1][1]) == full_spec(placed[1])
    assert w.size // 4 in collective_sizes(compiled.as_text(), "reduce-scatter")
    assert w.size not in collective_sizes(compiled.as_text(), "all-reduce")


# -- d_hidden under a vocabulary split: summed in float32 --------------------------------------

SPLIT_DEVICES = (1, 2, 4, 8)
SPLIT_GROWTH = 1.1  # the error on n devices over the error on one


def _split_d_hidden(h, w, t, g, *, n, entry, **kw):
    """d_hidden of Σ g · linear_logprobs(h, w, t) with the vocabulary of ``w`` split over the
    first ``n`` devices: under jax.jit with Explicit or Auto axes, or in a user's shard_map
    with ``vocab_axis`` (``entry``)."""
    kind = "Auto" if entry == "Auto" else "Explicit"
    mesh = jax.make_mesh(
        (n,), ("model",), axis_types=(getattr(AxisType, kind),), devices=jax.devices()[:n]
    )
    if entry == "shard_map":
        logp = jax.shard_map(
            lambda h, w: jk.linear_logprobs(h, w, t, vocab_axis="model", **kw),
            mesh=mesh,
            in_specs=(P(), P("model", None)),
            out_specs=P(),
        )
    else:
        logp = lambda h, w: jk.linear_logprobs(h, w, t, **kw)
    loss = lambda h, w: jnp.sum(logp(h, w) * g)
    h = jax.device_put(h, NamedSharding(mesh, P()))
    w = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    return np.asarray(jax.jit(jax.grad(loss))(h, w), np.float64)


def _check_split_error_flat(rng, devices=SPLIT_DEVICES, entries=("Auto", "shard_map"), **kw):
    """bfloat16 hidden states and head: d_hidden's error against the float64 result on 2, 4
    and 8 devices (Explicit axes; the other ``entries`` on the most devices) stays the
    one-device error (within SPLIT_GROWTH): each device's share is summed in float32 and
    rounded once. (Summed in bfloat16, it grew 1.4–1.5× at 2 devices.)"""
    n_rows, dim, vocab = 64, 32, 2048
    h = jnp.asarray(rng.standard_normal((n_rows, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((vocab, dim)) / np.sqrt(dim), jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, vocab, n_rows), jnp.int32)
    g = jnp.asarray(rng.standard_normal(n_rows), jnp.float32)
    want, _, _ = oracle.linear_logprobs_vjp(h, w, np.asarray(t), np.asarray(g))
    rel = lambda x: float(np.linalg.norm(x - want) / np.linalg.norm(want))
    errors = {(1, "Explicit"): rel(_split_d_hidden(h, w, t, g, n=1, entry="Explicit", **kw))}
    for n in devices[1:]:
        errors[(n, "Explicit")] = rel(_split_d_hidden(h, w, t, g, n=n, entry="Explicit", **kw))
    for entry in entries:
        errors[(devices[-1], entry)] = rel(
            _split_d_hidden(h, w, t, g, n=devices[-1], entry=entry, **kw)
        )
    one = errors[(1, "Explicit")]
    worse = {k: e for k, e in errors.items() if e > SPLIT_GROWTH * one}
    assert not worse, f"d_hidden errors grow with the devices: {errors}"


def test_vocab_split_d_hidden_error_flat(rng, backend):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest forces 8 host devices on CPU)")
    if backend == "pallas":  # interpret mode: one device and eight, Explicit axes
        _check_split_error_flat(rng, (1, 8), (), backend=backend, memory="lean")
    else:
        _check_split_error_flat(rng, backend=backend, memory="lean")


def test_vocab_split_d_hidden_error_flat_fast(rng):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest forces 8 host devices on CPU)")
    _check_split_error_flat(rng, memory="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["pallas", "ffi"])
def test_vocab_axis_compiled_kernels_under_vma_checks(rng, backend_name):
    """On a GPU, the compiled kernels inside a user's shard_map with check_vma=True (a mesh of
    this one GPU: the varying-axes types are the same as on many)."""
    if backend_name not in jk.available_backends("linear_logprobs"):
        pytest.skip(f"{backend_name} is not available here")
    mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Explicit,))
    h = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4096, 256)) / 16, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, 4096, 64), jnp.int32)

    def loss(h, w, t, vocab_axis=None):
        lp, ent = jk.linear_logprobs(
            h, w, t, return_entropy=True, backend=backend_name, vocab_axis=vocab_axis
        )
        return jnp.sum(lp) + 0.5 * jnp.sum(ent)

    mapped = jax.shard_map(
        lambda h, w, t: jax.value_and_grad(lambda h, w: loss(h, w, t, "model"), argnums=(0, 1))(
            h, w
        ),
        mesh=mesh,
        in_specs=(P(), P("model", None), P()),
        out_specs=(P(), (P(), P("model", None))),
    )
    placed = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip((h, w, t), (P(), P("model", None), P()))
    ]
    got = jax.jit(mapped)(*placed)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, w, t)
    for g, wv in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(wv, np.float32))


# -- on GPUs: the compiled kernels (ffi, pallas) over two and four GPUs -------------------------

GPU_B, GPU_T, GPU_D, GPU_V = 4, 96, 256, 12352  # per GPU of two: 192 rows (not a multiple of
# the kernels' 128-row tile), or 6176 vocabulary columns (24 tiles of 256 and a partial one);
# of four: 96 rows, or 3088 columns (a multiple of 8, as the ffi "dv" kernel needs)
# layout: (rows' axis, vocabulary's axis); "both" runs on a (2, 2) mesh of four GPUs
GPU_LAYOUTS = {"rows": ("x", None), "vocab": (None, "x"), "both": ("x", "y")}
GPU_GRID = [
    (n, layout) for n in (2, 4) for layout in GPU_LAYOUTS if not (n == 2 and layout == "both")
]
GPU_LOW_REL = 4e-3  # about one bfloat16 rounding (2^-8) of a two-term sum, in norm


def gpu_low_rel(n: int) -> float:
    """GPU_LOW_REL for ``n`` GPUs: a rows-split d_weight is all-reduced in bfloat16, one
    rounding per hop of the partial sums, so the bound grows as √(n / 2). (A vocabulary-split
    d_hidden is summed in float32 and rounded once: test_vocab_split_d_hidden_error_flat.)"""
    return GPU_LOW_REL * float(np.sqrt(n / 2))


def gpu_mesh(kind: str, n: int = 2, layout: str = "rows"):
    """A mesh of the first ``n`` GPUs: 1-D ``x``, or ``(x, y)`` of shape (2, 2) for "both"."""
    if jax.default_backend() != "gpu" or jax.local_device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    shape, names = ((2, 2), ("x", "y")) if layout == "both" else ((n,), ("x",))
    return jax.make_mesh(
        shape,
        names,
        axis_types=(getattr(AxisType, kind),) * len(names),
        devices=jax.local_devices()[:n],
    )


def gpu_backend(name):
    if name not in jk.available_backends("linear_logprobs"):
        pytest.skip(f"{name} is not available here")
    return name


def gpu_head(rng, weight_layout="vd"):
    h = jnp.asarray(rng.standard_normal((GPU_B, GPU_T, GPU_D)), jnp.bfloat16)
    shape = (GPU_V, GPU_D) if weight_layout == "vd" else (GPU_D, GPU_V)
    w = jnp.asarray(rng.standard_normal(shape) * 1.5 / np.sqrt(GPU_D), jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, GPU_V, (GPU_B, GPU_T)), jnp.int32)
    mask = jnp.asarray(random_mask(rng, GPU_B, GPU_T, empty_rows=(1,)))
    return h, w, t, mask


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpus,layout", GPU_GRID)
@pytest.mark.parametrize("mesh_kind", MESHES)
@pytest.mark.parametrize("weight_layout", ["vd", "dv"])
@pytest.mark.parametrize("backend_name", ["ffi", "pallas"])
def test_gpus_linear_logprobs(rng, backend_name, weight_layout, mesh_kind, n_gpus, layout):
    """Rows or vocabulary split (or both) over two or four GPUs: values and gradients (hidden, weight, bias) equal
    the one-GPU call, no all-gather of hidden states or weight, d_weight sharded like W."""
    backend = gpu_backend(backend_name)
    h, w, t, _ = gpu_head(rng, weight_layout)
    b = jnp.asarray(rng.standard_normal(GPU_V) * 0.3, jnp.bfloat16)
    rows, vocab = GPU_LAYOUTS[layout]
    fn = functools.partial(_linear_logprobs, backend=backend, weight_layout=weight_layout)
    check_sharded(
        fn,
        (h, w, b, t),
        [(rows, None, None), w_spec(weight_layout, vocab), (vocab,), (rows, None)],
        gpu_mesh(mesh_kind, n_gpus, layout),
        diff=(0, 1, 2),
        big=(0, 1),
        like=((1, 1), (2, 2)),
        low_rel=gpu_low_rel(n_gpus),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpus,layout", GPU_GRID)
@pytest.mark.parametrize("mesh_kind", MESHES)
@pytest.mark.parametrize("backend_name", ["ffi", "pallas"])
def test_gpus_linear_losses(rng, backend_name, mesh_kind, n_gpus, layout):
    backend = gpu_backend(backend_name)
    h, w, t, mask = gpu_head(rng)
    old = jnp.asarray(-np.log(GPU_V) + 0.3 * rng.standard_normal((GPU_B, GPU_T)), jnp.float32)
    ref = jnp.asarray(-np.log(GPU_V) + 0.3 * rng.standard_normal((GPU_B, GPU_T)), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(GPU_B), jnp.float32)
    rows, vocab = GPU_LAYOUTS[layout]
    check_sharded(
        *_linear_losses_case(backend, (h, w, t, old, adv, ref, mask), rows, vocab),
        gpu_mesh(mesh_kind, n_gpus, layout),
        diff=(0, 1),
        big=(0, 1),
        like=((1, 1),),
        low_rel=gpu_low_rel(n_gpus),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n_gpus,layout", GPU_GRID)
@pytest.mark.parametrize("mesh_kind", MESHES)
def test_gpus_logits_ops(rng, mesh_kind, n_gpus, layout):
    """token_logprobs, grpo_loss and ratio_kl on logits split over two or four GPUs (pallas
    kernels)."""
    backend = gpu_backend("pallas")
    n, v = GPU_B * GPU_T, GPU_V
    pol = jnp.asarray(rng.standard_normal((GPU_B, GPU_T, v)) * 2, jnp.bfloat16)
    ref = jnp.asarray(rng.standard_normal((GPU_B, GPU_T, v)) * 2, jnp.bfloat16)
    t = np.asarray(rng.integers(0, v, (GPU_B, GPU_T)), np.int32)
    t[2, 3] = -100
    t = jnp.asarray(t)
    old = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((GPU_B, GPU_T)), jnp.float32)
    rewards = jnp.asarray(rng.standard_normal(GPU_B), jnp.float32)
    mask = jnp.asarray(random_mask(rng, GPU_B, GPU_T, empty_rows=(1,)))
    rows, vocab = GPU_LAYOUTS[layout]
    assert n % 2 == 0

    def fn(pol, ref, t, old, rewards, mask):
        lp, ent = jk.token_logprobs(
            pol, t, return_entropy=True, temperature=1.3, ignore_index=-100, backend=backend
        )
        loss = jk.grpo_loss(
            pol,
            ref,
            jnp.maximum(t, 0),
            old,
            rewards,
            mask,
            group_size=2,
            beta=0.05,
            backend=backend,
        )
        ratio, kl = jk.ratio_kl(pol, ref, jnp.maximum(t, 0), old, mask, backend=backend)
        return lp, ent, loss, ratio, kl

    logit_spec = (rows, None, vocab)
    check_sharded(
        fn,
        (pol, ref, t, old, rewards, mask),
        [logit_spec, logit_spec, (rows, None), (rows, None), (rows,), (rows, None)],
        gpu_mesh(mesh_kind, n_gpus, layout),
        diff=(0,),
        big=(0, 1),
        like=((0, 0),),
        low_rel=gpu_low_rel(n_gpus),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("weight_layout", ["vd", "dv"])
@pytest.mark.parametrize("backend_name", ["ffi", "pallas"])
def test_gpus_vocab_axis(rng, backend_name, weight_layout):
    """A user's shard_map over two GPUs (check_vma=True), the weight split over the vocabulary:
    log-probs and entropies against the float64 oracle and the one-GPU call, gradients taken
    inside the body against the one-GPU call; bad targets NaN, ignored ones 0."""
    backend = gpu_backend(backend_name)
    mesh = gpu_mesh("Explicit")
    h, w, _, _ = gpu_head(rng, weight_layout)
    t = bad_targets(rng, GPU_B, GPU_T, GPU_V)
    kw = dict(
        weight_layout=weight_layout,
        temperature=0.7,
        ignore_index=-100,
        return_entropy=True,
        backend=backend,
    )
    g_lp, g_ent = (jnp.asarray(rng.standard_normal((GPU_B, GPU_T)), jnp.float32) for _ in range(2))
    ws = P("x", None) if weight_layout == "vd" else P(None, "x")

    def loss(h, w, vocab_axis=None):
        lp, ent = jk.linear_logprobs(h, w, t, vocab_axis=vocab_axis, **kw)
        fin = lambda x: jnp.where(jnp.isnan(x), 0.0, x)
        return jnp.sum(fin(lp) * g_lp) + jnp.sum(fin(ent) * g_ent), (lp, ent)

    body = lambda h, w: jax.value_and_grad(
        lambda h, w: loss(h, w, "x"), argnums=(0, 1), has_aux=True
    )(h, w)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), ws), out_specs=((P(), (P(), P())), (P(), ws))
    )
    placed = (
        jax.device_put(h, NamedSharding(mesh, P())),
        jax.device_put(w, NamedSharding(mesh, ws)),
    )
    (_, (lp, ent)), (dh, dw) = jax.jit(mapped)(*placed)
    (_, (lp0, ent0)), (dh0, dw0) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        h, w
    )
    want = oracle.linear_logprobs(
        np.asarray(h, np.float64),
        np.asarray(w, np.float64),
        np.asarray(t),
        weight_layout=weight_layout,
        temperature=0.7,
        ignore_index=-100,
    )
    for got, base, w64, name in ((lp, lp0, want[0], "logp"), (ent, ent0, want[1], "entropy")):
        assert_close(got, w64, in_dtype=jnp.bfloat16, want32=w64, name=name, scale=10.0)
        assert_close(got, np.asarray(base), name=f"{name} vs one GPU")
    assert np.isnan(np.asarray(lp)[0, 1]) and np.isnan(np.asarray(lp)[1, 2])
    assert np.asarray(lp)[3, 4] == 0 and np.asarray(ent)[3, 4] == 0
    for got, base, name in ((dh, dh0, "d_hidden"), (dw, dw0, "d_weight")):
        got, base = np.asarray(got, np.float64), np.asarray(base, np.float64)
        rel = np.linalg.norm(got - base) / np.linalg.norm(base)
        assert rel <= GPU_LOW_REL, f"{name}: {rel:.3e} from the one-GPU call"
    assert full_spec(dw) == full_spec(placed[1])
