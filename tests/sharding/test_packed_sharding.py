"""Packed rows on many devices (docs/api.md "Packed sequences", "Many devices"): on 8 host
devices (mesh data=2 × model=4) a packed ``linear_grpo_loss`` / ``linear_ppo_loss`` and a
packed ``ppo_loss`` / ``aggregate`` give the unsharded packed call's values and gradients,
with the rows split, the vocabulary split or both, under ``Auto`` and ``Explicit`` axes, the
segment ids split like the rows or replicated and the ``[S]`` inputs replicated (``ppo_loss``
on each backend: pallas too, with JAXRL_TEST_PALLAS=1); and inside a user's ``jax.shard_map``
with ``vocab_axis``, where each device's rows give their own loss (global ids, the other
devices' sequences empty) and the token-sum modes add up to the global loss."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from tests.conftest import assert_close, pallas_slow
from tests.support.packing import Packed

T, D, V = 8, 16, 256
LENGTHS = [3, 5, 2, 4, 6, 1, 3, 4, 2, 5]  # S = 10, packed into 8 rows of 8
MAX_LEN = 7
CONFIGS = {
    "gspo_seq_mean": jk.PolicyLoss(ratio_level="sequence", loss_agg_mode="seq_mean_token_mean"),
    "tis_sequence_sum_norm": jk.PolicyLoss(
        tis_cap=1.5,
        tis_level="sequence",
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=MAX_LEN,
    ),
}
LAYOUTS = {  # (hidden / per-token rows, weight [V, D])
    "rows": (P("data"), P()),
    "vocab": (P(), P("model")),
    "both": (P("data"), P("model")),
}


def _mesh(kind):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    types = (getattr(AxisType, kind),) * 2
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=types, devices=jax.devices()[:8])


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    packed = Packed(rng, LENGTHS, T, rows=8)
    assert packed.B == 8, packed.B  # rows split in two
    shape = (packed.B, T)
    mask = (rng.random(shape) < 0.85).astype(np.float32)
    old = -np.abs(rng.standard_normal(shape)).astype(np.float32) - 5.0
    return packed, dict(
        hidden=rng.standard_normal(shape + (D,)).astype(np.float32),
        weight=(0.3 * rng.standard_normal((V, D))).astype(np.float32),
        actions=rng.integers(0, V, shape).astype(np.int32),
        old_logp=old,
        rollout_logp=old + 0.3 * rng.standard_normal(shape).astype(np.float32),
        mask=mask,
        rewards=rng.integers(0, 2, packed.S).astype(np.float32),
        advantages=rng.standard_normal(packed.S).astype(np.float32),
    )


def _linear_loss(op, packed, x, config, backend):
    def loss(hidden, weight, actions, old, rollout, mask, ids, per_seq):
        extra = dict(rollout_logp=rollout) if config.tis_cap is not None else {}
        if op == "linear_grpo_loss":
            return jk.linear_grpo_loss(
                hidden, weight, actions, old, per_seq, mask, segment_ids=ids,
                groups=jk.Groups(size=2), config=config, backend=backend, **extra,
            )[0]  # fmt: skip
        return jk.linear_ppo_loss(
            hidden, weight, actions, old, per_seq, mask, segment_ids=ids, config=config,
            backend=backend, **extra,
        )[0]  # fmt: skip

    return loss


def _args(packed, x, op):
    per_seq = x["rewards"] if op == "linear_grpo_loss" else x["advantages"]
    return (x["hidden"], x["weight"], x["actions"], x["old_logp"], x["rollout_logp"], x["mask"],
            packed.ids, per_seq)  # fmt: skip


PLACEMENTS = [  # (mesh axis type, layout, ids split like the rows)
    *((kind, layout, True) for kind in ("Auto", "Explicit") for layout in LAYOUTS),
    ("Auto", "both", False),
    ("Explicit", "both", False),
]


OPS = [("linear_grpo_loss", "gspo_seq_mean"), ("linear_ppo_loss", "tis_sequence_sum_norm")]
# pallas (interpret mode, the slow one) runs each op under one axis type: grpo Auto, ppo Explicit
PALLAS_KIND = {"linear_grpo_loss": "Auto", "linear_ppo_loss": "Explicit"}


def linear_cases():
    """Every op × placement; the reference runs each placement on one op in turn (slow on the
    other: the same packed sums, resharded alike), both ops on the kernel backends' placement."""
    cases = []
    for i, (op, config) in enumerate(OPS):
        for j, (kind, layout, ids_split) in enumerate(PLACEMENTS):
            marks = [] if kind == PALLAS_KIND[op] else [pytest.mark.pallas_slow]
            if j % len(OPS) != i and (layout, ids_split) != ("both", True):
                marks.append(pytest.mark.slow_on("reference"))
            cases.append(pytest.param(op, config, kind, layout, ids_split, marks=marks))
    return cases


@pytest.mark.parametrize("op,config,kind,layout,ids_split", linear_cases())
def test_linear_losses_under_jit(backend, op, config, kind, layout, ids_split):
    if backend != "reference" and (layout, ids_split) != ("both", True):
        pytest.skip("the kernel backends: with both splits (the reference: every placement)")
    packed, x = _inputs()
    loss = _linear_loss(op, packed, x, CONFIGS[config], backend)
    args = _args(packed, x, op)
    want, want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)
    mesh = _mesh(kind)
    rows, vocab = LAYOUTS[layout]
    specs = (rows, vocab) + (rows,) * 4 + (rows if ids_split else P(), P())
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        got, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*put)
    assert_close(got, want, scale=1.0)
    for name, g, w, primal in zip(("d_hidden", "d_weight"), grads, want_grads, put):
        assert_close(g, w, name=name)
        assert g.sharding.is_equivalent_to(primal.sharding, g.ndim), name


@pytest.mark.op("ppo_loss")
# pallas under Explicit axes only (test_linear_losses_under_jit runs it under Auto)
@pytest.mark.parametrize("kind", [pallas_slow("Auto"), "Explicit"])
def test_ppo_loss_and_aggregate_under_jit(backend, kind):
    packed, x = _inputs(1)
    logp = x["old_logp"] + 0.2
    config = CONFIGS["tis_sequence_sum_norm"]

    def loss(lp, old, rollout, mask, ids, adv):
        out, metrics = jk.ppo_loss(
            lp, old, adv, mask, segment_ids=ids, rollout_logp=rollout, config=config,
            backend=backend,
        )  # fmt: skip
        agg = jk.aggregate(lp, mask, "seq_mean_token_mean", segment_ids=ids, num_segments=adv.size)
        return out + agg, metrics

    args = (logp, x["old_logp"], x["rollout_logp"], x["mask"], packed.ids, x["advantages"])
    (want, want_m), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True))(*args)
    mesh = _mesh(kind)
    specs = (P("data", "model"), P("data"), P("data"), P("data", "model"), P("data"), P())
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        (got, got_m), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(*put)
    assert_close(got, want, scale=1.0)
    for k in want_m:
        assert_close(got_m[k], want_m[k], name=k)
    assert_close(grad, want_g, name="d_logp")
    assert grad.sharding.is_equivalent_to(put[0].sharding, 2)


def test_shard_map_with_vocab_axis():
    """Rows over ``data``, the vocabulary over ``model`` (``vocab_axis``): each device's loss is
    its rows' (global ids); with ``seq_mean_token_sum`` the two row blocks' losses add up to the
    global loss, and so do their gradients."""
    packed, x = _inputs(2)
    config = jk.PolicyLoss(ratio_level="sequence", loss_agg_mode="seq_mean_token_sum")

    def local(hidden, weight, actions, old, mask, ids, rewards, vocab_axis=None):
        return jk.linear_grpo_loss(
            hidden, weight, actions, old, rewards, mask, segment_ids=ids,
            groups=jk.Groups(size=2), config=config, vocab_axis=vocab_axis,
        )[0]  # fmt: skip

    args = (x["hidden"], x["weight"], x["actions"], x["old_logp"], x["mask"], packed.ids,
            x["rewards"])  # fmt: skip
    # jitted: eager, each primitive of the unsharded call compiled alone took ~13 s
    want, want_grads = jax.jit(jax.value_and_grad(local, argnums=(0, 1)))(*args)
    mesh = _mesh("Explicit")

    def body(*a):
        return jax.lax.psum(local(*a, vocab_axis="model"), "data")

    specs = (P("data"), P("model"), P("data"), P("data"), P("data"), P("data"), P())
    sharded = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        got, grads = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1)))(*put)
    assert_close(got, want, scale=1.0)
    for name, g, w in zip(("d_hidden", "d_weight"), grads, want_grads):
        assert_close(g, w, name=name)


def test_replicated_sums_are_an_all_reduce():
    """Under Explicit axes the ``[S]`` sums are replicated: the row-split tokens are added
    per device, then all-reduced (an ``[S]`` collective, never the tokens gathered)."""
    packed, x = _inputs(3)
    mesh = _mesh("Explicit")
    fn = jax.jit(
        lambda v, m, ids: jk.aggregate(
            v, m, "seq_mean_token_mean", segment_ids=ids, num_segments=packed.S
        )  # fmt: skip
    )
    with jax.set_mesh(mesh):
        put = [
            jax.device_put(a, NamedSharding(mesh, P("data", "model")))
            for a in (x["old_logp"], x["mask"], packed.ids)
        ]
        hlo = fn.lower(*put).compile().as_text()
        got = fn(*put)
    want = jk.aggregate(x["old_logp"], x["mask"], "seq_mean_token_mean", segment_ids=packed.ids,
                        num_segments=packed.S)  # fmt: skip
    assert_close(got, want)
    assert "all-gather" not in hlo
