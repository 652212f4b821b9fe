"""Packed rows (docs/api.md "Packed sequences"): every op that takes ``segment_ids`` gives, on a
packing of S sequences in a random order and row assignment, what the padded ``[S, L]`` call
gives (sequence s in row s): the loss, the metrics and the gradients mapped back to their
positions, on every backend (``ppo_loss``'s PPO term on pallas too, with JAXRL_TEST_PALLAS=1)
and in both memory modes; against the float64 oracle on the padded layout too. Positions of
no sequence (id -1) hold garbage with mask 1 and out-of-vocabulary actions: they must count as
masked and never be read. The bad-input messages, eagerly and under ``jax.jit`` in check
mode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels import dispatch
from jaxrl_kernels.dispatch.contract import Problem
from tests.conftest import assert_close, pallas_slow
from tests.ops.test_checks import traced_raises
from tests.support import oracle
from tests.support.packing import Packed

LENGTHS = [5, 3, 7, 1, 6, 4, 2, 5]  # S = 8, L = 7
T, D, V = 12, 16, 64
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
MAX_LEN = 9


def _layout(rng, *, interleave=False):
    packed = Packed(rng, LENGTHS, T, rows=5, interleave=interleave)
    mask = packed.pad_mask() * (rng.random((packed.S, packed.L)) < 0.8)
    mask[3] = 0  # an empty sequence
    mask[0, 0] = 1
    return packed, mask.astype(np.float32)


def _pack(packed, x, garbage):
    """``x`` [S, L, ...] packed, ``garbage`` where no sequence lies (it must not count)."""
    return jnp.asarray(packed.pack(x, fill=garbage))


def _packed_mask(packed, mask):
    """The padded mask packed, 1 where no sequence lies: the ids must mask those."""
    return jnp.asarray(packed.pack(mask, fill=1.0))


def _close_packed(packed, got_packed, want_padded, name):
    """A packed per-token result against the padded one (0 on its padding, as the packed
    result must be where no sequence lies)."""
    assert_close(packed.unpack(np.asarray(got_packed)), want_padded, name=name)
    outside = np.asarray(got_packed)[packed.ids < 0]
    assert not np.any(outside), f"{name}: nonzero where no sequence lies"


# -- aggregate and policy_gradient_loss ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_aggregate(rng, mode):
    packed, mask = _layout(rng, interleave=True)
    values = rng.standard_normal((packed.S, packed.L)).astype(np.float32)
    max_len = MAX_LEN if mode == "seq_mean_token_sum_norm" else None

    def packed_fn(v):
        return jk.aggregate(
            v, _packed_mask(packed, mask), mode, segment_ids=packed.ids,
            num_segments=packed.S, max_len=max_len,
        )  # fmt: skip

    got, grad = jax.value_and_grad(packed_fn)(_pack(packed, values, 7.0))
    want, want_grad = jax.value_and_grad(lambda v: jk.aggregate(v, mask, mode, max_len=max_len))(
        jnp.asarray(values)
    )
    assert_close(got, oracle.aggregate(values, mask, mode, max_len))
    assert_close(got, want)
    _close_packed(packed, grad, want_grad, "d_values")


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("adv_rank", [1, 2])
def test_policy_gradient_loss(rng, mode, adv_rank):
    packed, mask = _layout(rng)
    logp = -np.abs(rng.standard_normal((packed.S, packed.L))).astype(np.float32)
    adv = rng.standard_normal((packed.S,) if adv_rank == 1 else (packed.S, packed.L))
    adv = adv.astype(np.float32)
    config = jk.PolicyLoss(loss_agg_mode=mode, max_len=MAX_LEN)
    adv_packed = jnp.asarray(adv) if adv_rank == 1 else _pack(packed, adv, 3.0)
    got, grad = jax.value_and_grad(
        lambda lp: jk.policy_gradient_loss(
            lp,
            adv_packed,
            _packed_mask(packed, mask),
            segment_ids=packed.ids,
            config=config,
            num_segments=None if adv_rank == 1 else packed.S,
        )  # fmt: skip
    )(_pack(packed, logp, -5.0))
    want, want_grad = jax.value_and_grad(
        lambda lp: jk.policy_gradient_loss(lp, jnp.asarray(adv), mask, config=config)
    )(jnp.asarray(logp))
    assert_close(got, oracle.policy_gradient_loss(logp, adv, mask, loss_agg_mode=mode,
                                                  max_len=MAX_LEN)[0])  # fmt: skip
    assert_close(got, want)
    _close_packed(packed, grad, want_grad, "d_logp")


# -- ppo_loss ----------------------------------------------------------------------------------

PPO_OPTIONS = {
    "plain": {},
    "dual_clip_kl_entropy": dict(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01),
    "gspo": dict(ratio_level="sequence", loss_agg_mode="seq_mean_token_mean"),
    "cispo": dict(policy_loss="cispo", loss_agg_mode="seq_mean_token_sum"),
    "tis_token": dict(tis_cap=1.5),
    "tis_sequence_mask": dict(
        tis_cap=1.5,
        tis_level="sequence",
        tis_mode="mask",
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=MAX_LEN,
    ),  # fmt: skip
    "gspo_dual_clip_tis_token": dict(
        ratio_level="sequence", dual_clip=3.0, tis_cap=1.5, kl_coef=0.1, entropy_coef=0.01
    ),
    "gspo_cispo_tis_sequence": dict(
        ratio_level="sequence",
        policy_loss="cispo",
        tis_cap=2.0,
        tis_level="sequence",
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=MAX_LEN,
    ),  # fmt: skip
}


def _ppo_arrays(rng, packed):
    shape = (packed.S, packed.L)
    logp = -np.abs(rng.standard_normal(shape)).astype(np.float32)
    normal = lambda scale: (scale * rng.standard_normal(shape)).astype(np.float32)
    return dict(
        logp=logp,
        old_logp=logp + normal(0.3),
        advantages=rng.standard_normal(packed.S).astype(np.float32),
        rollout_logp=logp + normal(0.5),
        ref_logp=logp + normal(0.4),
        entropy=np.abs(normal(2.0)),
    )


# pallas: the options the combined ones (gspo_dual_clip_tis_token: dual clip, kl, entropy, token
# tis) hold are pallas_slow
PPO_PALLAS_SLOW = ("plain", "dual_clip_kl_entropy", "tis_token")


@pytest.mark.op("ppo_loss")
@pytest.mark.parametrize("interleave", [False, True], ids=["contiguous", "interleaved"])
@pytest.mark.parametrize(
    "option", [pallas_slow(o) if o in PPO_PALLAS_SLOW else o for o in PPO_OPTIONS]
)
def test_ppo_loss(rng, backend, option, interleave):
    packed, mask = _layout(rng, interleave=interleave)
    arrays = _ppo_arrays(rng, packed)
    opts = PPO_OPTIONS[option]
    config = jk.PolicyLoss(**opts)
    extra = {k: arrays[k] for k in ("rollout_logp",) if "tis_cap" in opts}
    extra.update({k: arrays[k] for k in ("ref_logp",) if opts.get("kl_coef")})
    extra.update({k: arrays[k] for k in ("entropy",) if opts.get("entropy_coef")})
    diff = ("logp",) + (("entropy",) if "entropy" in extra else ())

    def run(pack):
        def loss(lp, *ent):
            rest = {k: v for k, v in extra.items() if k != "entropy"}
            if pack:
                rest = {k: _pack(packed, v, 0.5) for k, v in rest.items()}
            rest.update(zip(("entropy",), ent))
            if pack:
                return jk.ppo_loss(
                    lp, _pack(packed, arrays["old_logp"], 9.0), jnp.asarray(arrays["advantages"]),
                    _packed_mask(packed, mask), segment_ids=packed.ids, config=config,
                    backend=backend, **rest,
                )  # fmt: skip
            return jk.ppo_loss(
                lp, arrays["old_logp"], arrays["advantages"], mask, config=config,
                backend=backend, **rest,
            )  # fmt: skip

        args = [arrays[k] for k in diff]
        args = [_pack(packed, a, -3.0) if pack else jnp.asarray(a) for a in args]
        return jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)

    (got, metrics), grads = run(True)
    (want, want_metrics), want_grads = run(False)
    oracle_args = {k: v for k, v in dict(config.__dict__).items() if k in _ORACLE_KEYS}
    o_loss, o_metrics, o_dlogp, o_dent, _ = oracle.ppo_loss(
        arrays["logp"], arrays["old_logp"], arrays["advantages"][:, None], mask,
        **{k: arrays[k] for k in extra}, **oracle_args,
    )  # fmt: skip
    assert_close(got, o_loss, scale=1.0)
    assert_close(got, want, scale=1.0)
    assert metrics.keys() == want_metrics.keys() == o_metrics.keys()
    for k in metrics:
        assert_close(metrics[k], want_metrics[k], name=k)
        assert_close(metrics[k], o_metrics[k], name=k)
    for name, g, w, o in zip(diff, grads, want_grads, (o_dlogp, o_dent)):
        _close_packed(packed, g, w, f"d_{name}")
        assert_close(packed.unpack(np.asarray(g)), o, name=f"d_{name} (oracle)")


_ORACLE_KEYS = {f.name for f in dataclasses.fields(jk.PolicyLoss)}


@pytest.mark.parametrize("backend", ["chunked", "pallas"])
def test_ppo_loss_on_packed_rows_any_backend(rng, backend):
    """Every backend that serves ``ppo_loss`` serves it on packed rows (pallas: its own
    kernels, in interpret mode here, whether or not JAXRL_TEST_PALLAS adds it to the grid),
    also as ``linear_ppo_loss``'s PPO term, and gives the reference's loss and gradient."""
    for op in ("ppo_loss", "linear_ppo_loss"):
        choice = dispatch.select(op, Problem(), backend, primitive="segment_ppo_loss")
        assert choice.backend == backend, op
    packed, mask = _layout(rng, interleave=True)
    arrays = _ppo_arrays(rng, packed)
    config = jk.PolicyLoss(ratio_level="sequence", loss_agg_mode="seq_mean_token_mean")

    def loss(chosen):
        return lambda lp: jk.ppo_loss(
            lp, _pack(packed, arrays["old_logp"], 9.0), jnp.asarray(arrays["advantages"]),
            _packed_mask(packed, mask), segment_ids=packed.ids, config=config, backend=chosen,
        )[0]  # fmt: skip

    lp = _pack(packed, arrays["logp"], -3.0)
    got, grad = jax.value_and_grad(loss(backend))(lp)
    want, want_grad = jax.value_and_grad(loss("reference"))(lp)
    assert_close(got, want, scale=1.0)
    assert_close(grad, want_grad, name="d_logp")


# -- grpo_loss from logits ---------------------------------------------------------------------

GRPO_OPTIONS = {
    "size": dict(groups=jk.Groups(size=2)),
    "boundaries_gspo": dict(
        groups=jk.Groups(boundaries=np.array([0, 3, 4, 8])),
        config=jk.PolicyLoss(ratio_level="sequence", loss_agg_mode="seq_mean_token_mean"),
    ),
    "advantages_tis_sequence": dict(
        _advantages=True,
        config=jk.PolicyLoss(tis_cap=2.0, tis_level="sequence", kl_coef=0.05),
    ),
}


def _grpo_inputs(rng, packed):
    shape = (packed.S, packed.L)
    actions = rng.integers(0, V, shape)
    return dict(
        policy_logits=rng.standard_normal(shape + (V,)).astype(np.float32),
        ref_logits=rng.standard_normal(shape + (V,)).astype(np.float32),
        actions=actions,
        old_logp=-np.abs(rng.standard_normal(shape)).astype(np.float32) - 4.0,
        rollout_logp=-np.abs(rng.standard_normal(shape)).astype(np.float32) - 4.0,
        rewards=rng.integers(0, 2, packed.S).astype(np.float32),
        advantages=rng.standard_normal(packed.S).astype(np.float32),
    )


@pytest.mark.parametrize("option", GRPO_OPTIONS)
def test_grpo_loss(rng, backend, option):
    packed, mask = _layout(rng)
    x = _grpo_inputs(rng, packed)
    opts = dict(GRPO_OPTIONS[option])
    if opts.pop("_advantages", False):
        opts["advantages"] = x["advantages"]
    config = opts.get("config")
    if config is not None and config.tis_cap is not None:
        opts["rollout_logp"] = x["rollout_logp"]

    def split(outs):
        return outs[0], outs[1:]

    def run(pack):
        per_token = {k: opts[k] for k in ("rollout_logp",) if k in opts}
        rest = {k: v for k, v in opts.items() if k not in per_token}
        if not pack:
            return jax.value_and_grad(
                lambda z: split(jk.grpo_loss(
                    z, x["ref_logits"], x["actions"], x["old_logp"], x["rewards"], mask,
                    backend=backend, **opts,
                )), has_aux=True,
            )(jnp.asarray(x["policy_logits"]))  # fmt: skip
        per_token = {k: _pack(packed, v, -1.0) for k, v in per_token.items()}
        return jax.value_and_grad(
            lambda z: split(jk.grpo_loss(
                z, _pack(packed, x["ref_logits"], 2.0), _pack(packed, x["actions"], V + 3),
                _pack(packed, x["old_logp"], 0.0), x["rewards"], _packed_mask(packed, mask),
                segment_ids=packed.ids, backend=backend, **per_token, **rest,
            )), has_aux=True,
        )(_pack(packed, x["policy_logits"], 5.0))  # fmt: skip

    (got, got_aux), grad = run(True)
    (want, want_aux), want_grad = run(False)
    assert_close(got, want, scale=1.0)
    for g, w in zip(got_aux, want_aux):
        assert_close(g, w, scale=1.0, name="policy_loss / kl")
    _close_packed(packed, grad, want_grad, "d_policy_logits")


# -- the linear losses -------------------------------------------------------------------------


def _head(rng, packed):
    shape = (packed.S, packed.L)
    return dict(
        hidden=rng.standard_normal(shape + (D,)).astype(np.float32),
        weight=(0.3 * rng.standard_normal((V, D))).astype(np.float32),
        bias=(0.1 * rng.standard_normal(V)).astype(np.float32),
        actions=rng.integers(0, V, shape),
    )


LINEAR = {
    "linear_grpo_loss": dict(
        groups=jk.Groups(size=4),
        config=jk.PolicyLoss(
            ratio_level="sequence",
            loss_agg_mode="seq_mean_token_sum_norm",
            max_len=MAX_LEN,
            kl_coef=0.1,
        ),
    ),  # fmt: skip
    "linear_ppo_loss": dict(
        config=jk.PolicyLoss(
            tis_cap=1.5,
            tis_level="sequence",
            entropy_coef=0.01,
            loss_agg_mode="seq_mean_token_mean",
        ),
    ),  # fmt: skip
    "linear_policy_gradient_loss": dict(config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_sum")),
}


def _linear_call(op, packed, x, mask, pack, **kw):
    """``op``'s call on the padded inputs ``x`` (packed with ``pack``): (hidden, weight, bias)
    -> its outputs."""
    fn = getattr(jk, op)
    shape = (packed.S, packed.L)
    rng = np.random.default_rng(7)
    logp = -np.abs(rng.standard_normal(shape)).astype(np.float32) - 3.0
    per_seq = rng.standard_normal(packed.S).astype(np.float32)
    p = (lambda a, fill: _pack(packed, a, fill)) if pack else (lambda a, fill: jnp.asarray(a))
    m = _packed_mask(packed, mask) if pack else jnp.asarray(mask)
    actions = p(x["actions"], V + 3)
    seg = dict(segment_ids=packed.ids) if pack else {}
    opts = dict(LINEAR[op], **kw)
    if op == "linear_policy_gradient_loss":
        args = (actions, per_seq, m)
    elif op == "linear_grpo_loss":
        args = (actions, p(logp + 0.2, 0.0), (per_seq > 0).astype(np.float32), m)
        opts["ref_logp"] = p(logp - 0.3, 1.0)
    else:
        args = (actions, p(logp + 0.2, 0.0), per_seq, m)
        opts["rollout_logp"] = p(logp + 0.5 * rng.standard_normal(shape).astype(np.float32), 2.0)

    def call(h, w, b):
        return fn(h, w, *args, bias=b, **seg, **opts)

    return call


@pytest.mark.parametrize("memory", ["lean", "fast"])
# pallas: linear_grpo_loss and linear_policy_gradient_loss run its head and segment kernels on
# packed rows; linear_ppo_loss (~8 s in interpret mode) is pallas_slow
@pytest.mark.parametrize(
    "op", [pallas_slow(op) if op == "linear_ppo_loss" else op for op in LINEAR]
)
def test_linear_losses(rng, backend, op, memory):
    if memory == "fast" and backend != "reference":
        pytest.skip("memory='fast' chooses its own kernels: once, with backend=None")
    packed, mask = _layout(rng)
    x = _head(rng, packed)
    outs = {}
    chosen = None if memory == "fast" else backend
    for pack in (True, False):
        call = _linear_call(op, packed, x, mask, pack, backend=chosen, memory=memory)
        first = lambda *a: jax.tree.leaves(call(*a))[0]
        hidden = _pack(packed, x["hidden"], 3.0) if pack else jnp.asarray(x["hidden"])
        outs[pack] = jax.value_and_grad(first, argnums=(0, 1, 2))(hidden, x["weight"], x["bias"])
        outs[pack, "all"] = call(hidden, x["weight"], x["bias"])
    (got, (dh, dw, db)), (want, (wh, ww, wb)) = outs[True], outs[False]
    assert_close(got, want, scale=1.0)
    for g, w in zip(jax.tree.leaves(outs[True, "all"]), jax.tree.leaves(outs[False, "all"])):
        assert_close(g, w, scale=1.0, name="outputs")
    _close_packed(packed, dh, wh, "d_hidden")
    assert_close(dw, ww, name="d_weight")
    assert_close(db, wb, name="d_bias")


@pytest.mark.gpu
@pytest.mark.parametrize("op", LINEAR)
@pytest.mark.parametrize("gpu_backend", ["ffi", "pallas"])
def test_linear_losses_on_gpu_backends(rng, gpu_backend, op):
    """The lean GPU kernels on packed rows, bf16 head and hidden states (the SM90 kernel's
    dtypes): packed against unpacked on the same kernel, within the unpacked call's own
    distance from float32 (the fast mode's kernels are :func:`test_linear_losses`'
    ``backend=None`` case, which a GPU run takes)."""
    packed, mask = _layout(rng)
    x = _head(rng, packed)
    bf16 = {k: jnp.asarray(x[k], jnp.bfloat16) for k in ("hidden", "weight", "bias")}
    f32 = {k: v.astype(jnp.float32) for k, v in bf16.items()}
    outs = {}
    for pack, backend, arrays in (
        (True, gpu_backend, bf16), (False, gpu_backend, bf16), ("f32", "reference", f32)
    ):  # fmt: skip
        call = _linear_call(op, packed, x, mask, pack is True, backend=backend, memory="lean")
        first = lambda *a: jax.tree.leaves(call(*a))[0]  # noqa: E731
        h = _pack(packed, arrays["hidden"], 3.0) if pack is True else arrays["hidden"]
        outs[pack] = jax.value_and_grad(first, argnums=(0, 1, 2))(
            h, arrays["weight"], arrays["bias"]
        )
    (got, (dh, dw, db)), (want, (wh, ww, wb)), (w32, (h32, ww32, wb32)) = outs.values()
    low = dict(in_dtype=jnp.bfloat16)
    assert_close(got, want, want32=w32, scale=1.0, **low)
    assert_close(packed.unpack(np.asarray(dh)), wh, want32=h32, name="d_hidden", **low)
    assert not np.any(np.asarray(dh)[packed.ids < 0]), "d_hidden: nonzero where no sequence lies"
    assert_close(dw, ww, want32=ww32, name="d_weight", **low)
    assert_close(db, wb, want32=wb32, name="d_bias", **low)


def test_linear_grpo_loss_against_the_oracle(rng):
    packed, mask = _layout(rng)
    x = _head(rng, packed)
    logp_old = -np.abs(rng.standard_normal((packed.S, packed.L))).astype(np.float32) - 3.0
    rewards = rng.integers(0, 2, packed.S).astype(np.float32)
    (loss, pg, kl), vjp, scale = oracle.linear_grpo_loss(
        x["hidden"], x["weight"], x["actions"], logp_old, rewards, mask, bias=x["bias"],
        group_size=2, loss_agg_mode="seq_mean_token_mean", ratio_level="sequence",
    )  # fmt: skip

    def packed_loss(h, w, b):
        return jk.linear_grpo_loss(
            h, w, _pack(packed, x["actions"], V + 1), _pack(packed, logp_old, 0.0), rewards,
            _packed_mask(packed, mask), segment_ids=packed.ids, bias=b, groups=jk.Groups(size=2),
            config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_mean", ratio_level="sequence"),
        )  # fmt: skip

    h = _pack(packed, x["hidden"], 1.0)
    outs, pull = jax.vjp(packed_loss, h, x["weight"], x["bias"])
    for got, want in zip(outs, (loss, pg, kl)):
        assert_close(got, want, scale=scale)
    dh, dw, db = pull((jnp.float32(1.0), jnp.float32(0.0), jnp.float32(0.0)))
    oh, ow, ob = vjp(1.0, 0.0, 0.0)
    assert_close(packed.unpack(dh), oh, name="d_hidden")
    assert_close(dw, ow, name="d_weight")
    assert_close(db, ob, name="d_bias")


def test_traced_ids_under_jit(rng):
    packed, mask = _layout(rng)
    x = _head(rng, packed)
    adv = rng.standard_normal(packed.S).astype(np.float32)

    def loss(h, ids):
        return jk.linear_policy_gradient_loss(
            h, x["weight"], _pack(packed, x["actions"], 0), adv, _packed_mask(packed, mask),
            segment_ids=ids, config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_mean"),
        )  # fmt: skip

    h = _pack(packed, x["hidden"], 0.0)
    got, grad = jax.jit(jax.value_and_grad(loss))(h, jnp.asarray(packed.ids))
    want, want_grad = jax.value_and_grad(loss)(h, packed.ids)
    assert_close(got, want)
    assert_close(grad, want_grad, name="d_hidden")


# -- bad input ---------------------------------------------------------------------------------

IDS = np.array([[0, 0, 1, -1], [2, 2, 3, 3]])
VALUES, MASK = jnp.ones((2, 4)), jnp.ones((2, 4))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(segment_ids=IDS), "num_segments: required with segment_ids"),
        (dict(num_segments=4), "num_segments: given without segment_ids"),
        (dict(segment_ids=IDS, num_segments=-1), "num_segments: expected a non-negative int"),
        (dict(segment_ids=IDS[:1], num_segments=4), "segment_ids: expected shape (2, 4)"),
        (
            dict(segment_ids=IDS, num_segments=3),
            "segment_ids: value 3 at position (1, 2) is outside [-1, 3)",
        ),  # fmt: skip
        (dict(segment_ids=np.where(IDS == 2, -2, IDS), num_segments=4), "value -2 at position"),
        (
            dict(segment_ids=np.array([[0, 0, 1, -1], [2, 1, 3, 3]]), num_segments=4),
            "segment_ids: segment 1 at position (1, 1) also lies in an earlier row",
        ),  # fmt: skip
        (
            dict(segment_ids=IDS, num_segments=4, mode="seq_mean_token_sum_norm"),
            "max_len: required with segment_ids",
        ),  # fmt: skip
    ],
)
def test_aggregate_errors(kwargs, message):
    kwargs = dict(kwargs)
    mode = kwargs.pop("mode", "token_mean")
    with pytest.raises(ValueError) as info:
        jk.aggregate(VALUES, MASK, mode, **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_segment_ids_must_be_integers():
    with pytest.raises(TypeError, match="segment_ids: expected an integer dtype"):
        jk.aggregate(VALUES, MASK, segment_ids=IDS.astype(np.float32), num_segments=4)


def test_sized_inputs_must_agree():
    logits = jnp.zeros((2, 4, 5))
    actions, lp = jnp.zeros((2, 4), int), jnp.zeros((2, 4))
    with pytest.raises(ValueError, match=r"rewards: expected shape \(5,\) \(\[S\], S = "
                                         r"num_segments\) with segment_ids, got \(4,\)"):  # fmt: skip
        jk.grpo_loss(logits, logits, actions, lp, jnp.ones(4), MASK, segment_ids=IDS,
                     num_segments=5, groups=jk.Groups(size=1))  # fmt: skip
    with pytest.raises(ValueError, match=r"advantages: expected shape \(4,\) \(\[S\], S = "
                                         r"rewards.shape\[0\]\)"):  # fmt: skip
        jk.grpo_loss(logits, logits, actions, lp, jnp.ones(4), MASK, segment_ids=IDS,
                     advantages=jnp.ones(3))  # fmt: skip
    with pytest.raises(ValueError, match="config.max_len: required with segment_ids"):
        jk.ppo_loss(lp, lp, jnp.ones(4), MASK, segment_ids=IDS,
                    config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_sum_norm"))  # fmt: skip
    with pytest.raises(ValueError, match=r"advantages: expected shape \(2, 4\) or \(4,\)"):
        jk.ppo_loss(lp, lp, jnp.ones((2, 3)), MASK, segment_ids=IDS, num_segments=4)


@pytest.mark.parametrize(
    "ids,message",
    [
        (np.where(IDS == 3, 4, IDS), "segment_ids: value 4 at position (1, 2) is outside [-1, 4)"),
        (np.array([[0, 0, 1, -1], [2, 1, 3, 3]]), "segment 1 at position (1, 1) also lies in"),
    ],
)
def test_ids_are_checked_under_jit_in_check_mode(ids, message):
    def fn():
        return jax.jit(lambda g: jk.aggregate(VALUES, MASK, segment_ids=g, num_segments=4))

    with jk.checks():
        traced_raises(fn(), jnp.asarray(ids), message=message)
    fn()(jnp.asarray(ids))  # off (a fresh trace): no error, the documented traced behaviour


def test_every_op_takes_the_packing():
    ops = ["aggregate", "policy_gradient_loss", "ppo_loss", "grpo_loss", "linear_ppo_loss",
           "linear_grpo_loss", "linear_policy_gradient_loss"]  # fmt: skip
    import inspect

    for name in ops:
        params = inspect.signature(getattr(jk, name)).parameters
        assert params["segment_ids"].default is None and params["num_segments"].default is None


# -- the distillation losses' aggregation ----------------------------------------------------


@pytest.mark.parametrize("op", ["linear_distill_loss", "linear_topk_distill_loss"])
def test_distillation_aggregation(rng, op):
    packed, mask = _layout(rng)
    x = _head(rng, packed)
    shape = (packed.S, packed.L)
    if op == "linear_distill_loss":
        teacher = rng.standard_normal(shape + (8,)).astype(np.float32)
        teacher_weight = (0.2 * rng.standard_normal((V, 8))).astype(np.float32)
        rest = lambda p: (p(teacher, 1.0), teacher_weight)
        config = jk.DistillLoss(divergence="forward_kl", loss_agg_mode="seq_mean_token_mean")
    else:
        ids = np.argsort(rng.random(shape + (V,)), axis=-1)[..., :4]
        logp = np.log(rng.dirichlet(np.ones(5), shape)[..., :4]).astype(np.float32)
        rest = lambda p: (p(ids, 0), p(logp, -1.0))
        config = jk.TopKDistillLoss(loss_agg_mode="seq_mean_token_sum_norm", max_len=MAX_LEN)
    fn = getattr(jk, op)
    outs = {}
    for pack in (True, False):
        p = (lambda a, fill: _pack(packed, a, fill)) if pack else (lambda a, fill: jnp.asarray(a))
        args = rest(p)
        m = _packed_mask(packed, mask) if pack else jnp.asarray(mask)
        seg = dict(segment_ids=packed.ids, num_segments=packed.S) if pack else {}
        outs[pack] = jax.value_and_grad(
            lambda h, w: fn(h, w, *args, m, **seg, config=config), argnums=(0, 1), has_aux=True
        )(p(x["hidden"], 2.0), x["weight"])
    ((got, per_token), (dh, dw)), ((want, want_tok), (wh, ww)) = outs[True], outs[False]
    assert_close(got, want, scale=1.0)
    _close_packed(packed, per_token, want_tok, "per_token")
    _close_packed(packed, dh, wh, "d_hidden")
    assert_close(dw, ww, name="d_weight")
