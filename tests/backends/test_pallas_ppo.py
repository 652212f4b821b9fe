"""The Pallas PPO-loss and group-advantage kernels against the float64 oracle.

CPU: interpret mode with explicit plans, so that [rows, T] tiles are partial in both
directions, a sum program adds several T tiles (one of them past the end), and several
T splits' partial sums are combined. ``segment_ppo_loss`` (packed rows) against the oracle on
the padded [S, L] layout, with the same plans. GPU (marked ``gpu``): B=128, T=512 and bitwise
determinism, packed rows at a realistic size too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels.backends.pallas import ppo as pl_ppo
from jaxrl_kernels.backends.pallas import ppo_kernels as pl_ppo_kernels
from jaxrl_kernels.formulas import aggregation_math, ppo_math, segment_math
from tests.conftest import assert_bitwise, assert_close, assert_zero, cotangent, random_mask
from tests.support import oracle
from tests.support.packing import Packed

# block_rows=2, block_t=4 over [7, 11]: partial tiles in B and T, 3 T tiles; "multi_tile" adds
# 2 T tiles per sum program (2 T splits, the second with a tile past T), "t_splits" 1 (3
# splits); "row_tiles" has one row per tile and one T tile covering T.
PLANS = {
    "multi_tile": pl_ppo_kernels.PPOLaunch(2, 4, 2, 1),
    "t_splits": pl_ppo_kernels.PPOLaunch(2, 4, 1, 1),
    "row_tiles": pl_ppo_kernels.PPOLaunch(1, 16, 1, 1),
}
MODES = aggregation_math.AGGREGATION_MODES


def _batch(rng, b, t, *, empty_rows=(1,)):
    lp = -np.abs(rng.standard_normal((b, t))) * 2 - 0.05
    # per-sequence offsets: sequence ratios exp(l_b) on both sides of the clip range too
    seq_shift = rng.choice([-1, 1], (b, 1)) * (0.05 + 0.35 * rng.random((b, 1)))
    old = lp - seq_shift + 0.3 * rng.standard_normal((b, t))
    arrays = dict(
        logp=lp,
        old_logp=old,
        advantages=rng.standard_normal((b, t)),
        rollout_logp=old + 0.4 * rng.standard_normal((b, t)),
        ref_logp=lp + rng.choice([-1, 1], (b, t)) * (0.15 + 0.4 * rng.random((b, t))),
        entropy=np.abs(rng.standard_normal((b, t))) * 3,
    )
    arrays = {k: np.asarray(v, np.float32).astype(np.float64) for k, v in arrays.items()}
    return arrays, random_mask(rng, b, t, empty_rows=empty_rows)


def _inputs(arrays, mask, use):
    get = lambda k: jnp.asarray(arrays[k], jnp.float32) if k in use else None
    return ppo_math.PPOInputs(
        get("logp"),
        get("old_logp"),
        get("advantages"),
        jnp.asarray(mask, jnp.float32),
        get("rollout_logp"),
        get("ref_logp"),
        get("entropy"),
    )


def _oracle(arrays, mask, cfg: ppo_math.PPOConfig, use):
    """``oracle.ppo_loss`` on the padded float64 arrays, and its optional inputs."""
    orc = {k: arrays[k] for k in ("rollout_logp", "ref_logp", "entropy") if k in use}
    return orc, oracle.ppo_loss(
        arrays["logp"],
        arrays["old_logp"],
        arrays["advantages"],
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        tis_cap=cfg.tis_cap,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
        loss_agg_mode=cfg.loss_agg_mode,
        max_len=cfg.max_len,
        ratio_level=cfg.ratio_level,
        policy_loss=cfg.policy_loss,
        tis_level=cfg.tis_level,
        tis_mode=cfg.tis_mode,
        **orc,
    )


def _check(rng, arrays, mask, cfg: ppo_math.PPOConfig, use, plan, packed=None):
    """The op's loss, metrics and vjp against the oracle's. ``packed`` (a ``Packed``
    layout of the [S, L] ``arrays``): ``segment_ppo_loss`` on the packed rows, with garbage
    where no sequence lies, its gradients mapped back to the padded layout."""
    x = _inputs(arrays, mask, use)
    if packed is None:
        f = lambda lp, ent: pl_ppo.ppo_loss(x._replace(logp=lp, entropy=ent), cfg, plan=plan)
        unpack = lambda d: d
    else:
        # the primitive's mask is 0 off every segment (the ops zero it), the other inputs not
        x = ppo_math.PPOInputs(*(
            None if v is None else jnp.asarray(packed.pack(v, fill=0.0 if k == "mask" else 0.7))
            for k, v in x._asdict().items()
        ))  # fmt: skip
        packing = segment_math.Packing(jnp.asarray(packed.ids), packed.S)
        f = lambda lp, ent: pl_ppo.segment_ppo_loss(
            x._replace(logp=lp, entropy=ent), cfg, packing, plan=plan
        )
        unpack = packed.unpack
    (loss, metrics), vjp = jax.vjp(f, x.logp, x.entropy)
    orc, (want_loss, want_m, want_dlp, want_dent, per_token) = _oracle(arrays, mask, cfg, use)
    scale = oracle.aggregate(np.abs(per_token), mask, cfg.loss_agg_mode, cfg.max_len)
    assert_close(loss, want_loss, scale=scale, name="loss")
    assert set(metrics) == set(want_m)
    scales = oracle.kl_metric_scales(arrays["logp"], arrays["old_logp"], mask, orc.get("ref_logp"))
    for k, w in want_m.items():
        assert_close(metrics[k], w, scale=scales.get(k), name=f"metrics[{k}]")
    g = float(cotangent(rng, ()))
    d_lp, d_ent = vjp((jnp.float32(g), jax.tree.map(jnp.ones_like, metrics)))
    assert_close(unpack(d_lp), g * want_dlp, name="d_logp")
    if "entropy" in use:
        assert_close(unpack(d_ent), g * want_dent, name="d_entropy")
    if packed is not None:
        for name, d in (("d_logp", d_lp), ("d_entropy", d_ent)):
            if d is not None:
                assert_zero(np.asarray(d)[packed.ids < 0], f"{name} where no sequence lies")
    return loss, d_lp


ALL = ("logp", "old_logp", "advantages", "rollout_logp", "ref_logp", "entropy")
BASE = ("logp", "old_logp", "advantages")


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("mode", MODES)
def test_every_option_every_mode(rng, mode, plan):
    arrays, mask = _batch(rng, 7, 11, empty_rows=(1, 4))
    cfg = ppo_math.PPOConfig(
        clip_low=0.15,
        clip_high=0.25,
        dual_clip=2.5,
        tis_cap=2.0,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.02,
        loss_agg_mode=mode,
        max_len=13 if mode.endswith("norm") else None,
    )
    _check(rng, arrays, mask, cfg, ALL, PLANS[plan])


# (ratio_level, policy_loss, tis_level, tis_mode): each value twice, with each plan
VARIANTS = [
    ("sequence", "ppo", "sequence", "mask"),
    ("sequence", "cispo", "token", "truncate"),
    ("token", "cispo", "sequence", "mask"),
    ("token", "ppo", "token", "truncate"),
]


def _slow_unless(keep, *values):
    return pytest.param(*values, marks=() if keep else pytest.mark.slow)


# Each variant on multi_tile (T splits and tiles past T together) and on one of t_splits /
# row_tiles in turn (each plan twice); the other pairs slow.
@pytest.mark.parametrize(
    "variant,plan",
    [
        _slow_unless(plan in ("multi_tile", ("t_splits", "row_tiles")[i % 2]), v, plan)
        for i, v in enumerate(VARIANTS)
        for plan in PLANS
    ],
    ids=[f"{'-'.join(v)}-{plan}" for v in VARIANTS for plan in PLANS],
)
def test_policy_variants_every_plan(rng, variant, plan):
    """The sequence sums (l_b, the sequence TIS log-weight) add up over T splits and tiles
    that end past T, and over fully masked sequences."""
    arrays, mask = _batch(rng, 7, 11, empty_rows=(1, 4))
    ratio_level, policy_loss, tis_level, tis_mode = variant
    cfg = ppo_math.PPOConfig(
        clip_low=0.15,
        clip_high=0.25,
        tis_cap=1.5,
        kl_coef=0.1,
        entropy_coef=0.02,
        loss_agg_mode="seq_mean_token_mean",
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        tis_level=tis_level,
        tis_mode=tis_mode,
        dual_clip=2.5 if policy_loss == "ppo" else None,
    )
    _check(rng, arrays, mask, cfg, ALL, PLANS[plan])


# S = 8 sequences of length <= L = 7 in rows of T = 11, interleaved, an extra row of no sequence
PACKED_LENGTHS = [4, 2, 7, 1, 5, 3, 6, 2]


def _packed_batch(rng):
    packed = Packed(rng, PACKED_LENGTHS, 11, rows=6, interleave=True)
    arrays, mask = _batch(rng, packed.S, packed.L, empty_rows=(2,))
    return packed, arrays, mask * packed.pad_mask()


# Packed rows: every mode on multi_tile, token_mean on every plan (test_every_option_every_mode
# runs every mode × plan on padded rows; the plans tile packed rows alike); the rest slow.
@pytest.mark.parametrize(
    "mode,plan",
    [
        _slow_unless(plan == "multi_tile" or mode == "token_mean", mode, plan)
        for mode in MODES
        for plan in PLANS
    ],
    ids=[f"{mode}-{plan}" for mode in MODES for plan in PLANS],
)
def test_packed_rows_every_option_every_mode(rng, mode, plan):
    """``segment_ppo_loss``: the padded oracle's values and gradients, each sequence's sums
    gathered from its positions across tiles and T splits, an empty sequence and an empty
    row included."""
    packed, arrays, mask = _packed_batch(rng)
    cfg = ppo_math.PPOConfig(
        clip_low=0.15,
        clip_high=0.25,
        dual_clip=2.5,
        tis_cap=2.0,
        kl_coef=0.1,
        entropy_coef=0.02,
        loss_agg_mode=mode,
        max_len=13 if mode.endswith("norm") else None,
    )
    _check(rng, arrays, mask, cfg, ALL, PLANS[plan], packed)


@pytest.mark.parametrize(
    "variant,plan",
    [(v, list(PLANS)[i % len(PLANS)]) for i, v in enumerate(VARIANTS)],
    ids=["-".join(v) for v in VARIANTS],
)
def test_packed_rows_policy_variants(rng, variant, plan):
    """The sequence-level options per segment: ℓ_s and the sequence TIS log-weight."""
    packed, arrays, mask = _packed_batch(rng)
    ratio_level, policy_loss, tis_level, tis_mode = variant
    cfg = ppo_math.PPOConfig(
        tis_cap=1.5,
        kl_coef=0.1,
        entropy_coef=0.02,
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=9,
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        tis_level=tis_level,
        tis_mode=tis_mode,
        dual_clip=2.5 if policy_loss == "ppo" else None,
    )
    _check(rng, arrays, mask, cfg, ALL, PLANS[plan], packed)


def test_packed_rows_match_segment_math(rng):
    """The heuristic plan, no optional input: ``segment_math.ppo_loss``'s values and
    gradient to float32 rounding."""
    packed, arrays, mask = _packed_batch(rng)
    x = _inputs(arrays, mask, BASE)
    x = ppo_math.PPOInputs(*(None if v is None else jnp.asarray(packed.pack(v)) for v in x))
    packing = segment_math.Packing(jnp.asarray(packed.ids), packed.S)
    cfg = ppo_math.PPOConfig(ratio_level="sequence", loss_agg_mode="seq_mean_token_mean")
    # jitted: eager, each primitive of the two calls compiles on its own
    runs = [
        jax.jit(jax.value_and_grad(lambda lp: fn(x._replace(logp=lp), cfg, packing), has_aux=True))(
            x.logp
        )
        for fn in (pl_ppo.segment_ppo_loss, segment_math.ppo_loss)
    ]
    ((loss, metrics), d_lp), ((want, want_m), want_d) = runs
    assert_close(loss, want, scale=1.0, name="loss")
    assert set(metrics) == set(want_m)
    for k in metrics:
        assert_close(metrics[k], want_m[k], name=k)
    assert_close(d_lp, want_d, name="d_logp")


def test_forward_sums_hold_the_sequence_sums(rng):
    """The one forward pass gives, per sequence, Σ m and the sums our l_b and sequence
    TIS log-weight need (when those options are on), over T splits."""
    arrays, mask = _batch(rng, 7, 11, empty_rows=(1, 4))
    x = _inputs(arrays, mask, ALL)
    tokens = {k: v for k, v in x._asdict().items() if v is not None}
    plan = PLANS["t_splits"]
    token_level = pl_ppo_kernels.forward_sums(tokens, ppo_math.PPOConfig(tis_cap=2.0), plan)
    assert "log_ratio" not in token_level and "tis_log_weight" not in token_level
    cfg = ppo_math.PPOConfig(tis_cap=2.0, ratio_level="sequence", tis_level="sequence")
    sums = pl_ppo_kernels.forward_sums(tokens, cfg, plan)
    assert_close(sums["count"], mask.sum(1))
    d = arrays["logp"] - arrays["old_logp"]
    assert_close(sums["log_ratio"], (mask * d).sum(1), scale=np.abs(d).sum(1))
    w = arrays["old_logp"] - arrays["rollout_logp"]
    assert_close(sums["tis_log_weight"], (mask * w).sum(1), scale=np.abs(w).sum(1))


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2"])
def test_kl_estimators(rng, estimator):
    arrays, mask = _batch(rng, 5, 9)
    cfg = ppo_math.PPOConfig(kl_coef=0.3, kl_estimator=estimator)
    _check(rng, arrays, mask, cfg, BASE + ("ref_logp",), PLANS["multi_tile"])


def test_defaults_and_default_plan(rng):
    """No optional input: only the four base metrics; the heuristic plan."""
    arrays, mask = _batch(rng, 6, 10)
    _check(rng, arrays, mask, ppo_math.PPOConfig(), BASE, None)


def test_rollout_without_cap_is_ignored(rng):
    """rollout_logp without tis_cap changes nothing (as in ppo_math)."""
    arrays, mask = _batch(rng, 3, 5)
    x = _inputs(arrays, mask, BASE + ("rollout_logp",))
    a = pl_ppo.ppo_loss(x, ppo_math.PPOConfig(), plan=PLANS["multi_tile"])
    b = pl_ppo.ppo_loss(
        x._replace(rollout_logp=None), ppo_math.PPOConfig(), plan=PLANS["multi_tile"]
    )
    assert float(a[0]) == float(b[0]) and set(a[1]) == set(b[1])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_all_masked(rng, mode):
    arrays, _ = _batch(rng, 3, 6)
    mask = np.zeros((3, 6))
    cfg = ppo_math.PPOConfig(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01, loss_agg_mode=mode)
    loss, d_lp = _check(rng, arrays, mask, cfg, BASE + ("ref_logp", "entropy"), PLANS["multi_tile"])
    assert float(loss) == 0.0
    assert_zero(d_lp, "d_logp with nothing valid")


def test_jit_vmap_and_determinism(rng):
    """vmap over independent batches equals the loop; two runs are bitwise equal."""
    k, b, t = 3, 4, 6
    stacks = [_batch(rng, b, t) for _ in range(k)]
    xs = jax.tree.map(
        lambda *a: jnp.stack(a), *[_inputs(a, m, BASE + ("entropy",)) for a, m in stacks]
    )
    cfg = ppo_math.PPOConfig(entropy_coef=0.05, loss_agg_mode="seq_mean_token_mean")
    plan = PLANS["multi_tile"]

    def run(x):
        return jax.value_and_grad(
            lambda lp, e: pl_ppo.ppo_loss(x._replace(logp=lp, entropy=e), cfg, plan=plan)[0],
            argnums=(0, 1),
        )(x.logp, x.entropy)

    step = jax.jit(jax.vmap(run))
    loss, (d_lp, d_ent) = step(xs)
    for i in range(k):
        l_i, (dl_i, de_i) = jax.jit(run)(jax.tree.map(lambda a: a[i], xs))
        np.testing.assert_allclose(float(loss[i]), float(l_i), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(d_lp[i]), np.asarray(dl_i), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(np.asarray(d_ent[i]), np.asarray(de_i), rtol=1e-6, atol=1e-9)
    assert_bitwise((loss, (d_lp, d_ent)), step(xs))


def test_plan_heuristic():
    cdiv = lambda a, b: -(-a // b)
    for b, t in [(128, 512), (7, 11), (1024, 8192), (3, 1), (8, 32768), (1, 100000)]:
        plan = pl_ppo_kernels.make_launch(b, t)
        assert plan.block_t & (plan.block_t - 1) == 0 and plan.block_t <= 1024
        assert plan.block_rows * plan.block_t <= max(pl_ppo_kernels.TILE_ELEMENTS, plan.block_t)
        row_tiles, t_tiles = cdiv(b, plan.block_rows), cdiv(t, plan.block_t)
        splits = cdiv(t_tiles, plan.t_tiles_per_program)
        assert 1 <= plan.t_tiles_per_program <= t_tiles
        # T is split only while the grid is short of MIN_SUM_PROGRAMS programs
        assert splits == 1 or row_tiles * (splits - 1) < pl_ppo_kernels.MIN_SUM_PROGRAMS
    long = pl_ppo_kernels.make_launch(8, 32768)
    assert long.t_tiles_per_program < 32  # small B, long T: T is split over programs


# ----------------------------------------------------------------------------- group advantages

GROUPINGS = {
    "size4": np.repeat(np.arange(3), 4),
    "ragged": np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3]),  # includes a group of one
}


@pytest.mark.parametrize("normalize_std,ddof", [(True, 0), (True, 1), (False, 0)])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_group_advantages(rng, grouping, normalize_std, ddof):
    seg = GROUPINGS[grouping]
    r = np.asarray(rng.standard_normal(seg.size), np.float32).astype(np.float64)
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(seg)) + 1, [seg.size]])
    kw = dict(normalize_std=normalize_std, std_ddof=ddof, eps=1e-6)
    fn = lambda r: pl_ppo.group_advantages(r, jnp.asarray(seg), int(seg.max()) + 1, **kw)
    adv, vjp = jax.vjp(fn, jnp.asarray(r, jnp.float32))
    assert_close(adv, oracle.group_advantages(r, group_boundaries=bounds, **kw), name="adv")
    g = cotangent(rng, (seg.size,))
    (d,) = vjp(g)
    assert_close(
        d,
        oracle.group_advantages_vjp(r, np.asarray(g), group_boundaries=bounds, **kw),
        name="d_rewards",
    )


def test_group_advantages_many_blocks(rng, monkeypatch):
    """Rewards scanned in several blocks (the last partial), group ids unsorted."""
    monkeypatch.setattr(pl_ppo, "GROUP_BLOCK", 8)
    seg = rng.permutation(np.repeat(np.arange(4), 5))
    r = np.asarray(rng.standard_normal(seg.size), np.float32).astype(np.float64)
    adv = pl_ppo.group_advantages(jnp.asarray(r, jnp.float32), jnp.asarray(seg), 4)
    want = np.zeros_like(r)
    for k in range(4):
        c = r[seg == k] - r[seg == k].mean()
        want[seg == k] = c / (np.sqrt(np.mean(c * c)) + 1e-6)
    assert_close(adv, want)


# ----------------------------------------------------------------------------- GPU


def _check_real_size(rng, arrays, mask, cfg):
    """_check with every input and the heuristic plan, then the jitted loss and gradient
    bitwise equal on a rerun."""
    _check(rng, arrays, mask, cfg, ALL, None)
    x = _inputs(arrays, mask, ALL)
    step = jax.jit(jax.value_and_grad(lambda lp: pl_ppo.ppo_loss(x._replace(logp=lp), cfg)[0]))
    assert_bitwise(step(x.logp), step(x.logp))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_ppo_real_size(rng, mode):
    arrays, mask = _batch(rng, 128, 512, empty_rows=(3, 77))
    cfg = ppo_math.PPOConfig(
        dual_clip=3.0, tis_cap=2.0, kl_coef=0.05, entropy_coef=0.01, loss_agg_mode=mode
    )
    _check_real_size(rng, arrays, mask, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("b,t", [(128, 512), (3, 20000)])
@pytest.mark.parametrize(
    "variant",
    VARIANTS + [("sequence", "ppo", "token", "truncate"), ("token", "cispo", "token", "truncate")],
    ids="-".join,
)
def test_gpu_policy_variants_real_size(rng, variant, b, t):
    """The new options at realistic sizes (incl. long T split over programs): oracle values,
    metrics, gradients, and bitwise-equal reruns."""
    arrays, mask = _batch(rng, b, t, empty_rows=(1,))
    ratio_level, policy_loss, tis_level, tis_mode = variant
    cfg = ppo_math.PPOConfig(
        clip_low=0.2,
        clip_high=0.28,
        tis_cap=2.0,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode="seq_mean_token_mean",
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        tis_level=tis_level,
        tis_mode=tis_mode,
    )
    _check_real_size(rng, arrays, mask, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids="-".join)
def test_gpu_packed_rows_real_size(rng, variant):
    """``segment_ppo_loss`` on 512 sequences of up to 400 tokens packed into rows of 2048:
    the padded oracle's values and gradients, and bitwise-equal reruns."""
    lengths = rng.integers(1, 401, 512)
    packed = Packed(rng, lengths, 2048, interleave=True)
    arrays, mask = _batch(rng, packed.S, packed.L, empty_rows=(5,))
    mask = mask * packed.pad_mask()
    ratio_level, policy_loss, tis_level, tis_mode = variant
    cfg = ppo_math.PPOConfig(
        tis_cap=2.0,
        kl_coef=0.05,
        entropy_coef=0.01,
        loss_agg_mode="seq_mean_token_sum_norm",
        max_len=400,
        ratio_level=ratio_level,
        policy_loss=policy_loss,
        tis_level=tis_level,
        tis_mode=tis_mode,
    )
    _check(rng, arrays, mask, cfg, ALL, None, packed)
    x = ppo_math.PPOInputs(
        *(None if v is None else jnp.asarray(packed.pack(v)) for v in _inputs(arrays, mask, ALL))
    )
    packing = segment_math.Packing(jnp.asarray(packed.ids), packed.S)
    step = jax.jit(
        jax.value_and_grad(lambda lp: pl_ppo.segment_ppo_loss(x._replace(logp=lp), cfg, packing)[0])
    )
    assert_bitwise(step(x.logp), step(x.logp))


@pytest.mark.gpu
def test_gpu_group_advantages(rng):
    seg = np.repeat(np.arange(512), 8)
    r = np.asarray(rng.standard_normal(seg.size), np.float32).astype(np.float64)
    adv = pl_ppo.group_advantages(jnp.asarray(r, jnp.float32), jnp.asarray(seg), 512)
    assert_close(adv, oracle.group_advantages(r, group_size=8))
