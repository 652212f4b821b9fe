"""Batch-invariant log-probs (docs/api.md "Batch-invariant log-probs"): with
``batch_invariant=True`` a token's log-prob, entropy and gradient (d_hidden of its row, or its
row of d_logits) are bitwise the same whatever batch it sits in.

Seven rows are computed alone (N = 1), then placed at different positions of batches of
N = 8, 64 and 515 among other rows, padding rows (zero hidden states, ``ignore_index``), and at
other positions of N = 515 among other rows and more padding; every one of their outputs must
have the same bits as alone. On every backend a CPU runs (reference, chunked; pallas in
interpret mode with ``JAXRL_TEST_PALLAS=1``), float32 and bfloat16, both weight layouts (the
whole grid with ``JAXRL_TEST_SLOW=1``), and for ``token_logprobs`` on logits; V is not a
multiple of any tile or chunk. The ``gpu`` tests run the same on a GPU for every backend there
(ffi on Hopper); on a CPU, the launch parameters ffi pins, lowered for CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels import dispatch
from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.dispatch import contract, resolver
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels.head import vocab_chunks
from tests.conftest import assert_close, cotangent, rand
from tests.support import oracle

ROWS = 7
IGNORE = -100
D, V = 24, 1237
F32, BF16 = jnp.float32, jnp.bfloat16
# Each layout and dtype runs on every backend; the rest of the grid with JAXRL_TEST_SLOW=1 (and,
# for pallas in interpret mode, JAXRL_TEST_PALLAS_SLOW=1).
slow = pytest.mark.slow
LINEAR_CASES = [
    pytest.param("vd", F32, id="vd-float32"),
    pytest.param("dv", BF16, id="dv-bfloat16", marks=pytest.mark.pallas_slow),
    pytest.param("dv", F32, id="dv-float32", marks=slow),
    pytest.param("vd", BF16, id="vd-bfloat16", marks=slow),
]
TOKEN_DTYPES = [
    pytest.param(F32, id="float32"),
    pytest.param(BF16, id="bfloat16", marks=pytest.mark.pallas_slow),
]
ACCURACY_CASES = [
    pytest.param("dv", BF16, id="dv-bfloat16"),
    pytest.param("vd", F32, id="vd-float32", marks=pytest.mark.pallas_slow),
    pytest.param("dv", F32, id="dv-float32", marks=slow),
    pytest.param("vd", BF16, id="vd-bfloat16", marks=slow),
]


def placements(rng):
    """Where the seven rows go: ``(batch shape, positions, padding positions, seed of the other
    rows)``, for each batch they are placed in (twice at N = 515: other positions, other
    neighbours, more padding)."""
    out = []
    for n, pad, shape, seed in (
        (8, 0, (8,), 1),
        (64, 20, (64,), 2),
        (515, 40, (515,), 3),
        (515, 200, (515,), 4),
    ):
        where = rng.permutation(n)
        out.append((shape, where[:ROWS], where[ROWS : ROWS + pad], seed))
    return out


def bits(x):
    """The raw bytes of every row of ``x`` [N, ...] (any float dtype)."""
    x = np.asarray(x)
    return [x[i].tobytes() for i in range(x.shape[0])]


def assert_rows_invariant(alone, batches):
    """The seven rows' outputs alone (``alone[i]``: row i's, each [1, ...]) against each batch's
    at the rows' positions, bitwise: ``batches`` is a list of (name, outputs [N, ...],
    positions)."""
    for i in range(ROWS):
        want = [bits(x)[0] for x in alone[i]]
        for name, outs, where in batches:
            for k, x in enumerate(outs):
                got = bits(x)[where[i]]
                assert got == want[k], (
                    f"row {i} at position {where[i]} of {name}: output {k} "
                    "differs from the row alone"
                )


# -- linear_logprobs ----------------------------------------------------------------------------


def _linear_fn(backend, weight, layout):
    """jit(hidden, targets, c, e) -> (logp, entropy, d_hidden of Σ c·logp + e·entropy), flat rows
    (any leading shape in, [N] / [N, D] out)."""

    def f(hidden, targets, c, e):
        def loss(h):
            lp, ent = jk.linear_logprobs(
                h,
                weight,
                targets,
                weight_layout=layout,
                ignore_index=IGNORE,
                return_entropy=True,
                backend=backend,
                batch_invariant=True,
            )
            return jnp.sum(c * lp + e * ent), (lp, ent)

        (_, (lp, ent)), dh = jax.value_and_grad(loss, has_aux=True)(hidden)
        return lp.reshape(-1), ent.reshape(-1), dh.reshape(-1, hidden.shape[-1])

    return jax.jit(f)


@pytest.mark.parametrize("layout,dtype", LINEAR_CASES)
def test_linear_logprobs_rows_bitwise_independent_of_the_batch(backend, rng, layout, dtype):
    check_linear_invariance(backend, rng, layout, dtype, D, V)


def check_linear_invariance(backend, rng, layout, dtype, d, v):
    weight, _ = rand(rng, (v, d) if layout == "vd" else (d, v), dtype, scale=2.0 / np.sqrt(d))
    check_rows(rng, _linear_fn(backend, weight, layout), dtype, d, v, scale=1.0)


def check_rows(rng, f, dtype, width, v, scale):
    """``f(x [*shape, width], targets, c, e) -> (logp, entropy, d_x)`` of ROWS drawn rows
    (``scale`` · standard normal, targets in [0, v)) alone against the same rows placed in
    the batches of :func:`placements`: bitwise equal (:func:`assert_rows_invariant`)."""

    def draw(gen, n):
        x = scale * gen.standard_normal((n, width)).astype(np.float32)
        t = gen.integers(0, v, n)
        c, e = gen.standard_normal(n).astype(np.float32), gen.standard_normal(n).astype(np.float32)
        return x, t, c, e

    def call(x, t, c, e, shape=None):
        shape = shape or (x.shape[0],)
        return f(
            jnp.asarray(x, dtype).reshape(shape + (width,)),
            jnp.asarray(t, jnp.int32).reshape(shape),
            jnp.asarray(c).reshape(shape),
            jnp.asarray(e).reshape(shape),
        )

    x, t, c, e = draw(rng, ROWS)
    alone = [call(x[i : i + 1], t[i : i + 1], c[i : i + 1], e[i : i + 1]) for i in range(ROWS)]
    batches = []
    for shape, where, pads, seed in placements(rng):
        n = int(np.prod(shape))
        xb, tb, cb, eb = draw(np.random.default_rng(seed), n)
        xb[pads], tb[pads] = 0.0, IGNORE
        xb[where], tb[where], cb[where], eb[where] = x, t, c, e
        batches.append((f"N={n} {shape}", call(xb, tb, cb, eb, shape), where))
    assert_rows_invariant(alone, batches)


# -- token_logprobs on logits -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TOKEN_DTYPES)
def test_token_logprobs_rows_bitwise_independent_of_the_batch(backend, rng, dtype):
    if backend == "pallas":
        pytest.skip(
            "pallas has no batch-invariant token_logprobs (test_pallas_token_logprobs_is_declined)"
        )
    check_token_invariance(backend, rng, dtype, V)


def test_pallas_token_logprobs_is_declined():
    """On a GPU its one-program-per-row kernel still gave a row's entropy one or two units in the
    last place apart between N = 1 and N = 8 (docs/api.md): pallas serves no batch-invariant
    token_logprobs, and the automatic choice takes another backend."""
    with pytest.raises(NotImplementedError, match="no batch-invariant 'token_logprobs'"):
        jk.token_logprobs(
            jnp.zeros((4, 16)), jnp.zeros(4, int), backend="pallas", batch_invariant=True
        )
    problem = Problem(n_rows=4, vocab=16, batch_invariant=True)
    assert dispatch.select("token_logprobs", problem).backend != "pallas"


def check_token_invariance(backend, rng, dtype, v):
    def f(logits, targets, c, e):
        def loss(x):
            lp, ent = jk.token_logprobs(
                x,
                targets,
                ignore_index=IGNORE,
                return_entropy=True,
                temperature=0.9,
                backend=backend,
                batch_invariant=True,
            )
            return jnp.sum(c * lp + e * ent), (lp, ent)

        (_, (lp, ent)), dx = jax.value_and_grad(loss, has_aux=True)(logits)
        return lp.reshape(-1), ent.reshape(-1), dx.reshape(-1, v)

    check_rows(rng, jax.jit(f), dtype, v, v, scale=3.0)


# -- still the formula ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout,dtype", ACCURACY_CASES)
def test_batch_invariant_values_and_vjp_against_float64(backend, rng, layout, dtype):
    """The batch-invariant schedules (several row blocks, the last pulled back; several
    vocabulary chunks) meet docs/api.md's accuracy, d_weight and d_bias included."""
    n, d, v, temperature = 300, 16, 5000, 0.8
    hidden, h64 = rand(rng, (n, d), dtype)
    weight, w64 = rand(rng, (v, d) if layout == "vd" else (d, v), dtype, scale=2.0 / np.sqrt(d))
    bias, b64 = rand(rng, (v,), dtype, scale=0.5)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)

    def fn(h, w, b):
        return jk.linear_logprobs(
            h,
            w,
            targets,
            b,
            weight_layout=layout,
            temperature=temperature,
            return_entropy=True,
            backend=backend,
            batch_invariant=True,
        )

    (logp, ent), vjp = jax.vjp(fn, hidden, weight, bias)
    t = np.asarray(targets)
    kw = dict(weight_layout=layout, temperature=temperature)
    want = oracle.linear_logprobs(h64, w64, t, b64, **kw)
    want32 = oracle.linear_logprobs(h64, w64, t, b64, dt=np.float32, **kw)
    zscale = np.max(np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout))) / temperature
    assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=zscale, name="entropy")
    g_lp, g_ent = cotangent(rng, (n,)), cotangent(rng, (n,))
    grads = vjp((g_lp, g_ent))
    gw = oracle.linear_logprobs_vjp(h64, w64, t, np.asarray(g_lp), np.asarray(g_ent), b64, **kw)
    gw32 = oracle.linear_logprobs_vjp(
        h64, w64, t, np.asarray(g_lp), np.asarray(g_ent), b64, dt=np.float32, **kw
    )
    for name, got, p, w, w32 in zip(
        ("d_hidden", "d_weight", "d_bias"), grads, (hidden, weight, bias), gw, gw32
    ):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w, in_dtype=dtype, want32=w32, name=name)


# -- what batch_invariant=True chooses, and what it refuses ------------------------------------


@pytest.mark.parametrize("op", ["token_logprobs", "linear_logprobs"])
def test_dispatch_takes_the_backends_invariant_implementation(backend, op):
    if (backend, op) == ("pallas", "token_logprobs"):
        pytest.skip("declined: test_pallas_token_logprobs_is_declined")
    plain = dispatch.select(op, Problem(n_rows=4, vocab=8), backend)
    pinned = dispatch.select(op, Problem(n_rows=4, vocab=8, batch_invariant=True), backend)
    table = resolver._backend(backend)
    assert plain.impl is table.ops[contract.OP_PRIMITIVE[op]]
    assert pinned.impl is table.invariant_ops[contract.OP_PRIMITIVE[op]]
    assert pinned.impl is not plain.impl
    args = (
        (jnp.zeros((4, 8)), jnp.zeros((16, 8)))
        if op == "linear_logprobs"
        else (jnp.zeros((4, 16)),)
    ) + (jnp.zeros(4, int),)
    with jk.use_backend(backend):
        text = jk.explain(op, *args, batch_invariant=True)
    assert f"{op}: {backend} (requested, batch-invariant)" in text, text


def test_a_backend_without_an_invariant_implementation_is_declined(monkeypatch):
    import dataclasses

    chunked = resolver._backend("chunked")
    monkeypatch.setitem(
        resolver._loaded,
        "chunked",
        type("M", (), {"BACKEND": dataclasses.replace(chunked, invariant_ops={})}),
    )
    with pytest.raises(NotImplementedError, match="no batch-invariant 'linear_logprobs'"):
        jk.linear_logprobs(
            jnp.zeros((4, 8)),
            jnp.zeros((16, 8)),
            jnp.zeros(4, int),
            backend="chunked",
            batch_invariant=True,
        )
    # automatic choice passes it over (reference has one)
    problem = Problem(n_rows=2**20, vocab=2**20, batch_invariant=True)
    assert dispatch.select("linear_logprobs", problem).backend != "chunked"


def test_not_with_fast_memory_or_truncation_or_k_ids():
    h, w, t = jnp.zeros((4, 8)), jnp.zeros((16, 8)), jnp.zeros(4, int)
    with pytest.raises(ValueError, match="memory: 'fast' is not batch-invariant"):
        jk.linear_logprobs(h, w, t, memory="fast", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant: top_k"):
        jk.linear_logprobs(h, w, t, top_k=3, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant: top_k"):
        jk.token_logprobs(jnp.zeros((4, 16)), t, top_p=0.9, batch_invariant=True)
    with pytest.raises(ValueError, match="not K ids"):
        jk.linear_logprobs(h, w, jnp.zeros((4, 2), int), batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant: expected a bool"):
        jk.linear_logprobs(h, w, t, batch_invariant=1)
    # a default mode of "fast" (scope, variable, budget) gives "lean", and says why
    with jk.memory_mode("fast"):
        text = jk.explain("linear_logprobs", h, w, t, batch_invariant=True)
    assert "memory: lean (jk.memory_mode('fast'), but batch_invariant=True" in text, text
    text = jk.explain("linear_logprobs", h, w, t, memory=2**30, batch_invariant=True)
    assert "but batch_invariant=True, which 'fast' does not serve" in text, text


# -- ffi: the launch parameters it pins (lowered for CUDA, no GPU needed) ------------------------


def test_ffi_invariant_launch_parameters_do_not_depend_on_n():
    chunks = {
        ffi_linear.backward_chunk(n, 151936, ffi_linear.INVARIANT_CONFIG)
        for n in (1, 7, 100, 4096, 65536)
    }
    assert chunks == {ffi_linear.INVARIANT_CHUNK_COLUMNS}
    assert ffi_linear.backward_chunk(5, 1000, ffi_linear.INVARIANT_CONFIG) == 1024
    assert len({ffi_linear.backward_chunk(n, 151936) for n in (1, 4096, 65536)}) > 1  # default
    assert ffi_linear.INVARIANT_CONFIG.forward_splits() == ffi_linear.INVARIANT_SPLITS
    assert ffi_linear.Config(splits=3, batch_invariant=True).forward_splits() == 3
    assert ffi_linear.DEFAULT_CONFIG.forward_splits() == 0


@pytest.mark.parametrize("n", [1, 300])
def test_ffi_invariant_forward_lowers_with_fixed_splits(n):
    k = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(k[0], (n, 64), jnp.float32).astype(BF16)
    w = jax.random.normal(k[1], (1000, 64), jnp.float32).astype(BF16)
    t, rv = jnp.zeros((n,), jnp.int32), jnp.ones((n,), bool)
    parts = ffi_linear.INVARIANT_OPS["linear_logprobs"]
    text = (
        jax.jit(
            lambda h, w: parts.stats(
                h, w, None, t, rv, weight_layout="vd", temperature=1.0, with_entropy=True
            )
        )
        .trace(h, w)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert f"stablehlo.custom_call @{ffi_linear.TARGET}" in text
    assert f"splits = {ffi_linear.INVARIANT_SPLITS} : i32" in text


@pytest.mark.parametrize("n", [1, 300])
def test_ffi_invariant_backward_lowers_with_a_fixed_chunk(n):
    from jaxrl_kernels.backends.ffi import extension

    if extension.sm90 is None:
        pytest.skip(f"extension not built (its workspace size): {extension.IMPORT_ERROR}")
    k = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(k[0], (n, 64), jnp.float32).astype(BF16)
    w = jax.random.normal(k[1], (9000, 64), jnp.float32).astype(BF16)
    t, rows = jnp.zeros((n,), jnp.int32), jnp.ones((n,), jnp.float32)
    bwd = ffi_linear.INVARIANT_OPS["linear_logprobs_backward"]
    text = (
        jax.jit(lambda *a: bwd(*a, weight_layout="vd", temperature=1.0))
        .trace(h, w, None, t, rows, rows, rows, rows)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count(f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}") == 1
    assert f"chunk = {ffi_linear.INVARIANT_CHUNK_COLUMNS} : i64" in text
    assert "split_k = false" in text  # d_hidden's GEMM splits K by a count that follows N


def test_tiles_do_not_depend_on_n():
    for n in (1, 8, 255, 256, 257, 515, 4096):
        tiles = vocab_chunks.tiling(n, 151936, 4 * 2**20, dim=2048, batch_invariant=True)
        assert tiles.rows.size == vocab_chunks.TILE_ROWS and tiles.rows.n >= n
        assert tiles.chunks == vocab_chunks.tile_chunking(151936, 2048, 4 * 2**20)


# -- GPU: every backend there, and the kernels' pinned launches ---------------------------------

GPU_BACKENDS = ["reference", "chunked", "pallas", "ffi"]


def _gpu_backend(name, dtype=BF16, layout="vd", d=256):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    if name == "ffi":
        from jaxrl_kernels.backends import ffi

        why = ffi.unavailable_reason() or ffi.declines(
            "linear_logprobs",
            Problem(
                n_rows=1,
                vocab=32000,
                hidden_dim=d,
                dtype=jnp.dtype(dtype).name,
                weight_dtype=jnp.dtype(dtype).name,
                weight_layout=layout,
            ),
        )
        if why:
            pytest.skip(f"ffi: {why}")
    return name


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
@pytest.mark.parametrize("layout,dtype", [("vd", BF16), ("dv", jnp.float16), ("vd", F32)])
def test_gpu_linear_logprobs_rows_bitwise_independent_of_the_batch(rng, gpu_backend, layout, dtype):
    """On a GPU: V = 32000 ("dv": a multiple of 8, as ffi needs) walks several 4096-column
    backward chunks, D = 256 several k-tiles; N up to 515 (several 128-row tiles, 256-row
    blocks)."""
    if gpu_backend == "ffi" and dtype == F32:
        pytest.skip("ffi serves 16-bit heads")
    check_linear_invariance(
        _gpu_backend(gpu_backend, dtype, layout),
        rng,
        layout,
        dtype,
        256,
        32000 if layout == "dv" else 32003,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["reference", "chunked"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gpu_token_logprobs_rows_bitwise_independent_of_the_batch(rng, gpu_backend, dtype):
    """The backends with a batch-invariant token_logprobs (pallas has none)."""
    check_token_invariance(_gpu_backend(gpu_backend), rng, dtype, 50257)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["pallas", "ffi"])
def test_gpu_batch_invariant_values_and_vjp_against_float64(rng, gpu_backend):
    """The pinned GPU launches still meet docs/api.md's accuracy (bf16, both layouts)."""
    for layout in ("vd", "dv"):
        test_batch_invariant_values_and_vjp_against_float64(
            _gpu_backend(gpu_backend, BF16, layout, 16), rng, layout, BF16
        )


@pytest.mark.gpu
def test_gpu_ffi_invariant_rows_at_large_n(rng):
    """ffi at N = 1 and inside N = 4100 and 16384 (many row blocks, where the default planner
    and chunk change with N), D = 2048, V = 131072, bf16: the rows' bits agree."""
    _gpu_backend("ffi", BF16, "vd", 2048)
    d, v = 2048, 131072
    weight, _ = rand(rng, (v, d), BF16, scale=2.0 / np.sqrt(d))
    f = _linear_fn("ffi", weight, "vd")
    h = rng.standard_normal((ROWS, d)).astype(np.float32)
    t = rng.integers(0, v, ROWS)
    c = rng.standard_normal(ROWS).astype(np.float32)
    e = rng.standard_normal(ROWS).astype(np.float32)
    run = lambda h, t, c, e: f(
        jnp.asarray(h, BF16), jnp.asarray(t, jnp.int32), jnp.asarray(c), jnp.asarray(e)
    )
    alone = [run(h[i : i + 1], t[i : i + 1], c[i : i + 1], e[i : i + 1]) for i in range(ROWS)]
    batches = []
    for n in (4100, 16384):
        other = np.random.default_rng(n)
        where = other.permutation(n)[:ROWS]
        hb = other.standard_normal((n, d)).astype(np.float32)
        tb = other.integers(0, v, n)
        cb, eb = (
            other.standard_normal(n).astype(np.float32),
            other.standard_normal(n).astype(np.float32),
        )
        hb[where], tb[where], cb[where], eb[where] = h, t, c, e
        batches.append((f"N={n}", run(hb, tb, cb, eb), where))
    assert_rows_invariant(alone, batches)
