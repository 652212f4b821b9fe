"""The options as values (docs/api.md "Options as values"): ``jk.PolicyLoss``, ``jk.Groups``,
``jk.Sampler``, ``jk.DistillLoss``, ``jk.TopKDistillLoss``, and the deprecated keywords.

``config=`` gives every policy loss the values and gradients of the same options passed as
the deprecated keywords (with one ``DeprecationWarning`` naming the value to pass); each bad
value raises from the value's constructor the very error the op's keyword raised; a deprecated
keyword next to the value it belongs to, an attribute the op has no term for, or a value of
another type raises naming it; an unknown keyword is Python's ``TypeError``; the checks
between options and arrays stay in the op.
"""

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk

B, T, V, D = 4, 6, 11, 8


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    logits = f32(B, T, V)
    actions = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8, jnp.float32).at[:, 0].set(1.0)
    logp = jk.token_logprobs(logits, actions)
    shift = lambda scale: logp + scale * f32(B, T)
    return dict(
        logits=logits,
        ref_logits=logits + 0.3 * f32(B, T, V),
        actions=actions,
        mask=mask,
        logp=logp,
        old_logp=shift(0.3),
        rollout_logp=shift(0.4),
        ref_logp=shift(0.5),
        entropy=jnp.abs(f32(B, T)),
        adv=f32(B, T),
        rewards=f32(B),
        hidden=f32(B, T, D),
        weight=0.5 * f32(V, D),
    )


# -- the ops, each as a function of its differentiable inputs --------------------------------


def rollout(d, kw):
    """The sampler's log-probs when the options have a tis_cap (they need each other)."""
    cap = kw.get("tis_cap")
    if cap is None:
        cap = getattr(kw.get("config"), "tis_cap", None)
    return None if cap is None else d["rollout_logp"]


def ppo(d, **kw):
    return jax.value_and_grad(
        lambda lp, ent: jk.ppo_loss(
            lp,
            d["old_logp"],
            d["adv"],
            d["mask"],
            rollout_logp=rollout(d, kw),
            ref_logp=d["ref_logp"],
            entropy=ent,
            **kw,
        )[0],
        argnums=(0, 1),
    )(d["logp"], d["entropy"])


def grpo(d, **kw):
    return jax.value_and_grad(
        lambda z: jk.grpo_loss(
            z,
            d["ref_logits"],
            d["actions"],
            d["old_logp"],
            d["rewards"],
            d["mask"],
            groups=jk.Groups(size=2),
            rollout_logp=rollout(d, kw),
            **kw,
        )[0]
    )(d["logits"])


def linear_ppo(d, memory="lean", **kw):
    return jax.value_and_grad(
        lambda h, w: jk.linear_ppo_loss(
            h,
            w,
            d["actions"],
            d["old_logp"],
            d["adv"],
            d["mask"],
            rollout_logp=rollout(d, kw),
            ref_logp=d["ref_logp"],
            memory=memory,
            **kw,
        )[0],
        argnums=(0, 1),
    )(d["hidden"], d["weight"])


def linear_grpo(d, memory="lean", **kw):
    return jax.value_and_grad(
        lambda h, w: jk.linear_grpo_loss(
            h,
            w,
            d["actions"],
            d["old_logp"],
            d["rewards"],
            d["mask"],
            ref_logp=d["ref_logp"],
            groups=jk.Groups(size=2),
            rollout_logp=rollout(d, kw),
            memory=memory,
            **kw,
        )[0],
        argnums=(0, 1),
    )(d["hidden"], d["weight"])


def pg(d, **kw):
    return jax.value_and_grad(lambda lp: jk.policy_gradient_loss(lp, d["adv"], d["mask"], **kw))(
        d["logp"]
    )


def linear_pg(d, memory="lean", **kw):
    return jax.value_and_grad(
        lambda h, w: jk.linear_policy_gradient_loss(
            h, w, d["actions"], d["adv"], d["mask"], memory=memory, **kw
        ),
        argnums=(0, 1),
    )(d["hidden"], d["weight"])


PPO_CASES = [
    dict(
        clip_low=0.1,
        clip_high=0.28,
        dual_clip=3.0,
        tis_cap=1.5,
        kl_coef=0.05,
        kl_estimator="k2",
        entropy_coef=0.01,
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=9,
    ),
    dict(
        clip_low=0.05,
        clip_high=0.1,
        tis_cap=2.0,
        kl_coef=0.1,
        kl_estimator="abs",
        loss_agg_mode="sequence_mean",
        ratio_level="sequence",
        policy_loss="cispo",
        tis_level="sequence",
        tis_mode="mask",
    ),
]
GRPO_CASES = [
    dict(
        clip_low=0.1,
        clip_high=0.28,
        dual_clip=3.0,
        tis_cap=1.5,
        beta=0.05,
        kl_estimator="k1",
        loss_agg_mode="seq_mean_token_sum",
    ),
    dict(
        clip_high=0.1,
        tis_cap=2.0,
        beta=0.1,
        loss_agg_mode="seq_mean_token_mean",
        ratio_level="sequence",
        policy_loss="cispo",
        tis_level="sequence",
        tis_mode="mask",
    ),
]
PG_CASES = [
    dict(loss_agg_mode="seq_mean_token_sum_norm", max_len=9),
    dict(loss_agg_mode="seq_mean_token_sum"),
]

# (op, cases, the options every call takes as keywords)
OPS = {
    "ppo_loss": (ppo, PPO_CASES, {}),
    "linear_ppo_loss": (linear_ppo, PPO_CASES, {}),
    "linear_ppo_loss_fast": (linear_ppo, PPO_CASES, dict(memory="fast")),
    "grpo_loss": (grpo, GRPO_CASES, {}),
    "linear_grpo_loss": (linear_grpo, GRPO_CASES, {}),
    "linear_grpo_loss_fast": (linear_grpo, GRPO_CASES, dict(memory="fast")),
    "policy_gradient_loss": (pg, PG_CASES, {}),
    "linear_policy_gradient_loss": (linear_pg, PG_CASES, {}),
    "linear_policy_gradient_loss_fast": (linear_pg, PG_CASES, dict(memory="fast")),
}


def as_config(options):
    options = dict(options)
    if "beta" in options:
        options["kl_coef"] = options.pop("beta")
    return jk.PolicyLoss(**options)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def deprecated_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with deprecated keywords: it warns once, naming the value."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    ours = [
        w
        for w in caught
        if issubclass(w.category, DeprecationWarning) and "jaxrl_kernels 0.3" in str(w.message)
    ]
    assert ours, "no DeprecationWarning for the old keywords"
    assert len({str(w.message) for w in ours}) == 1, [str(w.message) for w in ours]
    # attributed to the caller's line (here, or a helper of this file), not to the library
    assert {w.filename for w in ours} == {__file__}, [(w.filename, w.lineno) for w in ours]
    return out


@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.parametrize("name", list(OPS))
def test_config_equals_deprecated_keywords(data, name, case):
    fn, cases, fixed = OPS[name]
    if case >= len(cases):
        pytest.skip("one case")
    options = cases[case]
    by_keyword = deprecated_call(fn, data, **fixed, **options)
    by_config = fn(data, **fixed, config=as_config(options))
    assert_same(by_keyword, by_config)
    # The options matter: the default config gives another loss.
    assert float(fn(data, **fixed)[0]) != float(by_config[0])


def linear_grpo_arrays(d):
    """``linear_grpo_loss``'s positional arrays: hidden, weight, actions, old_logp, rewards,
    mask."""
    return d["hidden"], d["weight"], d["actions"], d["old_logp"], d["rewards"], d["mask"]


def test_deprecation_message_names_the_values(data):
    d = data
    with pytest.warns(DeprecationWarning) as record:
        jk.linear_grpo_loss(*linear_grpo_arrays(d), group_size=2, clip_high=0.28, top_k=5)
    message = next(str(w.message) for w in record if "0.3" in str(w.message))
    assert message == (
        "linear_grpo_loss: the keywords clip_high=, group_size=, top_k= are deprecated and will "
        "be removed in jaxrl_kernels 0.3; pass config=jk.PolicyLoss(clip_high=...), "
        "groups=jk.Groups(size=...), sampler=jk.Sampler(top_k=...)"
    )


@pytest.mark.parametrize("transform", ["eager", "jit", "grad"])
def test_deprecation_warning_names_the_callers_line(data, transform):
    """The warning is attributed to the line that calls the op (Python's default filters
    hide a DeprecationWarning attributed to a library file), also while jax.jit or jax.grad
    traces the caller: for an op that reads its keywords through the policy options
    (ppo_loss, linear_grpo_loss) and for one that reads them itself (group_advantages)."""
    d = data
    lines = {}

    def losses(logp):
        lines["ppo"] = inspect.currentframe().f_lineno + 1
        pg = jk.ppo_loss(logp, d["old_logp"], d["adv"], d["mask"], clip_high=0.3)[0]
        lines["groups"] = inspect.currentframe().f_lineno + 1
        adv = jk.group_advantages(d["rewards"], group_size=2)
        lines["linear"] = inspect.currentframe().f_lineno + 1
        grpo = jk.linear_grpo_loss(*linear_grpo_arrays(d), clip_low=0.1, group_size=2)[0]
        return pg + adv.sum() + grpo

    run = {"eager": losses, "jit": jax.jit(losses), "grad": jax.grad(losses)}[transform]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(d["logp"])
    ours = [w for w in caught if "jaxrl_kernels 0.3" in str(w.message)]
    assert sorted((w.filename, w.lineno) for w in ours) == sorted(
        (__file__, line) for line in lines.values()
    ), [(w.filename, w.lineno, str(w.message)[:40]) for w in ours]


def test_ppo_metrics_equal(data):
    d, options = data, PPO_CASES[0]
    args = (d["logp"], d["old_logp"], d["adv"], d["mask"])
    arrays = dict(rollout_logp=d["rollout_logp"], ref_logp=d["ref_logp"], entropy=d["entropy"])
    assert_same(
        deprecated_call(jk.ppo_loss, *args, **arrays, **options),
        jk.ppo_loss(*args, **arrays, config=jk.PolicyLoss(**options)),
    )


def test_grpo_max_len_from_config(data):
    """The GRPO losses' max_len comes from their config."""
    config = jk.PolicyLoss(loss_agg_mode="seq_mean_token_sum_norm", max_len=2 * T)
    half = grpo(data, config=config)[0]
    full = grpo(data, config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_sum_norm"))[0]
    np.testing.assert_allclose(float(half), float(full) / 2, rtol=1e-6)


def test_config_under_jit_as_static_argument(data):
    d = data
    fn = jax.jit(
        lambda lp, config: jk.ppo_loss(lp, d["old_logp"], d["adv"], d["mask"], config=config)[0],
        static_argnames="config",
    )
    config = jk.PolicyLoss(clip_high=0.28, loss_agg_mode="seq_mean_token_mean")
    assert hash(config) == hash(jk.PolicyLoss(clip_high=0.28, loss_agg_mode="seq_mean_token_mean"))
    want = jk.ppo_loss(d["logp"], d["old_logp"], d["adv"], d["mask"], config=config)[0]
    np.testing.assert_allclose(float(fn(d["logp"], config)), float(want), rtol=1e-6)


# -- bad values: PolicyLoss raises what the op's keyword raises --------------------------------

BAD = [
    dict(clip_low=-0.1),
    dict(clip_low=1.0),
    dict(clip_high=0.0),
    dict(clip_high=-0.2),
    dict(dual_clip=1.0),
    dict(dual_clip=0.5),
    dict(tis_cap=0.0),
    dict(tis_cap=-1.0),
    dict(kl_estimator="k4"),
    dict(loss_agg_mode="sum"),
    dict(max_len=0),
    dict(max_len=1.5),
    dict(ratio_level="bogus"),
    dict(policy_loss="bogus"),
    dict(tis_level="bogus"),
    dict(tis_mode="bogus"),
    dict(policy_loss="cispo", dual_clip=3.0),
]
PG_KEYWORDS = ("loss_agg_mode", "max_len")
GRPO_KEYWORDS = (
    "clip_low",
    "clip_high",
    "dual_clip",
    "tis_cap",
    "kl_estimator",
    "loss_agg_mode",
    "ratio_level",
    "policy_loss",
    "tis_level",
    "tis_mode",
)
TAKES = {
    "ppo_loss": None,
    "linear_ppo_loss": None,
    "grpo_loss": GRPO_KEYWORDS,
    "linear_grpo_loss": GRPO_KEYWORDS,
    "policy_gradient_loss": PG_KEYWORDS,
    "linear_policy_gradient_loss": PG_KEYWORDS,
}
CALLS = {
    "ppo_loss": ppo,
    "linear_ppo_loss": linear_ppo,
    "grpo_loss": grpo,
    "linear_grpo_loss": linear_grpo,
    "policy_gradient_loss": pg,
    "linear_policy_gradient_loss": linear_pg,
}


def error_of(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError) as info:
            fn(*args, **kwargs)
    return str(info.value).split("\n")[0]  # without a note JAX may add under jax.grad


@pytest.mark.parametrize("bad", BAD, ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()))
def test_bad_value_raises_from_the_config_as_from_the_op(data, bad):
    message = error_of(jk.PolicyLoss, **bad)
    name = "dual_clip" if len(bad) == 2 else next(iter(bad))
    assert message.startswith(f"{name}:"), message
    for op, keywords in TAKES.items():
        if keywords is None or all(k in keywords for k in bad):
            assert error_of(CALLS[op], data, **bad) == message, op


def test_messages_as_documented():
    assert error_of(jk.PolicyLoss, clip_low=1.5) == (
        "clip_low: expected a value in [0.0, 1.0), got 1.5"
    )
    message = error_of(jk.PolicyLoss, kl_estimator="k4")
    assert all(v in message for v in ("k1", "abs", "k2", "k3")), message
    config = jk.PolicyLoss(clip_high=0.28)
    with pytest.raises(ValueError, match=r"^clip_low: expected a value in"):
        dataclasses.replace(config, clip_low=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip_high = 0.3


# -- config= next to keywords, unused attributes, the type -------------------------------------


@pytest.mark.parametrize("op", list(CALLS))
def test_config_and_a_deprecated_keyword_is_an_error(data, op):
    keyword, attribute = {
        "grpo_loss": ("beta", "kl_coef"),
        "linear_grpo_loss": ("beta", "kl_coef"),
        "policy_gradient_loss": ("max_len", "max_len"),
        "linear_policy_gradient_loss": ("max_len", "max_len"),
    }.get(op, ("clip_high", "clip_high"))
    message = error_of(CALLS[op], data, config=jk.PolicyLoss(), **{keyword: 0.1})
    assert message == (
        f"{keyword}: given with config=; set it in the PolicyLoss instead "
        f"(dataclasses.replace(config, {attribute}=...))"
    )


@pytest.mark.parametrize("op", list(CALLS))
def test_unknown_keyword_is_a_type_error(data, op):
    with pytest.raises(
        TypeError,
        match=rf"^{op.removesuffix('_fast')}\(\) got an unexpected "
        r"keyword argument 'clip_hgh'",
    ):
        CALLS[op](data, clip_hgh=0.28)


@pytest.mark.parametrize(
    "op,attribute,value",
    [
        ("grpo_loss", "entropy_coef", 0.01),
        ("linear_grpo_loss", "entropy_coef", 0.01),
        ("policy_gradient_loss", "clip_high", 0.28),
        ("policy_gradient_loss", "kl_coef", 0.1),
        ("linear_policy_gradient_loss", "ratio_level", "sequence"),
    ],
)
def test_attribute_the_op_has_no_term_for(data, op, attribute, value):
    config = jk.PolicyLoss(**{attribute: value})
    default = getattr(jk.PolicyLoss(), attribute)
    assert error_of(CALLS[op], data, config=config) == (
        f"config: {op} has no term for {attribute}; expected its default {default!r}, got {value!r}"
    )


@pytest.mark.parametrize("op", list(CALLS))
def test_config_of_another_type(data, op):
    with pytest.raises(
        TypeError,
        match=r"^config: expected a jaxrl_kernels.PolicyLoss or None, "
        r"got dict(\n|$)",
    ):
        CALLS[op](data, config={"clip_high": 0.28})


# -- the checks between options and arrays stay in the op ------------------------------------


def test_option_array_pairs_checked_by_the_op(data):
    d = data
    args = (d["logp"], d["old_logp"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match=r"^rollout_logp / tis_cap:"):
        jk.ppo_loss(*args, config=jk.PolicyLoss(tis_cap=2.0))
    with pytest.raises(ValueError, match=r"^rollout_logp / tis_cap:"):
        jk.ppo_loss(*args, rollout_logp=d["rollout_logp"], config=jk.PolicyLoss())
    with pytest.raises(ValueError, match=r"^ref_logp: required when kl_coef != 0 \(kl_coef=0.1\)"):
        jk.ppo_loss(*args, config=jk.PolicyLoss(kl_coef=0.1))
    with pytest.raises(ValueError, match=r"^entropy: required when entropy_coef != 0"):
        jk.ppo_loss(*args, config=jk.PolicyLoss(entropy_coef=0.01))
    with pytest.raises(ValueError, match=r"^ref_logp: required when kl_coef != 0 \(kl_coef=0.1\)"):
        jk.linear_grpo_loss(
            d["hidden"],
            d["weight"],
            d["actions"],
            d["old_logp"],
            d["rewards"],
            d["mask"],
            groups=jk.Groups(size=2),
            config=jk.PolicyLoss(kl_coef=0.1),
        )
    with pytest.raises(ValueError, match=r"^groups: expected a jk.Groups"):
        jk.linear_grpo_loss(
            d["hidden"], d["weight"], d["actions"], d["old_logp"], d["rewards"], d["mask"]
        )
    jk.linear_ppo_loss(
        d["hidden"],
        d["weight"],
        d["actions"],
        d["old_logp"],
        d["adv"],
        d["mask"],
        config=jk.PolicyLoss(entropy_coef=0.01),
    )  # computes its entropy


def test_policy_loss_module_holds_only_public_ops():
    from jaxrl_kernels.ops import losses

    for name in (
        "ppo_config",
        "grpo_config",
        "policy_variants",
        "_policy_options",
        "run_ppo",
        "grpo_advantages",
        "grpo_from_logprobs",
        "compute_group_advantages",
    ):
        assert not hasattr(losses, name) or getattr(losses, name).__module__ != losses.__name__


# -- Groups, Sampler, DistillLoss, TopKDistillLoss -----------------------------------------------


def test_groups_equal_the_deprecated_keywords(data):
    rewards = data["rewards"]
    got = jk.group_advantages(rewards, groups=jk.Groups(size=2, normalize_std=False))
    want = deprecated_call(jk.group_advantages, rewards, group_size=2, normalize_std=False)
    assert_same(got, want)
    bounds = jnp.array([0, 1, 4])
    got = jk.group_advantages(rewards, groups=jk.Groups(boundaries=bounds, std_ddof=1, eps=0.1))
    want = deprecated_call(
        jk.group_advantages, rewards, group_boundaries=bounds, std_ddof=1, eps=0.1
    )
    assert_same(got, want)


def test_groups_is_a_pytree_with_traced_boundaries(data):
    rewards = data["rewards"]
    fn = jax.jit(lambda r, groups: jk.group_advantages(r, groups=groups))
    groups = jk.Groups(boundaries=jnp.array([0, 3, 4]), normalize_std=False)
    assert jax.tree.leaves(groups) == [groups.boundaries]
    want = jk.group_advantages(rewards, groups=groups)
    np.testing.assert_allclose(np.asarray(fn(rewards, groups)), np.asarray(want), rtol=1e-6)
    bad = jk.Groups(boundaries=jnp.array([0, 3, 3]))
    assert np.isnan(np.asarray(fn(rewards, bad))).all()  # traced: NaN, as documented


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(size=0), "size: expected a positive int or None, got 0"),
        (dict(size=2, std_ddof=-1), "std_ddof: expected a non-negative int, got -1"),
    ],
)
def test_groups_bad_values(bad, message):
    assert error_of(jk.Groups, **bad) == message


def test_groups_errors_from_the_op(data):
    rewards = data["rewards"]
    assert error_of(jk.group_advantages, rewards, groups=jk.Groups(size=3)) == (
        "groups.size: expected a positive int dividing B = 4, got 3"
    )
    assert error_of(jk.group_advantages, rewards, groups=jk.Groups()).startswith(
        "groups: give exactly one of size and boundaries"
    )
    assert error_of(
        jk.group_advantages, rewards, groups=jk.Groups(boundaries=jnp.array([0, 5]))
    ).startswith("groups.boundaries: expected strictly")


def test_sampler_equals_the_deprecated_keywords(data):
    d = data
    got = jk.linear_logprobs(
        d["hidden"], d["weight"], d["actions"], sampler=jk.Sampler(top_k=3, top_p=0.9)
    )
    want = deprecated_call(
        jk.linear_logprobs, d["hidden"], d["weight"], d["actions"], top_k=3, top_p=0.9
    )
    assert_same(got, want)
    assert (
        float(jnp.max(jnp.abs(got - jk.linear_logprobs(d["hidden"], d["weight"], d["actions"]))))
        > 0
    )
    assert hash(jk.Sampler(top_k=3)) == hash(jk.Sampler(top_k=3))
    assert jk.Sampler(top_p=1.0, min_p=0.0).truncation() is None


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(top_k=0), "top_k: expected None or an int >= 1, got 0"),
        (dict(top_p=1.5), "top_p: expected None or a float in (0, 1], got 1.5"),
        (dict(min_p=-0.1), "min_p: expected None or a float in [0, 1], got -0.1"),
    ],
)
def test_sampler_bad_values(bad, message):
    assert error_of(jk.Sampler, **bad) == message


def test_distill_configs_equal_the_deprecated_keywords(data):
    d = data
    teacher = (d["hidden"] * 0.5, d["weight"] + 0.1)
    config = jk.DistillLoss(divergence="jsd", jsd_beta=0.3, loss_agg_mode="seq_mean_token_sum")
    got = jk.linear_distill_loss(d["hidden"], d["weight"], *teacher, d["mask"], config=config)
    want = deprecated_call(
        jk.linear_distill_loss,
        d["hidden"],
        d["weight"],
        *teacher,
        d["mask"],
        divergence="jsd",
        jsd_beta=0.3,
        loss_agg_mode="seq_mean_token_sum",
    )
    assert_same(got, want)
    ids = jnp.stack([d["actions"], (d["actions"] + 1) % V], axis=-1)
    t_logp = jnp.log(jnp.full(ids.shape, 0.3))
    config = jk.TopKDistillLoss(tail="bucket", loss_agg_mode="seq_mean_token_mean")
    got = jk.linear_topk_distill_loss(
        d["hidden"], d["weight"], ids, t_logp, d["mask"], config=config
    )
    want = deprecated_call(
        jk.linear_topk_distill_loss,
        d["hidden"],
        d["weight"],
        ids,
        t_logp,
        d["mask"],
        tail="bucket",
        loss_agg_mode="seq_mean_token_mean",
    )
    assert_same(got, want)


@pytest.mark.parametrize(
    "cls,bad,message",
    [
        ("DistillLoss", dict(divergence="kl"), "divergence: unknown option 'kl'"),
        (
            "DistillLoss",
            dict(divergence="jsd", jsd_beta=1.0),
            "jsd_beta: expected a value in (0, 1), got 1.0",
        ),
        ("TopKDistillLoss", dict(tail="all"), "tail: unknown option 'all'"),
        ("TopKDistillLoss", dict(max_len=0), "max_len:"),
    ],
)
def test_distill_configs_bad_values(cls, bad, message):
    assert error_of(getattr(jk, cls), **bad).startswith(message)
