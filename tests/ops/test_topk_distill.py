"""K ids per position (``linear_logprobs`` with targets [..., K]) and the served-teacher
top-k distillation loss, against the float64 oracle: every backend and the fast mode, both
layouts, bias, temperature, float32 / bfloat16, padded and repeated ids, K in {1, 7, 64} and
K = V, tail modes; sharded meshes (Auto and Explicit axes, a user's shard_map with
``vocab_axis``); the errors docs/api.md promises; GPU runs of the kernel backends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from tests.conftest import assert_close, assert_f32, assert_zero, cotangent, pallas_sample, rand
from tests.support import oracle
from tests.support.sharding_support import on_two_devices

LAYOUTS = ["vd", "dv"]
# (leading shape, V, D, K, temperature, with bias)
CASES = [
    ((5,), 7, 16, 1, 1.0, False),
    ((3, 4), 97, 8, 7, 0.7, True),
    ((2, 33), 300, 12, 64, 1.0, True),
    ((1,), 13, 8, 13, 1.3, False),  # K = V
]
DTYPE_LAYOUTS = [(jnp.float32, "vd"), (jnp.float32, "dv"), (jnp.bfloat16, "vd")]
PALLAS_VALUES = {c + DTYPE_LAYOUTS[i % len(DTYPE_LAYOUTS)] for i, c in enumerate(CASES[:3])}


def head_inputs(rng, lead, vocab, d, dtype, layout, with_bias):
    hidden, h64 = rand(rng, lead + (d,), dtype)
    wshape = (vocab, d) if layout == "vd" else (d, vocab)
    weight, w64 = rand(rng, wshape, dtype, scale=2.0 / np.sqrt(d))
    bias, b64 = rand(rng, (vocab,), dtype, scale=0.5) if with_bias else (None, None)
    return hidden, h64, weight, w64, bias, b64


def draw_ids(rng, lead, vocab, k):
    """Distinct ids per position (a permutation's first k) with padding (-1) in some positions,
    one position all padding and, where k > 2, one repeated id."""
    ids = np.argsort(rng.random(lead + (vocab,)), axis=-1)[..., :k].astype(np.int32)
    flat = ids.reshape(-1, k)
    if flat.shape[0] > 1:
        flat[1, :] = -1
    if k > 2:
        flat[0, -1] = -1
        flat[-1, 1] = flat[-1, 0]
    return ids


def check_ids(
    rng, hidden, h64, weight, w64, bias, b64, ids, *, layout, temperature, backend=None, memory=None
):
    dtype = hidden.dtype
    primals = (hidden, weight) if bias is None else (hidden, weight, bias)

    def fn(h, w, b=None):
        return jk.linear_logprobs(
            h,
            w,
            jnp.asarray(ids),
            b,
            weight_layout=layout,
            temperature=temperature,
            return_entropy=True,
            backend=backend,
            memory=memory,
        )

    (logp, ent), vjp = jax.vjp(fn, *primals)
    assert_f32(logp, ent)
    assert logp.shape == ids.shape and ent.shape == ids.shape[:-1]
    kw = dict(weight_layout=layout, temperature=temperature)
    want = oracle.linear_id_logprobs(h64, w64, ids, b64, **kw)
    want32 = oracle.linear_id_logprobs(h64, w64, ids, b64, dt=np.float32, **kw)
    zscale = np.max(np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)))
    zscale /= temperature
    assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=zscale, name="entropy")
    assert_zero(np.asarray(logp)[ids < 0], "logp at padding ids")

    g_lp, g_ent = cotangent(rng, ids.shape), cotangent(rng, ids.shape[:-1])
    grads = vjp((g_lp, g_ent))
    args = (h64, w64, ids, np.asarray(g_lp), np.asarray(g_ent), b64)
    gw = oracle.linear_id_logprobs_vjp(*args, **kw)
    gw32 = oracle.linear_id_logprobs_vjp(*args, dt=np.float32, **kw)
    for name, got, p, w, w32 in zip(("d_hidden", "d_weight", "d_bias"), grads, primals, gw, gw32):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w, in_dtype=dtype, want32=w32, name=name)
    return logp, ent, grads


@pytest.mark.parametrize(
    "lead,vocab,d,k,temperature,with_bias,dtype,layout",
    pallas_sample(PALLAS_VALUES, CASES, DTYPE_LAYOUTS),
)
def test_ids_values_and_vjp(backend, rng, lead, vocab, d, k, temperature, with_bias, dtype, layout):
    h, h64, w, w64, b, b64 = head_inputs(rng, lead, vocab, d, dtype, layout, with_bias)
    ids = draw_ids(rng, lead, vocab, k)
    logp, ent, grads = check_ids(
        rng, h, h64, w, w64, b, b64, ids, layout=layout, temperature=temperature, backend=backend
    )
    padded = (ids < 0).all(-1)
    assert_zero(np.asarray(ent)[padded], "entropy of an all-padding position")
    assert_zero(np.asarray(grads[0])[padded], "d_hidden of an all-padding position")


@pytest.mark.parametrize("lead,vocab,d,k,temperature,with_bias", CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ids_fast_mode(rng, lead, vocab, d, k, temperature, with_bias, layout):
    """memory="fast" (the logits kept) against the oracle, float32 heads."""
    h, h64, w, w64, b, b64 = head_inputs(rng, lead, vocab, d, jnp.float32, layout, with_bias)
    check_ids(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        draw_ids(rng, lead, vocab, k),
        layout=layout,
        temperature=temperature,
        memory="fast",
    )


def test_ids_fast_mode_bfloat16_matches_lean(rng):
    """A bfloat16 head's fast mode rounds the kept logits once: within bfloat16's rounding of
    the lean result."""
    h, _, w, _, b, _ = head_inputs(rng, (4, 9), 211, 16, jnp.bfloat16, "vd", True)
    ids = jnp.asarray(draw_ids(rng, (4, 9), 211, 8))
    g = cotangent(rng, ids.shape)

    def run(memory):
        f = lambda h, w, b: jnp.sum(g * jk.linear_logprobs(h, w, ids, b, memory=memory))
        vg = jax.value_and_grad(f, argnums=(0, 1, 2))
        # the lean call is the expected side (eager elsewhere): under jit
        return (jax.jit(vg) if memory == "lean" else vg)(h, w, b)

    (v_lean, g_lean), (v_fast, g_fast) = run("lean"), run("fast")
    np.testing.assert_allclose(float(v_fast), float(v_lean), rtol=2e-2)
    for a, c in zip(g_fast, g_lean):
        a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
        assert np.max(np.abs(a - c)) <= 2e-2 * np.max(np.abs(c))


def test_one_position(backend, rng):
    """hidden [D] with ids [K]: one position, outputs [K] and a scalar entropy."""
    h, h64, w, w64, b, b64 = head_inputs(rng, (), 29, 8, jnp.float32, "vd", True)
    ids = np.array([3, 28, 0, 3, -1], np.int32)
    logp, ent, _ = check_ids(
        rng, h, h64, w, w64, b, b64, ids, layout="vd", temperature=1.0, backend=backend
    )
    assert logp.shape == (5,) and ent.shape == ()


def test_k_ids_equal_k_single_calls(backend, rng):
    """Each column of the K-id result is the one-id call at that column's ids."""
    h, _, w, _, b, _ = head_inputs(rng, (3, 5), 61, 8, jnp.float32, "dv", True)
    ids = np.argsort(rng.random((3, 5, 61)), axis=-1)[..., :4].astype(np.int32)
    many = jk.linear_logprobs(h, w, jnp.asarray(ids), b, weight_layout="dv", backend=backend)
    for k in range(4):
        one = jk.linear_logprobs(
            h, w, jnp.asarray(ids[..., k]), b, weight_layout="dv", backend=backend
        )
        np.testing.assert_allclose(np.asarray(many[..., k]), np.asarray(one), rtol=2e-6, atol=2e-6)


def test_ids_ignore_index(backend, rng):
    """ignore_index marks ids as padding too (with ids < 0)."""
    h, _, w, _, _, _ = head_inputs(rng, (4,), 31, 8, jnp.float32, "vd", False)
    ids = np.array([[1, 7, 7], [0, 5, -3], [5, 5, 5], [2, 30, 9]], np.int32)
    g = jnp.asarray(rng.standard_normal(ids.shape), jnp.float32)
    f = lambda h, w: jnp.sum(
        g * jk.linear_logprobs(h, w, jnp.asarray(ids), ignore_index=5, backend=backend)
    )
    val, (dh, _) = jax.value_and_grad(f, argnums=(0, 1))(h, w)
    logp = jk.linear_logprobs(h, w, jnp.asarray(ids), ignore_index=5, backend=backend)
    assert_zero(np.asarray(logp)[(ids == 5) | (ids < 0)], "logp at ignored ids")
    assert_zero(dh[2], "d_hidden of a position whose ids are all ignored")
    assert np.all(np.asarray(logp)[(ids != 5) & (ids >= 0)] < 0)


# -- the loss ---------------------------------------------------------------------------------


def teacher_topk(rng, b, t, vocab, k, *, full_mass_at=None):
    """A random teacher's top-k ids [B, T, K] and log-probs (its own full softmax), padding in
    one position; ``full_mass_at``: a position whose teacher puts all its mass on its ids."""
    z = 2.0 * rng.standard_normal((b, t, vocab))
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=-1)[..., :k].astype(np.int32)
    t_logp = np.take_along_axis(logp, ids, -1)
    if full_mass_at is not None:
        t_logp[full_mass_at] -= np.log(np.exp(t_logp[full_mass_at]).sum())
    if k > 1 and t > 1:
        ids[0, 1, k // 2 :] = -1
    return ids, t_logp.astype(np.float32)


def oracle_loss(h64, w64, b64, ids, t_logp, mask, *, layout, temperature, tail, mode):
    """(loss, per_token, d_hidden, d_weight, d_bias) in float64."""
    kw = dict(weight_layout=layout, temperature=temperature)
    ls, _ = oracle.linear_id_logprobs(h64, w64, ids, b64, **kw)
    d, dd = oracle.topk_distill_terms(ls, t_logp, ids, tail)
    d = np.where(mask != 0, d, 0)
    weights = oracle.aggregate_weights(mask, mode)
    g = np.where(mask[..., None] != 0, weights[..., None] * dd, 0)
    grads = oracle.linear_id_logprobs_vjp(h64, w64, ids, g, None, b64, **kw)
    return (np.sum(weights * d), d) + tuple(grads)


LOSS_CASES = [  # (B, T, V, D, K, tail, temperature, with bias, layout, loss_agg_mode)
    (2, 5, 97, 8, 7, "drop", 1.0, False, "vd", "token_mean"),
    (2, 5, 97, 8, 7, "bucket", 0.8, True, "dv", "seq_mean_token_mean"),
    (1, 3, 41, 8, 1, "bucket", 1.0, False, "vd", "seq_mean_token_sum"),
    (2, 4, 300, 12, 64, "bucket", 1.2, True, "vd", "token_mean"),
    (1, 2, 16, 8, 16, "bucket", 1.0, False, "dv", "token_mean"),  # K = V: r_t = 0
]


@pytest.mark.parametrize(
    "b,t,vocab,d,k,tail,temperature,with_bias,layout,mode",
    pallas_sample({LOSS_CASES[0], LOSS_CASES[1]}, LOSS_CASES),
)
def test_topk_distill_loss(
    backend, rng, b, t, vocab, d, k, tail, temperature, with_bias, layout, mode
):
    h, h64, w, w64, bias, b64 = head_inputs(rng, (b, t), vocab, d, jnp.float32, layout, with_bias)
    ids, t_logp = teacher_topk(rng, b, t, vocab, k, full_mass_at=(b - 1, t - 1))
    mask = np.ones((b, t), np.float32)
    mask[0, 0] = 0
    primals = (h, w) if bias is None else (h, w, bias)

    def fn(*args):
        return jk.linear_topk_distill_loss(
            args[0],
            args[1],
            jnp.asarray(ids),
            jnp.asarray(t_logp),
            jnp.asarray(mask),
            bias=args[2] if len(args) == 3 else None,
            weight_layout=layout,
            temperature=temperature,
            tail=tail,
            loss_agg_mode=mode,
            backend=backend,
        )

    (loss, per_token), grads = jax.value_and_grad(
        fn, argnums=tuple(range(len(primals))), has_aux=True
    )(*primals)
    want = oracle_loss(
        h64,
        w64,
        b64,
        ids,
        t_logp,
        mask,
        layout=layout,
        temperature=temperature,
        tail=tail,
        mode=mode,
    )
    assert_f32(loss, per_token)
    assert_close(loss, want[0], name="loss")
    assert_close(per_token, want[1], name="per_token")
    assert_zero(np.asarray(per_token)[0, 0], "per_token where mask is 0")
    for name, got, w_ in zip(("d_hidden", "d_weight", "d_bias"), grads, want[2:]):
        assert_close(got, w_, name=name)
    assert_zero(np.asarray(grads[0])[0, 0], "d_hidden where mask is 0")


@pytest.mark.parametrize("tail", ["drop", "bucket"])
def test_topk_distill_loss_bfloat16_and_fast(rng, tail):
    """bfloat16 heads, lean and fast, against the float64 oracle on the values they hold."""
    b, t, vocab, d, k = 2, 6, 203, 16, 9
    h, h64, w, w64, bias, b64 = head_inputs(rng, (b, t), vocab, d, jnp.bfloat16, "vd", True)
    ids, t_logp = teacher_topk(rng, b, t, vocab, k)
    mask = np.ones((b, t), np.float32)
    want = oracle_loss(
        h64, w64, b64, ids, t_logp, mask, layout="vd", temperature=1.0, tail=tail, mode="token_mean"
    )
    for memory in ("lean", "fast"):
        f = lambda h, w, b: jk.linear_topk_distill_loss(
            h, w, ids, t_logp, mask, bias=b, tail=tail, memory=memory
        )[0]
        loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, bias)
        np.testing.assert_allclose(float(loss), want[0], rtol=2e-2, atol=2e-3)
        for got, w_ in zip(grads, want[2:]):
            err = np.max(np.abs(np.asarray(got, np.float64) - w_)) / np.max(np.abs(w_))
            assert err <= 2e-2, (memory, err)


def test_teacher_gets_no_gradient(rng):
    h, _, w, _, _, _ = head_inputs(rng, (1, 4), 23, 8, jnp.float32, "vd", False)
    ids, t_logp = teacher_topk(rng, 1, 4, 23, 5)
    g = jax.grad(
        lambda lt: jk.linear_topk_distill_loss(h, w, ids, lt, jnp.ones((1, 4)), tail="bucket")[0]
    )(jnp.asarray(t_logp))
    assert_zero(g, "d teacher_logp")


def test_loss_is_zero_when_student_is_teacher(rng):
    """A student whose softmax is the teacher's: the forward KL (with the tail) is 0."""
    h, _, w, _, bias, _ = head_inputs(rng, (1, 3), 50, 8, jnp.float32, "vd", True)
    logp = jk.linear_logprobs(h, w, jnp.broadcast_to(jnp.arange(50), (1, 3, 50)), bias)
    order = np.argsort(-np.asarray(logp), axis=-1)[..., :6].astype(np.int32)
    t_logp = np.take_along_axis(np.asarray(logp), order, -1)
    for tail in ("drop", "bucket"):
        _, d = jk.linear_topk_distill_loss(
            h, w, order, t_logp, jnp.ones((1, 3)), bias=bias, tail=tail
        )
        if tail == "bucket":
            np.testing.assert_allclose(np.asarray(d), 0.0, atol=2e-6)
        else:  # Σ_k p_t (log p_t − log p_s) = 0 at equal log-probs
            np.testing.assert_allclose(np.asarray(d), 0.0, atol=2e-6)


# -- errors -----------------------------------------------------------------------------------


def test_errors(rng):
    h, _, w, _, _, _ = head_inputs(rng, (2, 3), 11, 4, jnp.float32, "vd", False)
    ids = jnp.zeros((2, 3, 4), jnp.int32)
    lt = jnp.full((2, 3, 4), -2.0)
    m = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"targets: expected shape \(2, 3\) .*\(K,\)"):
        jk.linear_logprobs(h, w, jnp.zeros((2, 4, 4), jnp.int32))
    with pytest.raises(ValueError, match="targets: expected shape"):
        jk.linear_logprobs(h, w, jnp.zeros((2, 3, 0), jnp.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jk.linear_logprobs(h, w, ids.at[1, 2, 3].set(11))
    with pytest.raises(ValueError, match="teacher_ids: expected shape"):
        jk.linear_topk_distill_loss(h, w, ids[:, :2], lt, m)
    with pytest.raises(ValueError, match="teacher_ids: expected rank 3"):
        jk.linear_topk_distill_loss(h, w, ids[..., 0], lt, m)
    with pytest.raises(TypeError, match="teacher_ids: expected an integer dtype"):
        jk.linear_topk_distill_loss(h, w, lt, lt, m)
    with pytest.raises(ValueError, match="teacher_logp: expected shape"):
        jk.linear_topk_distill_loss(h, w, ids, lt[..., :2], m)
    with pytest.raises(ValueError, match="tail: unknown option 'keep'"):
        jk.linear_topk_distill_loss(h, w, ids, lt, m, tail="keep")
    with pytest.raises(ValueError, match="teacher_ids: value 11 .* outside the vocabulary"):
        jk.linear_topk_distill_loss(h, w, ids.at[0, 0, 0].set(11), lt, m)
    # a masked position's ids are not checked
    jk.linear_topk_distill_loss(h, w, ids.at[0, 0, 0].set(11), lt, m.at[0, 0].set(0))
    with pytest.raises(ValueError, match="mask: expected shape"):
        jk.linear_topk_distill_loss(h, w, ids, lt, m[:1])


# -- sharded meshes ---------------------------------------------------------------------------

SHARDED = [("Explicit", "rows"), ("Explicit", "vocab"), ("Auto", "vocab"), ("Auto", "rows")]


def two_device_inputs(rng, b, k, layout, with_bias):
    """A float32 head (t = 3 positions, V = 64, D = 8), a teacher's top-k and an all-ones mask
    for the two-device tests (skipped with fewer devices)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    h, _, w, _, bias, _ = head_inputs(rng, (b, 3), 64, 8, jnp.float32, layout, with_bias)
    ids, t_logp = teacher_topk(rng, b, 3, 64, k)
    return h, w, bias, ids, t_logp, jnp.ones((b, 3))


def sharded_cases():
    """memory × SHARDED: pallas (lean) on the vocabulary split only (its sharded kernel path;
    the rows split is a batch split), the rest pallas_slow; memory="fast" (run once, with
    backend=None) on one placement per axis type, the rest slow."""
    cases = []
    for memory in ("lean", "fast"):
        for kind, layout in SHARDED:
            marks = [] if layout == "vocab" else [pytest.mark.pallas_slow]
            if memory == "fast" and (kind, layout) not in SHARDED[1:4:2]:
                marks.append(pytest.mark.slow)
            cases.append(pytest.param(memory, kind, layout, marks=marks))
    return cases


@pytest.mark.parametrize("memory,kind,layout", sharded_cases())
def test_sharded_loss(backend, rng, kind, layout, memory):
    """Under jit with sharded inputs: the unsharded call's loss and gradients, d_weight
    sharded like the weight."""
    if memory == "fast" and backend != "reference":
        pytest.skip("the fast mode has no backend: run once")
    h, w, bias, ids, t_logp, mask = two_device_inputs(rng, 4, 5, "vd", True)
    lean_backend = None if memory == "fast" else backend

    def loss(h, w, bias):
        return jk.linear_topk_distill_loss(
            h, w, ids, t_logp, mask, bias=bias, tail="bucket", backend=lean_backend, memory=memory
        )[0]

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(h, w, bias)  # unsharded, jitted
    got = on_two_devices(loss, h, w, bias, kind=kind, layout=layout)
    vocab_spec = P() if layout == "rows" else P("x")
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, c in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)
    assert got[1][1].sharding.spec[:1] == vocab_spec[:1] or layout == "rows"


def test_shard_map_vocab_axis(backend, rng):
    """Inside a user's shard_map with the vocabulary split: global ids, global results."""
    h, w, _, ids, t_logp, mask = two_device_inputs(rng, 2, 6, "dv", False)
    mesh = jax.make_mesh((2,), ("v",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])

    @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "v")), out_specs=(P(), P()))
    def sharded(h, w_slice):
        return jk.linear_topk_distill_loss(
            h,
            w_slice,
            ids,
            t_logp,
            mask,
            weight_layout="dv",
            tail="bucket",
            backend=backend,
            vocab_axis="v",
        )

    # the unsharded call (the expected side) under jit: eager, each primitive compiles alone
    want = jax.jit(
        lambda h, w: jk.linear_topk_distill_loss(
            h, w, ids, t_logp, mask, weight_layout="dv", tail="bucket", backend=backend
        )
    )(h, w)
    with jax.set_mesh(mesh):
        w_sharded = jax.device_put(w, NamedSharding(mesh, P(None, "v")))
        got = jax.jit(sharded)(h, w_sharded)
        g = jax.jit(jax.grad(lambda h, w: sharded(h, w)[0], argnums=(0, 1)))(h, w_sharded)
    g_want = jax.jit(
        jax.grad(
            lambda h, w: jk.linear_topk_distill_loss(
                h, w, ids, t_logp, mask, weight_layout="dv", tail="bucket", backend=backend
            )[0],
            argnums=(0, 1),
        )
    )(h, w)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)
    for a, c in zip(g, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)


# -- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "ffi", "chunked", "fast"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_ids(rng, impl, layout):
    """The kernel backends' K-id log-probs on the GPU (bfloat16; the fast mode float32), K = 64,
    300 rows (not a multiple of a tile), V = 12304 (not a multiple of 256)."""
    if impl not in ("fast",) + tuple(jk.available_backends("linear_logprobs")):
        pytest.skip(f"{impl} is not available here")
    dtype = jnp.float32 if impl == "fast" else jnp.bfloat16  # fast: XLA's GEMMs
    h, h64, w, w64, b, b64 = head_inputs(rng, (3, 100), 12304, 256, dtype, layout, True)
    ids = draw_ids(rng, (3, 100), 12304, 64)
    check_ids(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        ids,
        layout=layout,
        temperature=0.9,
        backend=None if impl == "fast" else impl,
        memory="fast" if impl == "fast" else "lean",
    )
