"""The Pallas logits kernels (token_logprobs, paired_logprobs) against the float64 oracle.

CPU: interpret mode, small shapes, with explicit launch plans so that several vocabulary
tiles (the last one partial), the in-kernel finalisation (one split) and the split-V
merge all run. GPU (marked ``gpu``): the real sizes B·T = 8192 rows, V ∈ {32000, 151936},
checked on sampled rows against float64 and for bitwise determinism.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernel_entry
from jaxrl_kernels.backends.pallas import logits as pl_logits
from jaxrl_kernels.dispatch.contract import Problem
from tests.conftest import assert_bitwise, assert_close, assert_zero, cotangent, dtype_id, rand
from tests.support import oracle

IGNORE = -100
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Small plans: block_v 64 over V = 150 is three tiles, the last 22 wide.
PLANS = {
    "one_split": pl_logits.LogitsLaunch(64, 1, 2, 1),
    "three_splits": pl_logits.LogitsLaunch(64, 3, 2, 1),
}


def _rows(rng, n, vocab, *, n_invalid=2, n_out_of_range=1):
    """targets with a few invalid rows (ignored by row_valid) and out-of-range valid rows."""
    t = rng.integers(0, vocab, n)
    valid = np.ones(n, bool)
    valid[rng.choice(n, n_invalid, replace=False)] = False
    t[~valid] = IGNORE  # invalid rows carry ids the kernel must never use
    bad = rng.choice(np.flatnonzero(valid), n_out_of_range, replace=False)
    t[bad] = np.where(np.arange(n_out_of_range) % 2 == 0, vocab + 5, -3)
    return t, valid


def _oracle_lp(l64, t, temperature, dt=np.float64):
    return oracle.token_logprobs(l64, t, temperature=temperature, ignore_index=IGNORE, dt=dt)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_token_logprobs_values_and_vjp(rng, plan, dtype):
    n, vocab, temperature = 9, 150, 0.7
    logits, l64 = rand(rng, (n, vocab), dtype, scale=3.0)
    t, valid = _rows(rng, n, vocab)
    fn = lambda x: kernel_entry.pallas_token_logprobs(
        x,
        jnp.asarray(t),
        jnp.asarray(valid),
        temperature=temperature,
        return_entropy=True,
        plan=PLANS[plan],
    )
    (logp, ent), vjp = jax.vjp(fn, logits)
    scale = np.abs(l64).max() / temperature
    want, w32 = _oracle_lp(l64, t, temperature), _oracle_lp(l64, t, temperature, np.float32)
    assert_close(logp, want[0], in_dtype=dtype, want32=w32[0], scale=scale, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=w32[1], scale=scale, name="entropy")
    g, ge = cotangent(rng, (n,)), cotangent(rng, (n,))
    (d,) = vjp((g, ge))
    assert d.dtype == dtype
    kw = dict(temperature=temperature, ignore_index=IGNORE)
    want_d = oracle.token_logprobs_vjp(l64, t, np.asarray(g), np.asarray(ge), **kw)
    want_d32 = oracle.token_logprobs_vjp(l64, t, np.asarray(g), np.asarray(ge), dt=np.float32, **kw)
    assert_close(d, want_d, in_dtype=dtype, want32=want_d32, name="d_logits")
    assert_zero(np.asarray(d)[~valid], "gradient of invalid rows")
    assert_zero(np.asarray(logp)[~valid], "logp of invalid rows")


@pytest.mark.parametrize("plan", [None, "three_splits"])
def test_token_logprobs_without_entropy(rng, plan):
    n, vocab = 6, 150
    logits, l64 = rand(rng, (n, vocab), scale=2.0)
    t, valid = _rows(rng, n, vocab, n_invalid=1, n_out_of_range=0)
    fn = lambda x: kernel_entry.pallas_token_logprobs(
        x, jnp.asarray(t), jnp.asarray(valid), plan=PLANS.get(plan)
    )
    (logp, ent), vjp = jax.vjp(fn, logits)
    assert ent is None
    assert_close(logp, _oracle_lp(l64, t, 1.0)[0], scale=np.abs(l64).max())
    g = cotangent(rng, (n,))
    (d,) = vjp((g, None))
    assert_close(d, oracle.token_logprobs_vjp(l64, t, np.asarray(g), ignore_index=IGNORE))


@pytest.mark.parametrize("plan", list(PLANS))
def test_paired_logprobs_gradient_to_policy_only(rng, plan):
    """Mixed dtypes (bf16 policy, f16 reference); the reference gets an exactly zero cotangent."""
    n, vocab, temperature = 7, 150, 1.3
    pol, p64 = rand(rng, (n, vocab), jnp.bfloat16, scale=2.0)
    ref, r64 = rand(rng, (n, vocab), jnp.float16, scale=2.0)
    t, valid = _rows(rng, n, vocab)
    fn = lambda a, b: kernel_entry.pallas_paired_logprobs(
        a, b, jnp.asarray(t), jnp.asarray(valid), temperature=temperature, plan=PLANS[plan]
    )
    (lp, ref_lp), vjp = jax.vjp(fn, pol, ref)
    for got, x64, dt, name in ((lp, p64, jnp.bfloat16, "logp"), (ref_lp, r64, jnp.float16, "ref")):
        assert_close(
            got,
            _oracle_lp(x64, t, temperature)[0],
            in_dtype=dt,
            want32=_oracle_lp(x64, t, temperature, np.float32)[0],
            scale=np.abs(x64).max() / temperature,
            name=name,
        )
    g, g_ref = cotangent(rng, (n,)), cotangent(rng, (n,))
    d_pol, d_ref = vjp((g, g_ref))
    kw = dict(temperature=temperature, ignore_index=IGNORE)
    assert_close(
        d_pol,
        oracle.token_logprobs_vjp(p64, t, np.asarray(g), **kw),
        in_dtype=jnp.bfloat16,
        want32=oracle.token_logprobs_vjp(p64, t, np.asarray(g), dt=np.float32, **kw),
    )
    assert_zero(d_ref, "reference-logits gradient")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=dtype_id)
def test_extreme_logits_across_tiles(rng, dtype):
    """±1e4 logits with the maximum in different tiles and splits stay finite and exact."""
    n, vocab = 5, 150
    l = rng.choice([-1e4, 0.0, 1e4], size=(n, vocab)).astype(np.float32)
    l[0] = -1e4
    l[1] = 1e4
    l[2] = -1e4
    l[2, 149] = 1e4  # the max in the partial last tile
    l[3] = -1e4
    l[3, 0] = 1e4  # the max in the first tile
    logits = jnp.asarray(l).astype(dtype)
    l64 = np.asarray(logits).astype(np.float64)
    t = rng.integers(0, vocab, n)
    valid = np.ones(n, bool)
    for plan in PLANS.values():
        fn = lambda x: kernel_entry.pallas_token_logprobs(
            x, jnp.asarray(t), jnp.asarray(valid), return_entropy=True, plan=plan
        )
        (logp, ent), vjp = jax.vjp(fn, logits)
        (d,) = vjp((cotangent(rng, (n,)), cotangent(rng, (n,))))
        for name, x in (("logp", logp), ("entropy", ent), ("d_logits", d)):
            assert np.isfinite(np.asarray(x).astype(np.float64)).all(), f"{name} not finite"
        want, w32 = _oracle_lp(l64, t, 1.0), _oracle_lp(l64, t, 1.0, np.float32)
        assert_close(logp, want[0], in_dtype=dtype, want32=w32[0], scale=1e4, name="logp")
        assert_close(ent, want[1], in_dtype=dtype, want32=w32[1], scale=1e4, name="entropy")


def test_jit_vmap_grad_and_determinism(rng):
    """vmap over a batch of problems equals the loop (to rounding: XLA fuses the split merge
    differently for the batch), under jit; two runs are bitwise equal."""
    k, n, vocab = 3, 4, 150
    logits, _ = rand(rng, (k, n, vocab), jnp.bfloat16, scale=2.0)
    t = jnp.asarray(rng.integers(0, vocab, (k, n)), jnp.int32)
    valid = jnp.asarray(rng.random((k, n)) < 0.8)
    g, ge = cotangent(rng, (k, n)), cotangent(rng, (k, n))

    def run(x, t, v, g, ge):
        fn = lambda x: kernel_entry.pallas_token_logprobs(
            x, t, v, return_entropy=True, plan=PLANS["three_splits"]
        )
        out, vjp = jax.vjp(fn, x)
        return out, vjp((g, ge))[0]

    step = jax.jit(jax.vmap(run))
    (lp, ent), d = step(logits, t, valid, g, ge)
    for i in range(k):
        (lp_i, ent_i), d_i = jax.jit(run)(logits[i], t[i], valid[i], g[i], ge[i])
        for a, b in ((lp[i], lp_i), (ent[i], ent_i), (d[i], d_i)):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6
            )
    assert_bitwise(((lp, ent), d), step(logits, t, valid, g, ge))


def test_plan_heuristic():
    """Tiles are powers of two of at most TILE_BYTES; splits only when rows are few."""
    for n, vocab, itemsize in [
        (8192, 151936, 2),
        (8192, 32000, 4),
        (16, 151936, 2),
        (3, 7, 4),
        (100, 50257, 2),
    ]:
        plan = pl_logits.make_launch(n, vocab, itemsize)
        assert plan.block_v & (plan.block_v - 1) == 0
        assert plan.block_v * itemsize <= pl_logits.TILE_BYTES
        assert plan.block_v <= 1 << max(vocab - 1, 0).bit_length()  # ≤ next power of two ≥ V
        n_tiles = -(-vocab // plan.block_v)
        assert 1 <= plan.splits <= n_tiles
        assert (plan.splits - 1) * plan.tiles_per_split(vocab) < n_tiles  # every split has a tile
        assert (plan.splits == 1) == (n >= pl_logits.MIN_PROGRAMS or n_tiles == 1)
        assert 1 <= plan.num_warps <= 8


def test_declines_float64():
    problem = Problem(n_rows=4, vocab=8, dtype="float64")
    assert "float64" in pl_logits.declines("token_logprobs", problem)
    bf16 = Problem(dtype="bfloat16")
    assert pl_logits.declines("token_logprobs", bf16) is None


def test_kernels_lower_to_triton():
    """The kernels lower to Triton IR for an H100 (checked on any host, without compiling)."""
    try:
        from jax._src.pallas.triton import gpu_info
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError as err:  # private modules: skip rather than fail on a jax upgrade
        pytest.skip(f"Pallas Triton internals unavailable: {err}")
    from jaxrl_kernels.backends.pallas import common

    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    x = jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16)
    t, v = jnp.zeros((64,), jnp.int32), jnp.ones((64,), bool)
    orig_info, orig_interpret = reg.gpu_info_lib.get_gpu_info, common.interpret
    reg.gpu_info_lib.get_gpu_info, common.interpret = (lambda: h100), (lambda: False)
    try:
        for splits in (1, 4):
            plan = pl_logits.LogitsLaunch(256, splits, 4, 2)
            tok = lambda x: jnp.sum(
                sum(
                    kernel_entry.pallas_token_logprobs(
                        x, t, v, temperature=0.5, return_entropy=True, plan=plan
                    )
                )
            )
            pair = lambda x: jnp.sum(kernel_entry.pallas_paired_logprobs(x, x, t, v, plan=plan)[0])
            for f in (tok, pair):
                text = jax.jit(jax.grad(f)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("__gpu$xla.gpu.triton") == 2  # forward + backward kernel
    finally:
        reg.gpu_info_lib.get_gpu_info, common.interpret = orig_info, orig_interpret


# ----------------------------------------------------------------------------- GPU, real sizes

ROWS_CHECKED = 48


def _bitwise_equal(a, b):
    """Same bits, compared on the device (the arrays are GBs)."""
    as_int = {2: jnp.int16, 4: jnp.int32}[jnp.dtype(a.dtype).itemsize]
    same = jax.lax.bitcast_convert_type(a, as_int) == jax.lax.bitcast_convert_type(b, as_int)
    return bool(jnp.all(same))


def _sampled_oracle_check(rng, logits, t, valid, logp, ent, d, g, ge, dtype):
    rows = rng.choice(logits.shape[0], ROWS_CHECKED, replace=False)
    rows = np.union1d(rows, np.flatnonzero(~valid)[:4])
    l64 = np.asarray(logits[rows]).astype(np.float64)
    tr = t[rows]
    scale = np.abs(l64).max()
    want, w32 = _oracle_lp(l64, tr, 1.0), _oracle_lp(l64, tr, 1.0, np.float32)
    assert_close(np.asarray(logp)[rows], want[0], in_dtype=dtype, want32=w32[0], scale=scale)
    if ent is not None:
        assert_close(np.asarray(ent)[rows], want[1], in_dtype=dtype, want32=w32[1], scale=scale)
    gr, ger = np.asarray(g)[rows], None if ge is None else np.asarray(ge)[rows]
    kw = dict(ignore_index=IGNORE)
    assert_close(
        np.asarray(d[rows]),
        oracle.token_logprobs_vjp(l64, tr, gr, ger, **kw),
        in_dtype=dtype,
        want32=oracle.token_logprobs_vjp(l64, tr, gr, ger, dt=np.float32, **kw),
        name="d_logits",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=dtype_id)
def test_gpu_token_logprobs_real_size(rng, vocab, dtype):
    n = 16 * 512
    key = jax.random.key(int(rng.integers(1 << 30)))
    logits = (jax.random.normal(key, (n, vocab)) * 3).astype(dtype)
    t, valid = _rows(rng, n, vocab, n_invalid=64, n_out_of_range=0)
    g, ge = cotangent(rng, (n,)), cotangent(rng, (n,))

    def run(x):
        fn = lambda x: kernel_entry.pallas_token_logprobs(
            x, jnp.asarray(t), jnp.asarray(valid), return_entropy=True
        )
        (lp, ent), vjp = jax.vjp(fn, x)
        return lp, ent, vjp((g, ge))[0]

    step = jax.jit(run)
    lp, ent, d = step(logits)
    assert np.isfinite(np.asarray(lp)).all() and np.isfinite(np.asarray(ent)).all()
    _sampled_oracle_check(rng, logits, t, valid, lp, ent, d, g, ge, dtype)
    for a, b in zip((lp, ent, d), step(logits)):
        assert _bitwise_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
def test_gpu_paired_logprobs_real_size(rng, vocab, dtype):
    n = 16 * 512
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))))
    pol = (jax.random.normal(keys[0], (n, vocab)) * 2).astype(dtype)
    ref = (jax.random.normal(keys[1], (n, vocab)) * 2).astype(dtype)
    t, valid = _rows(rng, n, vocab, n_invalid=64, n_out_of_range=0)
    g = cotangent(rng, (n,))

    def run(a, b):
        fn = lambda a: kernel_entry.pallas_paired_logprobs(a, b, jnp.asarray(t), jnp.asarray(valid))
        (lp, ref_lp), vjp = jax.vjp(fn, a)
        return lp, ref_lp, vjp((g, jnp.ones_like(g)))[0]

    step = jax.jit(run)
    lp, ref_lp, d = step(pol, ref)
    _sampled_oracle_check(rng, pol, t, valid, lp, None, d, g, None, dtype)
    rows = rng.choice(n, ROWS_CHECKED, replace=False)
    r64 = np.asarray(ref[rows]).astype(np.float64)
    assert_close(
        np.asarray(ref_lp)[rows],
        _oracle_lp(r64, t[rows], 1.0)[0],
        in_dtype=dtype,
        want32=_oracle_lp(r64, t[rows], 1.0, np.float32)[0],
        scale=np.abs(r64).max(),
    )
    for a, b in zip((lp, ref_lp, d), step(pol, ref)):
        assert _bitwise_equal(a, b)


@pytest.mark.gpu
def test_gpu_few_rows_split_vocabulary(rng):
    """16 rows of V = 151936 (split-V path on a GPU) against float64."""
    n, vocab = 16, 151936
    logits, l64 = rand(rng, (n, vocab), jnp.bfloat16, scale=3.0)
    t, valid = _rows(rng, n, vocab, n_invalid=2, n_out_of_range=1)
    assert pl_logits.make_launch(n, vocab, 2).splits > 1
    g, ge = cotangent(rng, (n,)), cotangent(rng, (n,))
    fn = lambda x: kernel_entry.pallas_token_logprobs(
        x, jnp.asarray(t), jnp.asarray(valid), return_entropy=True
    )
    (lp, ent), vjp = jax.vjp(fn, logits)
    (d,) = vjp((g, ge))
    want, w32 = _oracle_lp(l64, t, 1.0), _oracle_lp(l64, t, 1.0, np.float32)
    assert_close(lp, want[0], in_dtype=jnp.bfloat16, want32=w32[0], scale=np.abs(l64).max())
    assert_close(ent, want[1], in_dtype=jnp.bfloat16, want32=w32[1], scale=np.abs(l64).max())
    kw = dict(ignore_index=IGNORE)
    assert_close(
        d,
        oracle.token_logprobs_vjp(l64, t, np.asarray(g), np.asarray(ge), **kw),
        in_dtype=jnp.bfloat16,
        want32=oracle.token_logprobs_vjp(
            l64, t, np.asarray(g), np.asarray(ge), dt=np.float32, **kw
        ),
    )
