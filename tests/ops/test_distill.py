"""linear_distill_loss and linear_topk_logprobs against an independent float64 NumPy oracle.

The oracle below is written from docs/api.md's formulas (it never imports jaxrl_kernels):
divergences of the full-vocabulary softmaxes, their analytic gradients (checked once against
central differences), the top-k by a stable sort. Every divergence × temperature × layout mix ×
bias × odd V × N = 1 × fully masked rows × dtype × aggregation mode, with random cotangents on
both outputs, on every CPU backend; the teacher's gradients exactly zero; jit, vmap, sharded
inputs, ``vocab_axis`` inside ``shard_map``; bitwise reruns; bad input.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels.engine import fused_distill
from jaxrl_kernels.head import vocab_chunks
from tests.conftest import assert_close, assert_zero, cotangent, pallas_slow, random_mask
from tests.support import oracle

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")


SERVED = jk.available_backends("linear_distill_loss")
SERVED_TOPK = jk.available_backends("linear_topk_logprobs")


@pytest.fixture(autouse=True)
def served_backend(request):
    """Each op on the backends that implement it (conftest adds pallas with
    JAXRL_TEST_PALLAS=1: it serves the divergence, not the top-k)."""
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend") if callspec else None
    served = SERVED_TOPK if "topk" in request.node.name else SERVED
    if backend is not None and backend not in served:
        pytest.skip(f"backend {backend!r} does not implement this op")


def pallas_auto_axes_off_gpu(backend, kind):
    """Off a GPU pallas's kernels run emulated (Mosaic GPU interpret mode) in a host callback;
    under Auto mesh axes, where ``custom_partitioning`` lowers it into a program over 8 CPU
    devices, XLA's CPU runtime crashes running it (segmentation fault, jax 0.12), so that
    case runs on GPUs only (``test_distill_pallas_sharded_on_gpu``). Explicit axes and
    ``shard_map`` run here."""
    if backend == "pallas" and kind == "Auto" and jax.default_backend() != "gpu":
        pytest.skip(
            "pallas distillation kernels under Auto axes on CPU devices: see "
            "pallas_auto_axes_off_gpu"
        )


def head_dtype(backend):
    """The dtype a test's heads take on ``backend``: pallas's kernels take 16-bit heads
    (docs/api.md), so its cases run in bfloat16; float32 elsewhere."""
    return jnp.bfloat16 if backend == "pallas" else jnp.float32


MEMORY = ("lean", "fast")


def route(backend, memory, dtype=None):
    """The keyword arguments that run ``linear_distill_loss`` on ``backend`` (lean) or in
    ``memory="fast"``, which runs one function whatever the backend: it is tested once, under
    the first backend's name. A float32 ``dtype`` is skipped on pallas (16-bit heads only)."""
    if (
        dtype is not None
        and backend == "pallas"
        and memory == "lean"
        and (jnp.dtype(dtype) == jnp.float32)
    ):
        pytest.skip("pallas distill_divergence takes 16-bit heads")
    if memory == "lean":
        return dict(backend=backend)
    if backend != SERVED[0]:
        pytest.skip(f"memory='fast' runs the same function as under backend {SERVED[0]!r}")
    return dict(memory="fast")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(vocab_chunks, "DISTILL_CHUNK_BYTES", 4 * 1024)  # 128-column chunks
    # memory="fast": blocks of a few rows, the last overlapping its predecessor
    monkeypatch.setattr(fused_distill, "BLOCK_BYTES", 10000)


# -- the oracle -------------------------------------------------------------------------------


def _round(x, dtype):
    return np.asarray(
        jnp.asarray(np.asarray(x, np.float32)).astype(dtype).astype(jnp.float32), np.float64
    )


def _log_softmax(z):
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def distill_oracle(
    h,
    w,
    th,
    tw,
    mask,
    *,
    divergence,
    beta=0.5,
    temperature=1.0,
    layout="vd",
    t_layout="vd",
    b=None,
    tb=None,
    mode="token_mean",
    max_len=None,
    g_tok=None,
    g_loss=0.0,
    dt=np.float64,
    fast=None,
):
    """``(loss, per_token, d_hidden, d_weight, d_bias | None, scale)`` in ``dt``; the gradients
    are those of ``g_loss·loss + Σ g_tok·per_token``; ``scale`` = max|z_s| + max|z_t|.
    ``fast`` (a 16-bit dtype): ``memory="fast"``'s formula, with its roundings to that dtype
    (docs/api.md): ``∂d/∂z_s`` kept for the backward, and ``g ⊙ h`` entering ``d_weight``'s
    GEMM (the logits and ``d`` are exact)."""
    rnd = (lambda x: x) if fast is None else (lambda x: _round(x, fast))
    zs = (
        oracle.linear_logits(h, w, None, weight_layout=layout, dt=dt)
        + (0.0 if b is None else np.asarray(b, dt))
    ) / dt(temperature)
    zt = (
        oracle.linear_logits(th, tw, None, weight_layout=t_layout, dt=dt)
        + (0.0 if tb is None else np.asarray(tb, dt))
    ) / dt(temperature)
    ls, lt = _log_softmax(zs), _log_softmax(zt)
    ps, pt = np.exp(ls), np.exp(lt)
    if divergence == "reverse_kl":
        d = (ps * (ls - lt)).sum(-1)
        dd = ps * ((ls - lt) - d[..., None])
    elif divergence == "forward_kl":
        d = (pt * (lt - ls)).sum(-1)
        dd = ps - pt
    else:
        lm = np.logaddexp(np.log(beta) + lt, np.log1p(-beta) + ls)  # log(β p_t + (1−β) p_s)
        kl_t, kl_s = (pt * (lt - lm)).sum(-1), (ps * (ls - lm)).sum(-1)
        d = beta * kl_t + (1 - beta) * kl_s
        dd = (1 - beta) * ps * ((ls - lm) - kl_s[..., None])
    valid = np.asarray(mask) != 0
    per_token = np.where(valid, d, 0.0).astype(dt)
    weights = oracle.aggregate_weights(mask, mode, max_len, dt=dt)
    loss = np.sum(weights * per_token, dtype=dt)
    g_tok = np.zeros(d.shape) if g_tok is None else np.asarray(g_tok, np.float64)
    coef = np.where(valid, g_tok + g_loss * weights, 0.0).astype(dt)
    hf = np.asarray(h, dt).reshape(-1, h.shape[-1])
    wf = np.asarray(w, dt) if layout == "vd" else np.asarray(w, dt).T
    if fast is None:
        dz = (coef[..., None] * dd / dt(temperature)).reshape(-1, dd.shape[-1])
        dh, dw, db = dz @ wf, dz.T @ hf, dz.sum(0)
    else:  # g scales the [N, D] sides of the GEMMs
        c = coef.reshape(-1, 1)
        j = rnd(dd / dt(temperature)).reshape(-1, dd.shape[-1])
        dh, dw, db = c * (j @ wf), j.T @ rnd(c * hf), (c * j).sum(0)
    dw = dw if layout == "vd" else dw.T
    db = None if b is None else db
    scale = np.abs(zs).max() + np.abs(zt).max()
    return loss, per_token, dh.reshape(h.shape), dw, db, scale


def grad_scale(exact, s):
    """docs/api.md's scale for a divergence's gradient: its own, times max(1, S): the log-probs
    inside ∂d/∂z_s carry the logits' rounding, which grows with S."""
    return np.max(np.abs(exact)) * max(1.0, s)


def topk_oracle(
    h, w, k, *, b=None, layout="vd", temperature=1.0, g_logp=None, g_lse=None, dt=np.float64
):
    """``(logp, ids, lse, d_hidden, d_weight, d_bias | None)``; ids by a stable sort of −z."""
    z = oracle.linear_logits(h, w, b, weight_layout=layout, dt=dt) / dt(temperature)
    z2 = z.reshape(-1, z.shape[-1])
    ids = np.argsort(-z2, axis=-1, kind="stable")[:, :k]
    m = z2.max(-1)
    lse = m + np.log(np.exp(z2 - m[:, None]).sum(-1))
    logp = np.take_along_axis(z2, ids, -1) - lse[:, None]
    out = [
        logp.reshape(z.shape[:-1] + (k,)),
        ids.reshape(z.shape[:-1] + (k,)),
        lse.reshape(z.shape[:-1]),
    ]
    if g_logp is None:
        return tuple(out) + (None, None, None)
    g = np.asarray(g_logp, np.float64).reshape(-1, k)
    gl = np.asarray(g_lse, np.float64).reshape(-1)
    p = np.exp(z2 - lse[:, None])
    dz = (gl - g.sum(-1))[:, None] * p
    np.add.at(dz, (np.arange(len(ids))[:, None], ids), g)
    dz = dz / temperature
    hf = np.asarray(h, dt).reshape(-1, h.shape[-1])
    wf = np.asarray(w, dt)
    dh, dw = (dz @ wf, dz.T @ hf) if layout == "vd" else (dz @ wf.T, hf.T @ dz)
    return tuple(out) + (dh.reshape(h.shape), dw, None if b is None else dz.sum(0))


def test_oracle_gradient_is_the_derivative():
    """The oracle's analytic student gradient equals central differences of its own d."""
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((1, 2, 3)), rng.standard_normal((9, 3))
    th, tw = rng.standard_normal((1, 2, 4)), rng.standard_normal((9, 4))
    mask, g = np.ones((1, 2)), rng.standard_normal((1, 2))
    for div in DIVERGENCES:
        kw = dict(divergence=div, beta=0.3, temperature=0.8)
        _, _, dh, dw, _, _ = distill_oracle(h, w, th, tw, mask, g_tok=g, **kw)
        f = lambda h, w: np.sum(g * distill_oracle(h, w, th, tw, mask, **kw)[1])
        eps = 1e-6
        for x, grad in ((h, dh), (w, dw)):
            num = np.zeros_like(x)
            for i in np.ndindex(x.shape):
                e = np.zeros_like(x)
                e[i] = eps
                args = (h + e, w) if x is h else (h, w + e)
                args2 = (h - e, w) if x is h else (h, w - e)
                num[i] = (f(*args) - f(*args2)) / (2 * eps)
            np.testing.assert_allclose(grad, num, atol=1e-7, rtol=1e-6)


# -- inputs -----------------------------------------------------------------------------------


def _head(rng, b, t, d, v, layout, dtype, with_bias):
    h = rng.standard_normal((b, t, d)).astype(np.float32)
    w = (rng.standard_normal((v, d) if layout == "vd" else (d, v)) * 2.0 / np.sqrt(d)).astype(
        np.float32
    )
    bias = (0.5 * rng.standard_normal(v)).astype(np.float32) if with_bias else None
    to = lambda x: None if x is None else jnp.asarray(x).astype(dtype)
    back = lambda x: None if x is None else np.asarray(to(x)).astype(np.float64)
    return (to(h), to(w), to(bias)), (back(h), back(w), back(bias))


# (dtype, temperature, layout, teacher layout, bias, teacher bias, B, T, V, mode, max_len)
CASES = [
    ("float32", 1.0, "vd", "vd", False, False, 2, 3, 301, "token_mean", None),
    ("float32", 0.7, "dv", "vd", True, True, 3, 2, 301, "seq_mean_token_mean", None),
    ("float32", 1.3, "vd", "dv", False, True, 2, 3, 257, "seq_mean_token_sum", None),
    ("float32", 1.0, "dv", "dv", True, False, 2, 3, 129, "seq_mean_token_sum_norm", 5),
    ("float32", 0.9, "vd", "vd", False, False, 1, 1, 7, "sequence_mean", None),  # N = 1
    ("bfloat16", 0.8, "vd", "dv", True, True, 3, 2, 301, "token_mean", None),
    ("bfloat16", 1.0, "dv", "vd", False, False, 2, 3, 259, "seq_mean_token_sum", None),
    ("bfloat16", 1.1, "dv", "dv", False, True, 1, 1, 7, "seq_mean_token_sum_norm", 3),  # N = 1
]


# pallas (interpret mode, bfloat16 cases only) runs each bfloat16 case with one divergence and
# each divergence once; every case × divergence with JAXRL_TEST_PALLAS_SLOW=1
PALLAS_ORACLE = {(5, "reverse_kl"), (6, "jsd"), (7, "forward_kl")}


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize(
    "case,divergence",
    [
        pytest.param(
            c,
            d,
            id=f"{c[0]}-T{c[1]}-{c[2]}{c[3]}-V{c[8]}-{c[9]}-{d}",
            marks=() if (i, d) in PALLAS_ORACLE else pytest.mark.pallas_slow,
        )
        for i, c in enumerate(CASES)
        for d in DIVERGENCES
    ],
)
def test_distill_matches_oracle(rng, backend, divergence, case, memory):
    dtype, temp, lay, tlay, bias, tbias, b, t, v, mode, max_len = case
    dtype = jnp.dtype(dtype)
    (h, w, bs), (h64, w64, bs64) = _head(rng, b, t, 8, v, lay, dtype, bias)
    (th, tw, tbs), (th64, tw64, tbs64) = _head(rng, b, t, 12, v, tlay, dtype, tbias)
    mask = random_mask(rng, b, t, empty_rows=(1,) if b > 1 else ())
    beta = 0.3 if divergence == "jsd" else 0.5
    g_tok, g_loss = cotangent(rng, (b, t)), float(rng.standard_normal())
    kw = dict(
        divergence=divergence,
        jsd_beta=beta,
        temperature=temp,
        weight_layout=lay,
        teacher_weight_layout=tlay,
        loss_agg_mode=mode,
        max_len=max_len,
    )

    def f(h, w, bs, th, tw, tbs):
        return jk.linear_distill_loss(
            h,
            w,
            th,
            tw,
            jnp.asarray(mask),
            bias=bs,
            teacher_bias=tbs,
            **route(backend, memory, dtype),
            **kw,
        )

    (loss, per_token), vjp = jax.vjp(jax.jit(f), h, w, bs, th, tw, tbs)
    grads = vjp((jnp.float32(g_loss), g_tok))
    okw = dict(
        divergence=divergence,
        beta=beta,
        temperature=temp,
        layout=lay,
        t_layout=tlay,
        mode=mode,
        max_len=max_len,
        g_tok=np.asarray(g_tok),
        g_loss=g_loss,
    )
    want = distill_oracle(h64, w64, th64, tw64, mask, b=bs64, tb=tbs64, **okw)
    want32 = distill_oracle(h64, w64, th64, tw64, mask, b=bs64, tb=tbs64, dt=np.float32, **okw)
    if memory == "fast" and dtype != jnp.float32:  # values by the lean rule, gradients by its own
        fast = distill_oracle(h64, w64, th64, tw64, mask, b=bs64, tb=tbs64, fast=dtype, **okw)
        want32 = want32[:2] + fast[2:]
    scale = want[-1]
    assert loss.dtype == per_token.dtype == jnp.float32 and per_token.shape == (b, t)
    close = lambda got, i, name, s=None: assert_close(
        got, want[i], in_dtype=dtype, want32=want32[i], scale=s, name=name
    )
    close(per_token, 1, "per_token", scale)
    close(loss, 0, "loss", scale)
    assert np.all(np.asarray(per_token)[mask == 0] == 0)
    for i, name in [(2, "d_hidden"), (3, "d_weight")] + ([(4, "d_bias")] if bias else []):
        close(grads[i - 2], i, name, grad_scale(want[i], scale))
    assert grads[0].dtype == dtype and grads[1].dtype == dtype
    for g, name in zip(grads[3:], ("teacher_hidden", "teacher_weight", "teacher_bias")):
        assert_zero(g, f"d_{name}")


@pytest.mark.parametrize("memory", MEMORY)
def test_distill_jit_vmap_and_reruns(rng, backend, memory):
    """vmap over a leading batch axis equals the loop; two runs are bitwise equal."""
    dtype = head_dtype(backend)
    (h, w, _), _ = _head(rng, 2, 3, 8, 301, "vd", dtype, False)
    (th, tw, _), _ = _head(rng, 2, 3, 12, 301, "vd", dtype, False)
    hs, ths = jnp.stack([h, 2 * h]), jnp.stack([th, -th])
    mask = jnp.asarray(random_mask(rng, 2, 3))

    def loss(h, th, w):
        return jk.linear_distill_loss(
            h, w, th, tw, mask, divergence="jsd", **route(backend, memory)
        )[0]

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 2)), in_axes=(0, 0, None)))
    value, (dh, dw) = batched(hs, ths, w)
    for i in range(2):
        v0, (dh0, dw0) = jax.value_and_grad(loss, argnums=(0, 2))(hs[i], ths[i], w)
        assert_close(value[i], np.asarray(v0))
        assert_close(dh[i], np.asarray(dh0))
        assert_close(dw[i], np.asarray(dw0))
    again = batched(hs, ths, w)
    for x, y in zip(jax.tree.leaves((value, dh, dw)), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_large_logits(rng, backend, divergence, memory):
    """|z| ~ 1e3 (float32): values within 1e-5 of S = max|z_s| + max|z_t| (the statistics are
    taken relative to each head's row max; nothing overflows), gradients finite. (The float32
    logits themselves are off by ~1e-4 here, so the gradients of such near one-hot
    distributions are not held to the 1e-5 rule.)"""
    dtype = head_dtype(backend)  # ×256 is exact in bfloat16 too
    (h, w, _), (h64, w64, _) = _head(rng, 2, 3, 8, 301, "vd", dtype, False)
    (th, tw, _), (th64, tw64, _) = _head(rng, 2, 3, 12, 301, "dv", dtype, False)
    h, h64, th, th64 = 256 * h, 256 * h64, 256 * th, 256 * th64
    mask = np.ones((2, 3), np.float32)
    g = cotangent(rng, (2, 3))
    f = lambda h, w: jk.linear_distill_loss(
        h,
        w,
        th,
        tw,
        jnp.asarray(mask),
        divergence=divergence,
        temperature=3.0,
        teacher_weight_layout="dv",
        **route(backend, memory),
    )[1]
    per_token, vjp = jax.vjp(f, h, w)
    dh, dw = vjp(g)
    want = distill_oracle(
        h64,
        w64,
        th64,
        tw64,
        mask,
        divergence=divergence,
        temperature=3.0,
        t_layout="dv",
        g_tok=np.asarray(g),
    )
    assert np.abs(want[-1]) > 500
    assert_close(per_token, want[1], scale=want[-1], name="per_token")
    assert np.all(np.isfinite(np.asarray(dh))) and np.all(np.isfinite(np.asarray(dw)))


@pytest.mark.parametrize("memory", MEMORY)
def test_distill_equal_heads_give_zero(backend, memory):
    """The same head twice: every divergence is 0 (to rounding), and so is its gradient."""
    rng = np.random.default_rng(1)
    (h, w, _), _ = _head(rng, 2, 2, 8, 130, "vd", head_dtype(backend), False)
    mask = jnp.ones((2, 2))
    for div in DIVERGENCES:
        loss, per_token = jk.linear_distill_loss(
            h, w, h, w, mask, divergence=div, **route(backend, memory)
        )
        assert np.max(np.abs(np.asarray(per_token))) < 1e-5, div


# -- top-k ------------------------------------------------------------------------------------

TOPK_CASES = [  # (dtype, layout, bias, temperature, lead shape, V, k)
    ("float32", "vd", False, 1.0, (2, 3), 301, 5),
    ("float32", "dv", True, 0.7, (5,), 257, 1),
    ("float32", "vd", True, 1.2, (), 129, 129),  # 1-D hidden, k = V
    ("float32", "dv", False, 1.0, (1,), 7, 3),  # N = 1
    ("bfloat16", "vd", True, 0.9, (2, 2), 301, 8),
]


@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-V{c[5]}-k{c[6]}")
def test_topk_matches_oracle(rng, backend, case):
    dtype, lay, with_bias, temp, lead, v, k = case
    dtype = jnp.dtype(dtype)
    d = 8
    hd = rng.standard_normal(lead + (d,)).astype(np.float32)
    wd = (rng.standard_normal((v, d) if lay == "vd" else (d, v)) * 2 / np.sqrt(d)).astype(
        np.float32
    )
    bd = (0.5 * rng.standard_normal(v)).astype(np.float32) if with_bias else None
    h, w = jnp.asarray(hd).astype(dtype), jnp.asarray(wd).astype(dtype)
    b = None if bd is None else jnp.asarray(bd).astype(dtype)
    h64, w64 = (np.asarray(x).astype(np.float64) for x in (h, w))
    b64 = None if b is None else np.asarray(b).astype(np.float64)
    g_logp, g_lse = cotangent(rng, lead + (k,)), cotangent(rng, lead)

    def f(h, w, b):
        return jk.linear_topk_logprobs(
            h, w, k, bias=b, weight_layout=lay, temperature=temp, backend=backend
        )

    (logp, ids, lse), vjp = jax.vjp(jax.jit(f), h, w, b)
    zero_ids = np.zeros(ids.shape, jax.dtypes.float0)
    grads = vjp((g_logp, zero_ids, g_lse))
    okw = dict(
        b=b64, layout=lay, temperature=temp, g_logp=np.asarray(g_logp), g_lse=np.asarray(g_lse)
    )
    want = topk_oracle(h64, w64, k, **okw)
    want32 = topk_oracle(h64, w64, k, dt=np.float32, **okw)
    assert ids.dtype == jnp.int32 and ids.shape == lead + (k,) and lse.shape == lead
    np.testing.assert_array_equal(np.asarray(ids), want[1])
    zmax = np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=lay)).max() / temp
    for got, i, name in ((logp, 0, "logp"), (lse, 2, "lse")):
        assert_close(got, want[i], in_dtype=dtype, want32=want32[i], scale=zmax, name=name)
    assert np.all(np.diff(np.asarray(logp), axis=-1) <= 0)
    for got, i, name in (
        (grads[0], 3, "d_hidden"),
        (grads[1], 4, "d_weight"),
        (grads[2], 5, "d_bias"),
    ):
        if want[i] is not None:
            assert_close(got, want[i], in_dtype=dtype, want32=want32[i], name=name)


def test_topk_ties_go_to_the_lower_id(backend):
    """Exactly equal logits (duplicate weight rows, exact products): the lower id first, also
    where the tie spans two vocabulary chunks."""
    v, d = 300, 4
    w = np.zeros((v, d), np.float32)
    w[:, 0] = np.arange(v) % 7  # values 0..6, each many times, across every chunk
    h = np.ones((3, d), np.float32)
    _, ids, _ = jk.linear_topk_logprobs(jnp.asarray(h), jnp.asarray(w), 50, backend=backend)
    z = w[:, 0]
    want = np.argsort(-z, kind="stable")[:50]
    np.testing.assert_array_equal(np.asarray(ids), np.broadcast_to(want, (3, 50)))


def test_topk_vmap(rng, backend):
    hs = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((301, 8)), jnp.float32)
    f = lambda h: jk.linear_topk_logprobs(h, w, 4, backend=backend)
    got = jax.jit(jax.vmap(f))(hs)
    for i in range(3):
        want = f(hs[i])
        np.testing.assert_array_equal(np.asarray(got[1][i]), np.asarray(want[1]))
        assert_close(got[0][i], np.asarray(want[0]), scale=20.0)


def test_topk_logp_agrees_with_linear_logprobs(rng, backend):
    h = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((301, 8)), jnp.float32)
    logp, ids, _ = jk.linear_topk_logprobs(h, w, 3, backend=backend, temperature=0.5)
    for j in range(3):
        lp = jk.linear_logprobs(h, w, ids[:, j], temperature=0.5, backend=backend)
        assert_close(logp[:, j], np.asarray(lp), scale=20.0)


# -- many devices -------------------------------------------------------------------------------

V_SHARD = 1024


def _mesh(kind="Explicit"):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest forces 8 host devices on CPU)")
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)


def _agree(got, want, name="value"):
    """A sharded result against the same backend's unsharded one: docs/api.md's float32 rule,
    or, for 16-bit outputs, within one rounding to their dtype (a sum in another order may
    round the other way)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype.itemsize == 2:
        s = max(float(np.max(np.abs(want.astype(np.float64)), initial=0.0)), 1e-30)
        err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0)
        assert err <= 2.0**-7 * s, f"{name}: {err} > 2^-7 x {s}"
    else:
        assert_close(got, want, name=name)


def _sharded_inputs(rng, dtype=jnp.float32):
    (h, w, b), _ = _head(rng, 4, 4, 8, V_SHARD, "vd", dtype, True)
    (th, tw, _), _ = _head(rng, 4, 4, 12, V_SHARD, "dv", dtype, False)
    mask = jnp.asarray(random_mask(rng, 4, 4))
    return h, w, b, th, tw, mask


def _distill_fn(backend, divergence, vocab_axis=None, memory="lean"):
    def fn(h, w, b, th, tw, mask):
        return jk.linear_distill_loss(
            h,
            w,
            th,
            tw,
            mask,
            bias=b,
            divergence=divergence,
            temperature=0.8,
            teacher_weight_layout="dv",
            loss_agg_mode="seq_mean_token_sum",
            **route(backend, memory),
            vocab_axis=vocab_axis,
        )

    return fn


def _gathered(compiled) -> list[int]:
    """Element counts of the results of every all-gather in a compiled program."""
    return [
        int(np.prod([int(d) for d in t.split(",") if d]))
        for line in compiled.as_text().splitlines()
        if " all-gather" in line
        for t in re.findall(r"\w+\[([\d,]*)\]", line.split(" all-gather")[0])
    ]


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("kind", ["Explicit", "Auto"])
# pallas: reverse_kl only (the same sharded kernels; jsd on pallas runs in the oracle test)
@pytest.mark.parametrize("divergence", ["reverse_kl", pallas_slow("jsd")])
def test_distill_sharded(rng, backend, kind, divergence, memory):
    """Rows over ``data``, both heads' vocabulary over ``model``: the unsharded result, and
    d_weight sharded like the weight."""
    pallas_auto_axes_off_gpu(backend, kind)
    mesh = _mesh(kind)
    args = _sharded_inputs(rng, head_dtype(backend))
    specs = [
        P("data", None, None),
        P("model", None),
        P("model"),
        P("data", None, None),
        P(None, "model"),
        P("data", None),
    ]
    fn = _distill_fn(backend, divergence, memory=memory)
    g = cotangent(rng, (4, 4))

    def both(*a):
        def scalar(*a):
            loss, per_token = fn(*a)
            return 0.7 * loss + jnp.sum(per_token * g)

        return fn(*a), jax.grad(scalar, argnums=(0, 1, 2))(*a)

    want = jax.jit(both)(*args)
    placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(both).lower(*placed).compile()
        got = compiled(*placed)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _agree(x, y)
    # no all-gather rebuilds a head, the hidden states, or a device's share of them
    limit = min(x.size for x in args[:5]) // 8
    gathered = _gathered(compiled)
    assert not [n for n in gathered if n >= limit], gathered
    if kind == "Explicit":
        assert tuple(got[1][1].sharding.spec)[:1] == ("model",)


@pytest.mark.parametrize("kind", ["Explicit", "Auto"])
def test_topk_sharded(rng, backend, kind):
    """Rows over ``data``, the vocabulary over ``model``: ids, log-probs, lse and gradients as
    unsharded, and no all-gather of the logits (nor of the head or the hidden states): under
    Auto axes XLA's partitioner once ran ``lax.top_k`` of the reference backend on all the
    logits on every device."""
    mesh = _mesh(kind)
    h = jnp.asarray(rng.standard_normal((4, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((V_SHARD, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(V_SHARD), jnp.float32)
    g = cotangent(rng, (4, 3, 6))

    def both(h, w, b):
        f = lambda h, w, b: jk.linear_topk_logprobs(h, w, 6, bias=b, backend=backend)
        scalar = lambda *a: jnp.sum(f(*a)[0] * g) + jnp.sum(f(*a)[2])
        return f(h, w, b), jax.grad(scalar, argnums=(0, 1, 2))(h, w, b)

    want = jax.jit(both)(h, w, b)
    placed = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip((h, w, b), (P("data", None, None), P("model", None), P("model")))
    ]
    with jax.set_mesh(mesh):
        compiled = jax.jit(both).lower(*placed).compile()
        got = compiled(*placed)
    np.testing.assert_array_equal(np.asarray(got[0][1]), np.asarray(want[0][1]))
    assert not [n for n in _gathered(compiled) if n >= min(h.size, w.size) // 8]
    for x, y in zip(
        jax.tree.leaves((got[0][0], got[0][2], got[1])),
        jax.tree.leaves((want[0][0], want[0][2], want[1])),
    ):
        assert_close(x, np.asarray(y), scale=10.0)


def _in_shard_map(fn, in_specs, out_specs, shape=None):
    mesh = (
        _mesh()
        if shape is None
        else jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    )
    inner = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def mapped(*args):
        return inner(*(jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs)))

    return mesh, jax.jit(mapped)


# pallas lean (its kernels in interpret mode under shard_map, ~65 s) is pallas_slow; pallas fast
# and the lean kernels off the vocabulary axis (test_distill_matches_oracle) run in CI
@pytest.mark.parametrize("memory", [pallas_slow(m) if m == "lean" else m for m in MEMORY])
def test_distill_vocab_axis(rng, backend, memory):
    """Inside shard_map, heads split over ``model``: per-row statistics of both heads combine
    across the slices; values and gradients (taken through the shard_map) as unsharded."""
    args = _sharded_inputs(rng, head_dtype(backend))
    rows3, rows = P("data", None, None), P("data", None)
    in_specs = (rows3, P("model", None), P("model"), rows3, P(None, "model"), rows)
    for divergence in DIVERGENCES:
        inner = _distill_fn(backend, divergence, vocab_axis="model", memory=memory)
        mesh, call = _in_shard_map(lambda *a: inner(*a)[1], in_specs, rows)
        unsharded = lambda *a: _distill_fn(backend, divergence, memory=memory)(*a)[1]
        g = cotangent(rng, (4, 4))
        grad = lambda f: jax.jit(
            jax.grad(lambda h, w, b, *rest: jnp.sum(f(h, w, b, *rest) * g), argnums=(0, 1, 2))
        )
        _agree(call(*args), jax.jit(unsharded)(*args), name=divergence)
        for x, y in zip(grad(call)(*args), grad(unsharded)(*args)):
            _agree(x, y, name=f"{divergence} grad")


def test_topk_vocab_axis(rng, backend):
    """Each slice's top-k merges into the global one (ids global), lse and gradients as
    unsharded."""
    h = jnp.asarray(rng.standard_normal((4, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, V_SHARD)), jnp.float32)
    k = 300  # more than a slice's 256 columns
    in_specs = (P("data", None, None), P(None, "model"))
    outs = (P("data", None, None), P("data", None, None), P("data", None))

    def f(h, w, vocab_axis=None):
        return jk.linear_topk_logprobs(
            h, w, k, weight_layout="dv", backend=backend, vocab_axis=vocab_axis
        )

    _, call = _in_shard_map(lambda h, w: f(h, w, "model"), in_specs, outs)
    got, want = call(h, w), jax.jit(f)(h, w)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert_close(got[0], np.asarray(want[0]), scale=20.0)
    assert_close(got[2], np.asarray(want[2]))
    g = cotangent(rng, (4, 3, k))
    scalar = lambda fn: jax.jit(
        jax.grad(lambda h, w: jnp.sum(fn(h, w)[0] * g) + jnp.sum(fn(h, w)[2]), argnums=(0, 1))
    )
    for x, y in zip(scalar(call)(h, w), scalar(f)(h, w)):
        assert_close(x, np.asarray(y))


# -- explain and bad input -------------------------------------------------------------------


def test_explain_names_the_backends():
    h, w = jnp.zeros((2, 3, 8)), jnp.zeros((64, 8))
    th, tw = jnp.zeros((2, 3, 16)), jnp.zeros((64, 16))
    text = jk.explain("linear_distill_loss", h, w, th, tw, jnp.ones((2, 3)))
    assert text.splitlines()[0] == "linear_distill_loss: reference (automatic)", text
    assert "pallas declined: pallas distill_divergence takes 16-bit heads" in text, text
    text = jk.explain(
        "linear_distill_loss",
        h.astype(jnp.bfloat16),
        w.astype(jnp.bfloat16),
        th.astype(jnp.bfloat16),
        tw.astype(jnp.bfloat16),
        jnp.ones((2, 3)),
    )
    assert "pallas declined: platform is 'cpu'; pallas runs only in interpret mode" in text, text
    many = jnp.zeros((2, 512, 8), jnp.bfloat16), jnp.zeros((2, 512, 16), jnp.bfloat16)
    heads = w.astype(jnp.bfloat16), tw.astype(jnp.bfloat16)
    text = jk.explain(
        "linear_distill_loss",
        many[0],
        heads[0],
        many[1],
        heads[1],
        jnp.ones((2, 512)),
        memory="fast",
    )
    assert "memory fast" in text and "7/8" not in text, text  # every row runs: no branches
    text = jk.explain("linear_topk_logprobs", h, w, k=4)
    assert "pallas declined: backend 'pallas' does not implement 'topk_logprobs'" in text, text
    with jk.use_backend("chunked"):
        text = jk.explain("linear_topk_logprobs", h, w, k=4)
    assert text.splitlines()[1] == "linear_topk_logprobs: chunked (requested)", text


def _distill_args(**over):
    a = dict(
        hidden=jnp.ones((2, 3, 4)),
        weight=jnp.ones((5, 4)),
        teacher_hidden=jnp.ones((2, 3, 6)),
        teacher_weight=jnp.ones((5, 6)),
        mask=jnp.ones((2, 3)),
    )
    kw = {k: v for k, v in over.items() if k not in a}
    a.update({k: v for k, v in over.items() if k in a})
    return a, kw


DISTILL_ERRORS = [
    (ValueError, "teacher_weight", dict(teacher_weight=jnp.ones((6, 6)))),
    (ValueError, "teacher_weight", dict(teacher_weight=jnp.ones((5, 7)))),
    (ValueError, "teacher_hidden", dict(teacher_hidden=jnp.ones((2, 4, 6)))),
    (ValueError, "teacher_hidden", dict(teacher_hidden=jnp.ones((6, 6)))),
    (ValueError, "jsd_beta", dict(divergence="jsd", jsd_beta=1.0)),
    (ValueError, "jsd_beta", dict(divergence="jsd", jsd_beta=0.0)),
    (ValueError, "divergence", dict(divergence="kl")),
    (ValueError, "teacher_weight_layout", dict(teacher_weight_layout="vv")),
    (ValueError, "teacher_bias", dict(teacher_bias=jnp.ones(4))),
    (ValueError, "mask", dict(mask=jnp.ones((2, 4)))),
    (ValueError, "temperature", dict(temperature=0.0)),
    (ValueError, "loss_agg_mode", dict(loss_agg_mode="mean")),
    (ValueError, "hidden", dict(hidden=jnp.ones((6, 4)))),
    (TypeError, "teacher_hidden", dict(teacher_hidden=jnp.ones((2, 3, 6), jnp.int32))),
]


@pytest.mark.parametrize(
    "err,name,over", DISTILL_ERRORS, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(DISTILL_ERRORS)]
)
def test_distill_errors(err, name, over):
    a, kw = _distill_args(**over)
    with pytest.raises(err) as info:
        jk.linear_distill_loss(*a.values(), **kw)
    msg = str(info.value)
    assert msg.startswith(f"{name}:") and "\n" not in msg, msg


def test_jsd_beta_checked_only_for_jsd():
    a, _ = _distill_args()
    jk.linear_distill_loss(*a.values(), divergence="reverse_kl", jsd_beta=2.0)


@pytest.mark.parametrize(
    "k,err",
    [(0, ValueError), (6, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)],
)
def test_topk_k_errors(k, err):
    with pytest.raises(err) as info:
        jk.linear_topk_logprobs(jnp.ones((3, 4)), jnp.ones((5, 4)), k)
    assert str(info.value).startswith("k:"), info.value


# -- on a GPU ---------------------------------------------------------------------------------

GPU_SHAPE = (2, 256, 32771)  # B, T, V: bf16 heads, student D_s = 256, teacher D_t = 512


def _gpu_heads(seed, with_bias):
    """The GPU tests' inputs: (student head, its float64 copy, teacher head (no bias), its
    float64 copy, mask, per-token cotangent, the loss's cotangent)."""
    rng = np.random.default_rng(seed)
    b, t, v = GPU_SHAPE
    student, student64 = _head(rng, b, t, 256, v, "vd", jnp.bfloat16, with_bias)
    (th, tw, _), (th64, tw64, _) = _head(rng, b, t, 512, v, "dv", jnp.bfloat16, False)
    mask = random_mask(rng, b, t)
    return student, student64, (th, tw), (th64, tw64), mask, cotangent(rng, (b, t)), 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_fast_on_gpu(divergence, monkeypatch):
    """memory="fast", bf16 heads of a realistic shape in 3 row blocks: values by the lean
    rule, gradients by its own formula's, bitwise reruns, and the compiled forward+backward's
    temporaries: the one kept [N, V] bf16 buffer plus a block's float32 work, under the two
    heads' float32 logits the materialised code holds."""
    monkeypatch.setattr(fused_distill, "BLOCK_BYTES", 2 * 200 * 32771 * 4)  # 3 blocks
    b, t, v = GPU_SHAPE
    (h, w, bs), (h64, w64, bs64), (th, tw), (th64, tw64), mask, g_tok, g_loss = _gpu_heads(
        8, with_bias=True
    )

    def f(h, w, bs):
        return jk.linear_distill_loss(
            h,
            w,
            th,
            tw,
            jnp.asarray(mask),
            bias=bs,
            divergence=divergence,
            teacher_weight_layout="dv",
            temperature=0.9,
            memory="fast",
        )

    step = jax.jit(lambda h, w, bs: jax.vjp(f, h, w, bs)[1]((jnp.float32(g_loss), g_tok)))
    grads = step(h, w, bs)
    for x, y in zip(grads, step(h, w, bs)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    loss, per_token = jax.jit(f)(h, w, bs)
    okw = dict(
        divergence=divergence,
        t_layout="dv",
        b=bs64,
        temperature=0.9,
        g_tok=np.asarray(g_tok),
        g_loss=g_loss,
    )
    want = distill_oracle(h64, w64, th64, tw64, mask, **okw)
    want_fast = distill_oracle(h64, w64, th64, tw64, mask, fast=jnp.bfloat16, **okw)
    want32 = distill_oracle(h64, w64, th64, tw64, mask, dt=np.float32, **okw)
    want32 = want32[:2] + want_fast[2:]
    for got, i, name in (
        (per_token, 1, "per_token"),
        (loss, 0, "loss"),
        (grads[0], 2, "dh"),
        (grads[1], 3, "dW"),
        (grads[2], 4, "db"),
    ):
        assert_close(
            got,
            want[i],
            in_dtype=jnp.bfloat16,
            want32=want32[i],
            scale=want[-1] if i < 2 else None,
            name=name,
        )
    temp = step.lower(h, w, bs).compile().memory_analysis().temp_size_in_bytes
    n = b * t
    kept, block = n * v * 2, 171 * v * 4  # 171 rows per block, float32
    # a block's float32 logits of both heads and the elementwise work beside them
    assert kept <= temp <= kept + 6 * block, f"{temp / 2**20:.1f} MiB of temporaries"
    assert temp < 2 * n * v * 4, f"{temp / 2**20:.1f} MiB of temporaries"


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["chunked", "pallas"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_on_gpu(divergence, gpu_backend, monkeypatch):
    """bf16 heads of a realistic shape on the GPU (2 MiB chunks; an odd V, which pallas pads
    to its tiles): the float64 oracle's values and gradients by docs/api.md's rules, bitwise
    reruns, and no [N, V] float32 buffer in the compiled forward+backward."""
    monkeypatch.setattr(vocab_chunks, "DISTILL_CHUNK_BYTES", 2 * 2**20)
    b, t, v = GPU_SHAPE
    (h, w, _), (h64, w64, _), (th, tw), (th64, tw64), mask, g_tok, g_loss = _gpu_heads(
        7, with_bias=False
    )

    def f(h, w):
        return jk.linear_distill_loss(
            h,
            w,
            th,
            tw,
            jnp.asarray(mask),
            divergence=divergence,
            teacher_weight_layout="dv",
            backend=gpu_backend,
        )

    step = jax.jit(lambda h, w: jax.vjp(f, h, w)[1]((jnp.float32(g_loss), g_tok)))
    grads = step(h, w)
    again = step(h, w)
    for x, y in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    loss, per_token = jax.jit(f)(h, w)
    okw = dict(divergence=divergence, t_layout="dv", g_tok=np.asarray(g_tok), g_loss=g_loss)
    want = distill_oracle(h64, w64, th64, tw64, mask, **okw)
    want32 = distill_oracle(h64, w64, th64, tw64, mask, dt=np.float32, **okw)
    for got, i, name in (
        (per_token, 1, "per_token"),
        (loss, 0, "loss"),
        (grads[0], 2, "dh"),
        (grads[1], 3, "dW"),
    ):
        assert_close(
            got,
            want[i],
            in_dtype=jnp.bfloat16,
            want32=want32[i],
            scale=want[-1] if i < 2 else None,
            name=name,
        )
    temp = step.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    # pallas pads an odd V to its 128-column tiles: a copy of each head's weight
    padded = 0 if gpu_backend == "chunked" else -(-v // 128) * 128 * (256 + 512) * 2
    assert temp - padded < b * t * v * 4 // 2, f"{temp / 2**20:.1f} MiB of temporaries"


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_pallas_sharded_on_gpu(rng, divergence):
    """pallas's Mosaic GPU kernels under the mesh axes of one GPU (Explicit and Auto)
    and inside ``shard_map`` with ``vocab_axis``: values and gradients as the chunked
    backend's unsharded ones (the CPU suite runs Auto axes for pallas only here:
    ``pallas_auto_axes_off_gpu``)."""
    args = _sharded_inputs(rng, jnp.bfloat16)
    g = cotangent(rng, (4, 4))

    def both(fn):
        def run(*a):
            scalar = lambda *a: 0.7 * fn(*a)[0] + jnp.sum(fn(*a)[1] * g)
            return fn(*a)[1], jax.grad(scalar, argnums=(0, 1, 2))(*a)

        return run

    want = jax.jit(both(_distill_fn("chunked", divergence)))(*args)
    specs = [
        P("data", None, None),
        P("model", None),
        P("model"),
        P("data", None, None),
        P(None, "model"),
        P("data", None),
    ]
    for kind in ("Explicit", "Auto"):
        mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        with jax.set_mesh(mesh):
            got = jax.jit(both(_distill_fn("pallas", divergence)))(*placed)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _agree(x, y, name=f"{kind} {divergence}")
    inner = _distill_fn("pallas", divergence, vocab_axis="model")
    _, mapped = _in_shard_map(lambda *a: inner(*a)[1], tuple(specs), P("data", None), shape=(1, 1))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(mapped(*a) * g), argnums=(0, 1, 2)))
    want_grad = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(_distill_fn("chunked", divergence)(*a)[1] * g), argnums=(0, 1, 2)
        )
    )(*args)
    _agree(mapped(*args), want[0], name="shard_map per_token")
    for x, y in zip(grad(*args), want_grad):
        _agree(x, y, name="shard_map grad")


FFI_SHAPE = (2, 129, 32771)  # B, T, V: 258 rows (a partial row block), V odd


def _ffi_heads(seed, dtype=jnp.bfloat16):
    """Both heads "vd" without a bias (what the SM90 kernels serve): student D_s = 256,
    teacher D_t = 512; their float64 copies, mask, per-token cotangent."""
    rng = np.random.default_rng(seed)
    b, t, v = FFI_SHAPE
    (h, w, _), (h64, w64, _) = _head(rng, b, t, 256, v, "vd", dtype, False)
    (th, tw, _), (th64, tw64, _) = _head(rng, b, t, 512, v, "vd", dtype, False)
    return (h, w, th, tw), (h64, w64, th64, tw64), random_mask(rng, b, t), cotangent(rng, (b, t))


def _ffi_loss(divergence, backend="ffi", memory="lean", **kw):
    """The loss these GPU tests call: ``memory="lean"``, the mode whose backward is the SM90
    distillation kernels (automatic memory would take the fast mode for these small heads,
    which runs one function whatever the backend)."""

    def f(h, w, th, tw, mask):
        return jk.linear_distill_loss(
            h,
            w,
            th,
            tw,
            mask,
            divergence=divergence,
            jsd_beta=0.3,
            temperature=0.8,
            backend=backend,
            memory=memory,
            **kw,
        )

    return f


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_ffi_on_gpu(divergence, dtype, monkeypatch):
    """The SM90 kernels (``backend="ffi"``, ``memory="lean"``; 1 MiB backward chunks of 1920
    columns: 17 and a ragged 18th): the float64 oracle's values and gradients by docs/api.md's
    rules, bitwise reruns, no [N, V] float32 buffer, and the automatic backend (lean) is ffi."""
    from jaxrl_kernels.backends import ffi
    from jaxrl_kernels.backends.ffi import distill as ffi_distill

    if ffi.unavailable_reason():
        pytest.skip(ffi.unavailable_reason())
    monkeypatch.setattr(ffi_distill, "DEFAULT_CONFIG", ffi_distill.DistillConfig(chunk_bytes=2**20))
    (h, w, th, tw), (h64, w64, th64, tw64), mask, g_tok = _ffi_heads(11, dtype)
    f = _ffi_loss(divergence)
    mask_j = jnp.asarray(mask)
    step = jax.jit(
        lambda h, w: jax.vjp(lambda h, w: f(h, w, th, tw, mask_j), h, w)[1](
            (jnp.float32(0.5), g_tok)
        )
    )
    grads = step(h, w)
    for x, y in zip(grads, step(h, w)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    loss, per_token = jax.jit(f)(h, w, th, tw, mask_j)
    okw = dict(
        divergence=divergence, beta=0.3, temperature=0.8, g_tok=np.asarray(g_tok), g_loss=0.5
    )
    want = distill_oracle(h64, w64, th64, tw64, mask, **okw)
    want32 = distill_oracle(h64, w64, th64, tw64, mask, dt=np.float32, **okw)
    for got, i, name in (
        (per_token, 1, "per_token"),
        (loss, 0, "loss"),
        (grads[0], 2, "dh"),
        (grads[1], 3, "dW"),
    ):
        assert_close(
            got,
            want[i],
            in_dtype=dtype,
            want32=want32[i],
            scale=want[-1] if i < 2 else None,
            name=name,
        )
    b, t, v = FFI_SHAPE
    temp = step.lower(h, w).compile().memory_analysis().temp_size_in_bytes
    assert temp < b * t * v * 4 // 2, f"{temp / 2**20:.1f} MiB of temporaries"
    auto = _ffi_loss(divergence, backend=None)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(auto)(h, w, th, tw, mask_j)[1]), np.asarray(per_token)
    )
    text = jk.explain(
        "linear_distill_loss",
        h,
        w,
        th,
        tw,
        mask_j,
        divergence=divergence,
        jsd_beta=0.3,
        temperature=0.8,
        memory="lean",
    )
    assert text.splitlines()[0] == "linear_distill_loss: ffi (automatic)", text


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_distill_ffi_sharded_on_gpu(rng, divergence):
    """The SM90 kernels under the mesh axes of one GPU (Explicit and Auto) and inside
    ``shard_map`` with ``vocab_axis``: values and gradients as the chunked backend's."""
    from jaxrl_kernels.backends import ffi

    if ffi.unavailable_reason():
        pytest.skip(ffi.unavailable_reason())
    (h, w, _), _ = _head(rng, 4, 4, 64, V_SHARD, "vd", jnp.bfloat16, False)
    (th, tw, _), _ = _head(rng, 4, 4, 128, V_SHARD, "vd", jnp.bfloat16, False)
    mask = jnp.asarray(random_mask(rng, 4, 4))
    args = (h, w, th, tw, mask)
    g = cotangent(rng, (4, 4))

    def both(fn):
        def run(*a):
            scalar = lambda *a: 0.7 * fn(*a)[0] + jnp.sum(fn(*a)[1] * g)
            return fn(*a)[1], jax.grad(scalar, argnums=(0, 1))(*a)

        return run

    want = jax.jit(both(_ffi_loss(divergence, "chunked")))(*args)
    specs = [
        P("data", None, None),
        P("model", None),
        P("data", None, None),
        P("model", None),
        P("data", None),
    ]
    for kind in ("Explicit", "Auto"):
        mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        with jax.set_mesh(mesh):
            got = jax.jit(both(_ffi_loss(divergence)))(*placed)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _agree(x, y, name=f"{kind} {divergence}")
    inner = _ffi_loss(divergence, vocab_axis="model")
    _, mapped = _in_shard_map(lambda *a: inner(*a)[1], tuple(specs), P("data", None), shape=(1, 1))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(mapped(*a) * g), argnums=(0, 1)))
    want_grad = jax.jit(
        jax.grad(lambda *a: jnp.sum(_ffi_loss(divergence, "chunked")(*a)[1] * g), argnums=(0, 1))
    )(*args)
    _agree(mapped(*args), want[0], name="shard_map per_token")
    for x, y in zip(grad(*args), want_grad):
        _agree(x, y, name="shard_map grad")
