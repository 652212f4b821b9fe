"""The fast losses' relative form (``head.relative_probs``): the forward keeps
``E = exp(z − z_t)``, the backward's GEMMs read it with a per-row scale.

Checked here, for the fused losses and ``linear_logprobs`` without the entropy: the form is
taken where it serves and not elsewhere; its accuracy against
float64 and the plain bfloat16 code (``test_fast_accuracy``'s rule) on random and peaked
heads at enough rows to take it; a row whose target lies below ``LOGP_FLOOR`` sends the step
to the recomputed logits and stays exact; ffi's kernel writes what the XLA form writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels.head import relative_probs
from tests.engine import test_fast_accuracy as acc

ROWS = (16, 32)  # 512 rows: relative_probs.MIN_ROWS


@pytest.fixture
def taken(monkeypatch):
    """How many steps wrote the relative form's target entries (one per traced step)."""
    calls = []
    original = relative_probs.with_target_entries

    def counted(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(relative_probs, "with_target_entries", counted)
    return calls


CASES = [
    acc.Case(op, option, "vd", "bf16", 4099, ROWS, False, 48, 64, peaked)
    for op, option in (("grpo", "group"), ("ppo", "default"), ("pg", "token_mean"))
    for peaked in (False, True)
]


@pytest.fixture
def logp_alone(monkeypatch):
    """``test_fast_accuracy``'s ``linear_logprobs`` without the entropy (the relative form's
    case), as the options ``logp`` and ``logp-T0.7-ignore``."""
    options = acc.OPTIONS["logprobs"]
    monkeypatch.setitem(options, "logp", dict(entropy=False))
    monkeypatch.setitem(options, "logp-T0.7-ignore", dict(options["T0.7-ignore"], entropy=False))


LOGPROBS_CASES = [
    acc.Case("logprobs", option, "vd", "bf16", 4099, ROWS, False, 48, 64, peaked)
    for option, peaked in (("logp", False), ("logp", True), ("logp-T0.7-ignore", True))
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_relative_form_accuracy(case, rng, monkeypatch, taken):
    acc.check_case(case, rng, monkeypatch)
    assert taken, "the relative form was not taken"


@pytest.mark.parametrize("case", LOGPROBS_CASES, ids=lambda c: c.id)
def test_linear_logprobs_relative_form_accuracy(case, rng, monkeypatch, taken, logp_alone):
    """``linear_logprobs(memory="fast")`` without the entropy: the same form, its target
    entries written in the backward."""
    acc.check_case(case, rng, monkeypatch)
    assert taken, "the relative form was not taken"


def test_linear_logprobs_keeps_the_logits_with_entropy(rng, monkeypatch, taken):
    case = acc.Case("logprobs", "T1", "vd", "bf16", 4099, ROWS, False, 48, 64, True)
    acc.check_case(case, rng, monkeypatch)
    assert not taken


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        acc.Case(op, option, layout, "bf16", vocab, (32, 64), False, 192, 256, peaked)
        for op, option in (("grpo", "group"), ("pg", "token_mean"), ("logprobs", "logp"))
        for layout, vocab in (("vd", 32003), ("dv", 151936))
        for peaked in (False, True)
    ],
    ids=lambda c: c.id,
)
def test_relative_form_accuracy_gpu(case, rng, monkeypatch, taken, logp_alone):
    acc.check_case(case, rng, monkeypatch)
    assert taken, "the relative form was not taken"


def test_not_taken_below_its_rows_or_with_bias(rng, monkeypatch, taken):
    for rows, bias in (((4, 9), False), (ROWS, True)):
        case = acc.Case("grpo", "group", "vd", "bf16", 4099, rows, bias, 48, 64)
        acc.check_case(case, rng, monkeypatch)
    assert not taken


def test_serves():
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert relative_probs.serves(bf16, None, False, ())
    assert relative_probs.serves(f32, None, False, (), 4096)
    assert not relative_probs.serves(f16, None, False, ())  # E leaves float16's range
    assert not relative_probs.serves(bf16, jnp.zeros(3), False, ())
    assert not relative_probs.serves(bf16, None, True, ())
    assert not relative_probs.serves(bf16, None, False, ("model",))
    assert not relative_probs.serves(bf16, None, False, (), relative_probs.MIN_ROWS - 1)


def low_row_batch(rng, b, t, d, v):
    """Peaked rows (each hidden state points at one token), targets each row's top token but
    the first row's, which is its least likely (~100 nats below)."""
    w = rng.standard_normal((v, d)) / np.sqrt(d)
    h = rng.standard_normal((b, t, d))
    top = rng.integers(0, v, (b, t))
    unit = w[top] / np.sum(w[top] ** 2, -1, keepdims=True) ** 0.5
    h += rng.uniform(6, 12, (b, t, 1)) * unit
    h[0, 0] += 100 * unit[0, 0]
    z = np.einsum("btd,vd->btv", h, w)
    targets = np.argmax(z, -1)
    targets[0, 0] = np.argmin(z[0, 0])
    return h, w, targets, z


def assert_head_grads64(d_hidden, d_weight, z, targets, g, h64, w64):
    """``d_hidden``, ``d_weight`` within 2e-2 (relative norm) of the float64 gradient of
    ``Σ g·logp`` for the logits ``z`` (``test_fast_accuracy.Softmax64``)."""
    dz = acc.Softmax64(z, targets).vjp(g)
    want_h = np.einsum("btv,vd->btd", dz, w64)
    want_w = np.einsum("btv,btd->vd", dz, h64)
    for got, want in ((d_hidden, want_h), (d_weight, want_w)):
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert err < 2e-2, err


@pytest.mark.parametrize("low", [False, True])
def test_low_target_row_is_exact(rng, taken, low):
    b, t, d, v = 16, 32, 48, 4099
    h, w, targets, _ = low_row_batch(rng, b, t, d, v)
    h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    h64, w64 = (np.asarray(x, np.float64) for x in (h16, w16))
    z = np.einsum("btd,vd->btv", h64, w64)  # of the rounded operands: the ratios are 1
    if not low:
        targets[0, 0] = np.argmax(z[0, 0])
    logp64 = acc.log_softmax64(z)
    gap = np.take_along_axis(logp64, targets[..., None], -1)[0, 0, 0]
    assert (gap < relative_probs.LOGP_FLOOR) == low, gap
    mask = jnp.ones((b, t), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    old = jnp.asarray(np.take_along_axis(logp64, targets[..., None], -1)[..., 0], jnp.float32)

    def loss(h, w):
        return jk.linear_ppo_loss(h, w, jnp.asarray(targets), old, adv, mask, memory="fast")[0]

    d_h, d_w = jax.jit(jax.grad(loss, (0, 1)))(h16, w16)
    assert taken
    # float64: d loss / d logp = -A / N on every row (ratio 1, inside the clip)
    g = -np.asarray(adv, np.float64)[:, None] * np.ones((b, t)) / (b * t)
    assert_head_grads64(d_h, d_w, z, targets, g, h64, w64)
    assert np.all(np.isfinite(np.asarray(d_h, np.float32)))


@pytest.mark.parametrize("low", [False, True])
def test_linear_logprobs_low_target_row_is_exact(rng, taken, low):
    """``linear_logprobs``' backward in the relative form, and (``low``) with a target ~100
    nats below its row's top, which sends the step to the float32 logits: the gradient of
    ``Σ g·logp`` against float64."""
    b, t, d, v = 16, 32, 48, 4099
    h, w, targets, _ = low_row_batch(rng, b, t, d, v)
    h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    h64, w64 = (np.asarray(x, np.float64) for x in (h16, w16))
    z = np.einsum("btd,vd->btv", h64, w64)
    if not low:
        targets[0, 0] = np.argmax(z[0, 0])
    gap = acc.log_softmax64(z[0, 0])[targets[0, 0]]
    assert (gap < relative_probs.LOGP_FLOOR) == low, gap
    g = rng.standard_normal((b, t))

    def total(h, w):
        logp = jk.linear_logprobs(h, w, jnp.asarray(targets), memory="fast")
        return jnp.sum(jnp.asarray(g, jnp.float32) * logp)

    d_h, d_w = jax.jit(jax.grad(total, (0, 1)))(h16, w16)
    assert taken
    assert_head_grads64(d_h, d_w, z, targets, g, h64, w64)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_ffi_relative_kept_logits_match_xla(rng, layout):
    from jaxrl_kernels.backends.ffi import linear
    from jaxrl_kernels.head import rounded_logits
    from jaxrl_kernels.sharding.placement import Placement

    n, d, v = 700, 192, 4099 * 8 + 8
    h, w, targets, _ = low_row_batch(rng, 1, n, d, v)
    h = jnp.asarray(h[0], jnp.bfloat16)
    w = jnp.asarray(w if layout == "vd" else w.T, jnp.bfloat16)
    t = jnp.asarray(targets[0], jnp.int32)
    valid = jnp.asarray(rng.random(n) > 0.2)
    off = rounded_logits.target_logits(h, w, None, t, layout, 1.0)
    kw = dict(weight_layout=layout, temperature=0.7, with_entropy=False, exp_offsets=off)
    plan = Placement.single(1)
    got = jax.jit(lambda *a: linear.kept_logits(plan, *a, **kw))(h, w, None, t, valid)
    want = jax.jit(lambda *a: rounded_logits.local_stats(plan, *a, **kw))(h, w, None, t, valid)
    (m, s), _, e = got
    (m_x, s_x), _, e_x = want
    lse, lse_x = m + jnp.log(s), m_x + jnp.log(s_x)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_x), rtol=0, atol=2e-5)
    e, e_x = np.asarray(e, np.float32), np.asarray(e_x, np.float32)
    assert np.all(e[~np.asarray(valid)] == 0)
    finite = np.isfinite(e_x)
    np.testing.assert_allclose(e[finite], e_x[finite], rtol=2**-7, atol=1e-30)


@pytest.mark.parametrize("op", ["grpo", "logp"])
@pytest.mark.parametrize("branches", [True, False])
def test_masked_rows_are_inert(rng, monkeypatch, taken, branches, op):
    """``test_row_skip``'s contract in the relative form (its rows lowered to 0): masked rows'
    contents change nothing, bitwise, and their ``d_hidden`` is exactly 0, with row skipping's
    branches and without them, for ``linear_grpo_loss`` and ``linear_logprobs`` (``logp``: no
    entropy)."""
    from tests.engine import test_row_skip

    monkeypatch.setattr(relative_probs, "MIN_ROWS", 0)
    monkeypatch.setattr(test_row_skip.row_skip, "MIN_ROWS", 0 if branches else 10**9)
    test_row_skip.check_inert(rng, op, "fast", None, 6, 40, 32, 301)
    assert taken


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
@pytest.mark.parametrize("op", ["logp", "grpo"])
def test_relative_form_under_a_rows_split(rng, taken, kind, op):
    """Rows split over 2 devices (512 each, so each device's step takes the form) under
    ``jax.jit`` with Auto and Explicit axes: values and gradients as the unsharded call's
    (``test_sharding.check_sharded``)."""
    from tests.sharding import test_sharding as ts

    mesh = ts.make_mesh(kind)
    b, t, d, v = 4, 256, 32, 1031
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d)) / np.sqrt(d) * 3, jnp.bfloat16)
    acts = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(t // 2, t, (b, 1)), jnp.float32)
    old = jnp.asarray(-rng.uniform(3, 9, (b, t)), jnp.float32)
    rewards = jnp.asarray(rng.standard_normal(b), jnp.float32)

    def fn(h, w, acts, mask):
        if op == "logp":
            targets = jnp.where(mask != 0, acts, -100)
            return jk.linear_logprobs(h, w, targets, ignore_index=-100, memory="fast")
        groups = jk.Groups(size=2)
        # the loss alone: with a cotangent on the metrics too, the backward recomputes the
        # logits and the kept gradient is never made
        return jk.linear_grpo_loss(h, w, acts, old, rewards, mask, groups=groups, memory="fast")[0]

    rows = ("data", None)
    specs = (rows + (None,), None, rows, rows)
    ts.check_sharded(fn, (h, w, acts, mask), specs, mesh, diff=(0, 1), low_rel=2e-2)
    assert (b * t // 2, v) in taken, sorted(set(taken))  # a device's step took it


def test_linear_logprobs_under_a_vocab_axis_keeps_the_logits(rng, taken):
    """Inside ``jax.shard_map`` with ``vocab_axis`` each device holds part of the vocabulary
    (and of the target logits): the form is not taken, and the results are the lean mode's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    n, d, v = 1024, 32, 1030
    h = jax.device_put(
        jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16), NamedSharding(mesh, P())
    )
    w = jax.device_put(
        jnp.asarray(rng.standard_normal((v, d)) / np.sqrt(d) * 3, jnp.bfloat16),
        NamedSharding(mesh, P("model")),
    )
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g = jnp.asarray(rng.standard_normal(n), jnp.float32)

    def total(memory):
        def local(h, w):
            return jk.linear_logprobs(h, w, t, vocab_axis="model", memory=memory)

        split = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("model")), out_specs=P())
        return jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(g * split(h, w)), (0, 1)))(h, w)

    (got, got_grads), (want, want_grads) = total("fast"), total("lean")
    assert not taken
    np.testing.assert_allclose(float(got), float(want), rtol=1e-3)
    for a, b in zip(got_grads, want_grads):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
