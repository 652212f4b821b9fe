"""Bad input: every error docs/api.md lists raises the right type naming the argument; unknown
option strings list the valid ones; out-of-range concrete targets raise naming the first bad
position, traced ones give NaN at exactly those positions; messages say the fix."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk

B, T, V, D = 2, 3, 5, 4
F = jnp.float32


def tok(shape=(B, T), value=-1.0):
    return jnp.full(shape, value, F)


def base_args():
    return dict(
        logits=jnp.zeros((B, T, V)),
        targets=jnp.zeros((B, T), jnp.int32),
        hidden=jnp.ones((B, T, D)),
        weight=jnp.ones((V, D)) * 0.1,
        logp=tok(),
        old_logp=tok(),
        adv=jnp.ones((B, T)),
        mask=jnp.ones((B, T)),
        rewards=jnp.arange(B, dtype=F),
    )


A = base_args()


def call_op(op, **over):
    """Call op with valid small arguments, replacing some (keyword ``over``)."""
    a = dict(A)
    kw = {}
    for key, value in over.items():
        if key in a:
            a[key] = value
        else:
            kw[key] = value
    if op == "token_logprobs":
        return jk.token_logprobs(a["logits"], a["targets"], **kw)
    if op == "linear_logprobs":
        return jk.linear_logprobs(a["hidden"], a["weight"], a["targets"], **kw)
    if op == "kl_penalty":
        return jk.kl_penalty(a["logp"], kw.pop("ref_logp", tok()), **kw)
    if op == "aggregate":
        return jk.aggregate(kw.pop("values", a["logp"]), a["mask"], **kw)
    if op == "group_advantages":
        kw.setdefault("groups", jk.Groups(size=1))
        return jk.group_advantages(a["rewards"], **kw)
    if op == "ppo_loss":
        return jk.ppo_loss(a["logp"], a["old_logp"], a["adv"], a["mask"], **kw)
    if op == "policy_gradient_loss":
        return jk.policy_gradient_loss(a["logp"], a["adv"], a["mask"], **kw)
    if op == "ratio_kl":
        return jk.ratio_kl(
            a["logits"],
            kw.pop("ref_logits", a["logits"]),
            a["targets"],
            a["old_logp"],
            a["mask"],
            **kw,
        )
    if op == "grpo_loss":
        if "advantages" not in kw:
            kw.setdefault("groups", jk.Groups(size=1))
        return jk.grpo_loss(
            a["logits"],
            kw.pop("ref_logits", a["logits"]),
            a["targets"],
            a["old_logp"],
            a["rewards"],
            a["mask"],
            **kw,
        )
    if op == "linear_ppo_loss":
        return jk.linear_ppo_loss(
            a["hidden"], a["weight"], a["targets"], a["old_logp"], a["adv"], a["mask"], **kw
        )
    if op == "linear_grpo_loss":
        if "advantages" not in kw:
            kw.setdefault("groups", jk.Groups(size=1))
        return jk.linear_grpo_loss(
            a["hidden"], a["weight"], a["targets"], a["old_logp"], a["rewards"], a["mask"], **kw
        )
    raise KeyError(op)


def expect(err_type, names, op, **over):
    """``op(**over)`` raises err_type whose message names one of ``names``."""
    names = (names,) if isinstance(names, str) else names
    with pytest.raises(err_type) as info:
        call_op(op, **over)
    msg = str(info.value)
    assert any(n in msg for n in names), f"message does not name {names}: {msg!r}"
    return msg


def test_valid_arguments_work():
    for op in (
        "token_logprobs",
        "linear_logprobs",
        "kl_penalty",
        "aggregate",
        "group_advantages",
        "ppo_loss",
        "policy_gradient_loss",
        "ratio_kl",
        "grpo_loss",
        "linear_ppo_loss",
        "linear_grpo_loss",
    ):
        call_op(op)


# ----------------------------------------------------------------------------- dtype errors

DTYPE_ERRORS = [
    ("token_logprobs", "logits", dict(logits=jnp.zeros((B, T, V), jnp.int32))),
    ("token_logprobs", "targets", dict(targets=jnp.zeros((B, T), F))),
    ("linear_logprobs", "hidden", dict(hidden=jnp.ones((B, T, D), jnp.int32))),
    ("linear_logprobs", "weight", dict(weight=jnp.ones((V, D), jnp.int32))),
    ("linear_logprobs", "targets", dict(targets=jnp.zeros((B, T), F))),
    ("ratio_kl", "actions", dict(targets=jnp.zeros((B, T), F))),
    ("ratio_kl", "policy_logits", dict(logits=jnp.zeros((B, T, V), jnp.int32))),
    ("grpo_loss", "actions", dict(targets=jnp.zeros((B, T), F))),
    ("linear_ppo_loss", "actions", dict(targets=jnp.zeros((B, T), F))),
    ("linear_ppo_loss", "hidden", dict(hidden=jnp.ones((B, T, D), jnp.int32))),
    ("ppo_loss", "logp", dict(logp=jnp.zeros((B, T), jnp.int32))),
]


@pytest.mark.parametrize("op,name,over", DTYPE_ERRORS, ids=[f"{o}-{n}" for o, n, _ in DTYPE_ERRORS])
def test_dtype_errors(op, name, over):
    expect(TypeError, name, op, **over)


# ----------------------------------------------------------------------------- shape / rank errors

SHAPE_ERRORS = [
    ("token_logprobs", "targets", dict(targets=jnp.zeros((B, T + 1), jnp.int32))),
    ("token_logprobs", "logits", dict(logits=jnp.zeros(()))),
    ("linear_logprobs", ("weight", "hidden"), dict(weight=jnp.ones((V, D + 1)))),
    ("linear_logprobs", "weight", dict(weight=jnp.ones((V * D,)))),
    ("linear_logprobs", "bias", dict(bias=jnp.ones((V + 1,)))),
    (
        "linear_logprobs",
        "bias",
        dict(bias=jnp.ones((D,)), weight_layout="dv", weight=jnp.ones((D, V + 1))),
    ),
    ("linear_logprobs", "targets", dict(targets=jnp.zeros((B,), jnp.int32))),
    ("kl_penalty", "ref_logp", dict(ref_logp=tok((B, T + 1)))),
    ("aggregate", "mask", dict(mask=jnp.ones((B, T + 1)))),
    ("aggregate", "values", dict(values=tok((B * T,)))),
    ("group_advantages", "rewards", dict(rewards=jnp.ones((B, 1)))),
    ("ppo_loss", "old_logp", dict(old_logp=tok((B, T + 1)))),
    ("ppo_loss", "advantages", dict(adv=jnp.ones((B + 1,)))),
    ("ppo_loss", "advantages", dict(adv=jnp.ones((B, T + 1)))),
    ("ppo_loss", "mask", dict(mask=jnp.ones((T, B)))),
    ("ppo_loss", "logp", dict(logp=tok((B * T,)), old_logp=tok((B * T,)))),
    ("ppo_loss", "ref_logp", dict(ref_logp=tok((B, T + 1)), kl_coef=0.1)),
    ("ppo_loss", "rollout_logp", dict(rollout_logp=tok((B, 1 + T)), tis_cap=2.0)),
    ("ppo_loss", "entropy", dict(entropy=tok((B, T + 1)), entropy_coef=0.1)),
    ("policy_gradient_loss", "advantages", dict(adv=jnp.ones((B + 1,)))),
    ("policy_gradient_loss", "mask", dict(mask=jnp.ones((B, T + 2)))),
    ("ratio_kl", "ref_logits", dict(ref_logits=jnp.zeros((B, T, V + 1)))),
    ("ratio_kl", "policy_logits", dict(logits=jnp.zeros((B * T, V)))),
    ("ratio_kl", "actions", dict(targets=jnp.zeros((B, T + 1), jnp.int32))),
    ("ratio_kl", "old_logp", dict(old_logp=tok((B, T + 1)))),
    ("ratio_kl", "mask", dict(mask=jnp.ones((B, T + 1)))),
    ("grpo_loss", "rewards", dict(rewards=jnp.ones((B + 1,)), groups=jk.Groups(size=1))),
    ("grpo_loss", "advantages", dict(advantages=jnp.ones((B + 1,)))),
    ("grpo_loss", "mask", dict(mask=jnp.ones((B, T + 1)))),
    ("linear_ppo_loss", "hidden", dict(hidden=jnp.ones((B * T, D)))),
    ("linear_ppo_loss", ("weight", "hidden"), dict(weight=jnp.ones((V, D + 2)))),
    ("linear_ppo_loss", "actions", dict(targets=jnp.zeros((B, T + 1), jnp.int32))),
    ("linear_ppo_loss", "old_logp", dict(old_logp=tok((B, T + 1)))),
    ("linear_ppo_loss", "bias", dict(bias=jnp.ones((V + 2,)))),
    ("linear_grpo_loss", "ref_logp", dict(ref_logp=tok((B, T + 1)), beta=0.1)),
    ("linear_grpo_loss", "rewards", dict(rewards=jnp.ones((B + 1,)))),
]


@pytest.mark.parametrize(
    "op,names,over",
    SHAPE_ERRORS,
    ids=[
        f"{o}-{n if isinstance(n, str) else n[0]}-{i}" for i, (o, n, _) in enumerate(SHAPE_ERRORS)
    ],
)
def test_shape_errors(op, names, over):
    msg = expect(ValueError, names, op, **over)
    assert re.search(r"\d", msg), f"message gives no shape: {msg!r}"


# ----------------------------------------------------------------------------- option strings


OPTION_ERRORS = [
    ("kl_penalty", "estimator", dict(estimator="k4"), ("k1", "abs", "k2", "k3")),
    (
        "ppo_loss",
        "kl_estimator",
        dict(kl_estimator="kl", ref_logp=tok(), kl_coef=0.1),
        ("k1", "abs", "k2", "k3"),
    ),
    ("ratio_kl", "kl_estimator", dict(kl_estimator="K3"), ("k1", "abs", "k2", "k3")),
    ("grpo_loss", "kl_estimator", dict(kl_estimator="mse"), ("k1", "abs", "k2", "k3")),
    (
        "aggregate",
        "mode",
        dict(mode="mean"),
        ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
    ),
    (
        "ppo_loss",
        "loss_agg_mode",
        dict(loss_agg_mode="sum"),
        ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
    ),
    ("policy_gradient_loss", "loss_agg_mode", dict(loss_agg_mode="avg"), ("token_mean",)),
    ("grpo_loss", "loss_agg_mode", dict(loss_agg_mode="x"), ("token_mean",)),
    ("linear_grpo_loss", "loss_agg_mode", dict(loss_agg_mode="x"), ("token_mean",)),
    ("linear_logprobs", "weight_layout", dict(weight_layout="dv2"), ("vd", "dv")),
    ("linear_ppo_loss", "weight_layout", dict(weight_layout="VD"), ("vd", "dv")),
    ("token_logprobs", "backend", dict(backend="gpu"), ("reference", "chunked")),
]


@pytest.mark.parametrize(
    "op,name,over,valid", OPTION_ERRORS, ids=[f"{o}-{n}" for o, n, _, _ in OPTION_ERRORS]
)
def test_unknown_option_lists_valid(op, name, over, valid):
    msg = expect(ValueError, name, op, **over)
    for v in valid:
        assert v in msg, f"valid option {v!r} not listed: {msg!r}"


# ----------------------------------------------------------------------------- numeric ranges

RANGE_ERRORS = [
    (op, name, value)
    for op in ("ppo_loss", "grpo_loss", "linear_ppo_loss", "linear_grpo_loss")
    for name, value in (
        ("clip_low", -0.1),
        ("clip_low", 1.0),
        ("clip_low", 1.5),
        ("clip_high", 0.0),
        ("clip_high", -0.2),
        ("dual_clip", 1.0),
        ("dual_clip", 0.5),
    )
]
RANGE_ERRORS += [
    ("ppo_loss", "tis_cap", 0.0),
    ("ppo_loss", "tis_cap", -1.0),
    ("linear_ppo_loss", "tis_cap", 0.0),
]
RANGE_ERRORS += [
    (op, "temperature", t)
    for op in ("token_logprobs", "linear_logprobs", "ratio_kl", "linear_ppo_loss")
    for t in (0.0, -1.0)
]


@pytest.mark.parametrize("op,name,value", RANGE_ERRORS)
def test_option_ranges(op, name, value):
    over = {name: value}
    if name == "tis_cap":
        over["rollout_logp"] = tok()
    expect(ValueError, name, op, **over)


@pytest.mark.parametrize(
    "name,value",
    [
        ("clip_low", 0.0),
        ("clip_low", 0.99),
        ("clip_high", 5.0),
        ("dual_clip", 1.01),
        ("tis_cap", 1e-3),
    ],
)
def test_option_range_edges_accepted(name, value):
    over = {name: value}
    if name == "tis_cap":
        over["rollout_logp"] = tok()
    call_op("ppo_loss", **over)


# ----------------------------------------------------------------------------- groups


GROUP_ERRORS = [
    ("groups.size", dict(size=3)),  # does not divide B = 2
    ("groups: give exactly one", dict(size=1, boundaries=jnp.asarray([0, 2]))),
    ("groups: give exactly one", dict()),
    ("groups.boundaries", dict(boundaries=jnp.asarray([1, 2]))),
    ("groups.boundaries", dict(boundaries=jnp.asarray([0, 1]))),
    ("groups.boundaries", dict(boundaries=jnp.asarray([0, 1, 1, 2]))),
    ("groups.boundaries", dict(boundaries=jnp.asarray([0, 2, 1, 2]))),
    ("groups.boundaries", dict(boundaries=jnp.asarray([[0, 2]]))),
]


@pytest.mark.parametrize(
    "names,groups", GROUP_ERRORS, ids=[str(i) for i in range(len(GROUP_ERRORS))]
)
@pytest.mark.parametrize("op", ["group_advantages", "grpo_loss"])
def test_group_errors(op, names, groups):
    expect(ValueError, names, op, groups=jk.Groups(**groups))


def test_group_size_checked_when_built():
    with pytest.raises(ValueError, match=r"^size: expected a positive int or None, got 0"):
        jk.Groups(size=0)


def test_group_neither_given():
    with pytest.raises(ValueError) as info:
        jk.group_advantages(jnp.ones(4))
    assert "groups" in str(info.value) and "jk.Groups" in str(info.value)
    with pytest.raises(ValueError, match=r"^groups: expected a jk.Groups .* or advantages="):
        call_op("grpo_loss", groups=None)


# ----------------------------------------------------------------------------- target range

BAD_POS = (1, 2)


def _bad_targets(value, vocab=V):
    t = np.zeros((B, T), np.int32)
    t[0, 1] = vocab - 1  # the largest valid id
    t[BAD_POS] = value
    return t


@pytest.mark.parametrize("value", [V, V + 7, -1, -(2**31)])
@pytest.mark.parametrize(
    "op",
    [
        "token_logprobs",
        "linear_logprobs",
        "ratio_kl",
        "grpo_loss",
        "linear_ppo_loss",
        "linear_grpo_loss",
    ],
)
def test_concrete_out_of_range_targets_raise(backend, op, value):
    name = "targets" if op in ("token_logprobs", "linear_logprobs") else "actions"
    t = _bad_targets(value)
    t[1, 0] = value  # the first bad position (row-major) is (1, 0)
    msg = expect(ValueError, name, op, targets=jnp.asarray(t), backend=backend)
    assert re.search(r"[\(\[]\s*1\s*,\s*0\s*[\)\]]", msg) or re.search(r"\b3\b", msg), (
        f"message does not name the first bad position (1, 0): {msg!r}"
    )


def test_ignore_index_out_of_range_is_fine(backend):
    t = jnp.asarray(_bad_targets(-100))
    out = jk.token_logprobs(A["logits"], t, ignore_index=-100, backend=backend)
    assert float(out[BAD_POS]) == 0.0


def test_masked_bad_actions_are_never_used(backend):
    """ratio_kl: where mask == 0 the action id is never used (no error, ratio 1, kl 0)."""
    t = jnp.asarray(_bad_targets(V + 3))
    mask = jnp.ones((B, T)).at[BAD_POS].set(0)
    ratio, kl = jk.ratio_kl(A["logits"], A["logits"], t, A["old_logp"], mask, backend=backend)
    assert float(ratio[BAD_POS]) == 1.0 and float(kl[BAD_POS]) == 0.0
    assert np.isfinite(np.asarray(ratio)).all()


@pytest.mark.parametrize("value", [V, -1, 2**30])
def test_traced_out_of_range_targets_give_nan(backend, value):
    t = jnp.asarray(_bad_targets(value))
    bad = np.zeros((B, T), bool)
    bad[BAD_POS] = True
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, V)), F)

    lp, ent = jax.jit(lambda l, t: jk.token_logprobs(l, t, return_entropy=True, backend=backend))(
        logits, t
    )
    for name, x in (("logp", lp), ("entropy", ent)):
        x = np.asarray(x)
        assert np.array_equal(np.isnan(x), bad), f"token_logprobs {name}: NaN not at {BAD_POS}"

    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, D)), F)
    lp, ent = jax.jit(
        lambda h, w, t: jk.linear_logprobs(h, w, t, return_entropy=True, backend=backend)
    )(hidden, A["weight"], t)
    for name, x in (("logp", lp), ("entropy", ent)):
        x = np.asarray(x)
        assert np.array_equal(np.isnan(x), bad), f"linear_logprobs {name}: NaN not at {BAD_POS}"

    fn = lambda l, t, m: jk.ratio_kl(l, l * 0.5, t, A["old_logp"], m, backend=backend)
    ratio, kl = jax.jit(fn)(logits, t, A["mask"])
    for name, x in (("ratio", ratio), ("kl", kl)):
        x = np.asarray(x)
        assert np.array_equal(np.isnan(x), bad), f"ratio_kl {name}: NaN not exactly at {BAD_POS}"


def test_traced_out_of_range_actions_poison_losses(backend):
    """Under jit, a bad action at a valid token makes the losses NaN (never silently zero)."""
    t = jnp.asarray(_bad_targets(V + 1))
    loss, _ = jax.jit(
        lambda t: jk.linear_ppo_loss(
            A["hidden"], A["weight"], t, A["old_logp"], A["adv"], A["mask"], backend=backend
        )
    )(t)
    assert np.isnan(float(loss))
    outs = jax.jit(
        lambda t: jk.grpo_loss(
            A["logits"],
            A["logits"],
            t,
            A["old_logp"],
            A["rewards"],
            A["mask"],
            groups=jk.Groups(size=1),
            backend=backend,
        )
    )(t)
    assert np.isnan(float(outs[0]))


def test_nan_inputs_propagate():
    """NaN in inputs propagates; nothing is silently zeroed."""
    logp = tok().at[0, 1].set(jnp.nan)
    loss, metrics = jk.ppo_loss(logp, A["old_logp"], A["adv"], A["mask"])
    assert np.isnan(float(loss)) and np.isnan(float(metrics["ratio_mean"]))
    assert np.isnan(float(jk.aggregate(logp, A["mask"])))
    assert np.isnan(np.asarray(jk.kl_penalty(logp, tok()))[0, 1])


# ----------------------------------------------------------------------------- messages that say the fix


@pytest.mark.parametrize(
    "layout,weight,fits",
    [
        ("vd", jnp.ones((D, V)), "dv"),  # a [D, V] Dense kernel passed as the default "vd"
        ("dv", jnp.ones((V, D)), "vd"),  # a [V, D] embedding passed as "dv"
    ],
)
@pytest.mark.parametrize("op", ["linear_logprobs", "linear_ppo_loss", "linear_grpo_loss"])
def test_weight_in_the_other_layout_names_it(op, layout, weight, fits):
    msg = expect(ValueError, "weight", op, weight=weight, weight_layout=layout)
    assert f"weight_layout={fits!r}" in msg, msg
    assert f"({weight.shape[0]}, {weight.shape[1]})" in msg, msg


def test_weight_fitting_no_layout_suggests_none():
    msg = expect(ValueError, "weight", "linear_logprobs", weight=jnp.ones((V, D + 1)))
    assert "'dv'" not in msg and str(D) in msg, msg


@pytest.mark.parametrize(
    "op,name,over",
    [
        ("token_logprobs", "logits", dict(logits=jnp.zeros(()), targets=jnp.zeros((), jnp.int32))),
        ("linear_logprobs", "hidden", dict(hidden=jnp.ones(()), targets=jnp.zeros((), jnp.int32))),
    ],
)
def test_scalar_logits_say_at_least_1d(op, name, over):
    msg = expect(ValueError, name, op, **over)
    assert "at least 1-D" in msg and " or " not in msg, msg


MASK_OPS = [
    "aggregate",
    "ppo_loss",
    "policy_gradient_loss",
    "ratio_kl",
    "grpo_loss",
    "linear_ppo_loss",
    "linear_grpo_loss",
]


@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, np.nan])
@pytest.mark.parametrize("op", MASK_OPS)
def test_concrete_mask_outside_0_1_raises(op, value):
    mask = np.ones((B, T), np.float32)
    mask[1, 2] = value
    msg = expect(ValueError, "mask", op, mask=jnp.asarray(mask))
    assert "(1, 2)" in msg and "0 or 1" in msg, msg


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8])
@pytest.mark.parametrize("op", MASK_OPS)
def test_mask_of_0_and_1_accepted_in_any_dtype(op, dtype):
    mask = jnp.asarray(np.array([[1, 0, 1], [0, 1, 1]]), dtype)
    call_op(op, mask=mask)


def test_integer_mask_outside_0_1_raises():
    expect(ValueError, "mask", "aggregate", mask=jnp.full((B, T), 2, jnp.int32))


def test_traced_mask_is_not_checked():
    """Under jit the values cannot be seen: a 0.5 weight is applied as given."""
    mask = jnp.asarray([[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    got = jax.jit(lambda m: jk.aggregate(A["logp"] * 0 + 2.0, m))(mask)
    assert float(got) == pytest.approx(2.0 * 1.5 / 1.5)
