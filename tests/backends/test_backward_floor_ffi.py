"""The ``ffi`` backend's linear-head backward with a per-row ``floor`` (a truncated softmax).

With ``u = (hidden @ Wᵀ + b) / T`` and a floor per row, the kept set is ``{j : u_j >= floor}``;
``lse`` and ``entropy`` are the kept set's, and the backward takes ``p_j = exp(u_j − lse)`` on
the kept set and 0 elsewhere, everywhere p appears; the one-hot (target) terms are not
masked. ``floor`` is the custom call's 14th operand (f32 [N]; an empty [0] one: no floor, the
grad kernel without it: csrc/ffi_backward.cc, csrc/sm90_grad_kernel.cuh).

CPU: the backward lowers to the one custom call with the floor operand (empty without one;
the extension's workspace size is stubbed where it is not built), and its Python side over a
jnp model of the kernel's contract matches the float64 reference that the GPU tests use.
GPU (``-m gpu``, Hopper only): the fused custom call against that float64 reference (bf16 and
f16, both layouts, bias, entropy, temperature, K ids per row, rows with floor −inf, a target
below its floor, ignored rows and an out-of-range target, ragged N and V, several chunks), a
floor of −inf everywhere bit for bit the call without one, and exact zeros where every row
masks a column.
"""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels.backends import ffi
from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels.head import head_ids
from tests.backends.test_ffi import _gpu_inputs  # the ffi tests' random head

N_OPERANDS = 14  # hidden, weight, bias, targets, lse, alpha, beta, gamma, h16, s, scalars,
FLOOR_OPERAND = 13  # ids, id_coef, floor


# ----------------------------------------------------------------------------- float64 reference


def _u64(h, w, b, layout, temperature):
    """u = (hidden @ Wᵀ + b) / T in float64 from the (16-bit) inputs."""
    h64, w64 = (np.asarray(x).astype(np.float64) for x in (h, w))
    z = h64 @ (w64.T if layout == "vd" else w64)
    if b is not None:
        z = z + np.asarray(b).astype(np.float64)[None, :]
    return z / temperature


MIN_GAP = 1e-3
"""Least distance (in u) between a floor and the logits on either side of it: far above the
float32 error of the kernel's u (float32 accumulation of 16-bit products; |u| = O(10))."""


def _floors(u, keep):
    """Per row a floor strictly between two distinct values of u: the midpoint of the
    ``keep[r]``-th and next largest, or of the first pair past them at least MIN_GAP apart;
    rounded to float32 (what the call takes), returned as float64 of that value."""
    n, v = u.shape
    s = -np.sort(-u, axis=1)
    out = np.empty(n)
    for r in range(n):
        k = max(1, min(int(keep[r]), v - 1))
        while k < v and s[r, k - 1] - s[r, k] < MIN_GAP:
            k += 1
        assert k < v, f"row {r}: no gap of {MIN_GAP} in u"
        out[r] = 0.5 * (s[r, k - 1] + s[r, k])
    return out.astype(np.float32).astype(np.float64)


def _kept_stats(u, floor):
    """The kept set's (p masked, lse, entropy) in float64: p = 0 where u < floor."""
    kept = u >= floor[:, None]
    um = np.where(kept, u, -np.inf)
    m = um.max(axis=1, keepdims=True)
    e = np.where(kept, np.exp(um - m), 0.0)
    lse = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    p = np.where(kept, np.exp(np.where(kept, u, 0.0) - lse[:, None]), 0.0)
    ent = lse - (p * np.where(kept, u, 0.0)).sum(axis=1)
    return p, lse, ent


def _case(
    n, d, v, layout, dtype, with_bias, entropy, temperature, seed, k_ids=0, all_floored=False
):
    """Inputs of one backward call and its float64 result: (args, kwargs, want, active, b).

    Rows (where N has them): 0 floor −inf (unless ``all_floored``), 1 an out-of-range target,
    2 its target the row's smallest logit (below the floor), every fifth from 3 no gradient
    (lse = +inf, cotangents 0); the others keep 1, 2, 5, 40 or half of the vocabulary's
    largest logits. ``k_ids`` > 0: K ids per row (targets and g_logp [N, K]), one repeated and
    one out of range."""
    h, w, b, t = _gpu_inputs(n, d, v, layout, dtype, with_bias, seed)
    u = _u64(h, w, b, layout, temperature)
    rng = np.random.default_rng(seed)
    keep = rng.choice([1, 2, 5, 40, v // 2], size=n)
    floor = _floors(u, keep)
    if n > 1 and not all_floored:
        floor[0] = -np.inf
    t = np.asarray(t).copy()
    if n > 1:
        t[1] = v + 5  # out of range: no one-hot term
    below = 2 if n > 2 else 0  # the row whose target lies below its floor
    t[below] = np.argmin(u[below])
    active = np.ones(n, bool)
    active[3::5] = False
    p, lse, ent = _kept_stats(u, floor)
    g_ent = np.where(active, rng.standard_normal(n), 0.0) if entropy else None
    if k_ids:
        ids = rng.integers(0, v, size=(n, k_ids)).astype(np.int32)
        ids[below, 0] = t[below]
        ids[:, -1] = ids[:, 0]  # a repeated id adds twice
        if n > 1:
            ids[1, 1 % k_ids] = -1  # out of range: no one-hot term
        g_k = np.where(active[:, None], rng.standard_normal((n, k_ids)), 0.0)
        onehot = np.zeros((n, v))
        for k in range(k_ids):
            ok = (ids[:, k] >= 0) & (ids[:, k] < v)
            np.add.at(onehot, (np.flatnonzero(ok), ids[ok, k]), g_k[ok, k])
        dz = onehot - g_k.sum(axis=1)[:, None] * p
        targets, g_arg = ids, g_k
    else:
        g = np.where(active, rng.standard_normal(n), 0.0)
        onehot = np.zeros((n, v))
        ok = (t >= 0) & (t < v)
        onehot[np.flatnonzero(ok), t[ok]] = 1.0
        dz = g[:, None] * (onehot - p)
        targets, g_arg = t, g
    if g_ent is not None:
        logp = np.log(np.where(p > 0, p, 1.0))
        dz -= g_ent[:, None] * p * (logp + ent[:, None])
    dz = np.where(active[:, None], dz, 0.0) / temperature
    h64, w64 = (np.asarray(x).astype(np.float64) for x in (h, w))
    w_vd = w64 if layout == "vd" else w64.T
    d_w = dz.T @ h64
    want = (dz @ w_vd, d_w if layout == "vd" else d_w.T, dz.sum(axis=0))
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    args = (
        h,
        w,
        None if b is None else b.astype(jnp.float32),
        jnp.asarray(targets),
        f32(np.where(active, lse, np.inf)),
        f32(ent),
        f32(g_arg),
        f32(g_ent),
    )
    kwargs = dict(weight_layout=layout, temperature=temperature, floor=f32(floor))
    return args, kwargs, want, active, b


def _check(got, want, active, b, dtype, tol=None):
    for name, got_x, want_x in zip(("d_hidden", "d_weight", "d_bias"), got, want):
        if name == "d_bias" and b is None:
            assert got_x is None
            continue
        got_x = np.asarray(got_x, np.float64)
        assert got_x.shape == want_x.shape, name
        assert np.isfinite(got_x).all(), name  # every element written
        err = np.linalg.norm(got_x - want_x) / max(np.linalg.norm(want_x), 1e-30)
        # float16 G (2^-11) and float32 accumulation, output rounded to the input dtype
        limit = 2.0e-3 + float(jnp.finfo(dtype).eps) if tol is None else tol
        assert err < limit, (name, err)
    assert not np.asarray(got[0], np.float64)[~active].any(), "ignored rows get no gradient"


def _backward(cols, n):
    """ffi linear_backward in chunks of ``cols`` columns (rounded up to 256)."""
    return functools.partial(
        ffi_linear.linear_backward, config=ffi_linear.Config(chunk_bytes=2 * n * cols)
    )


# ----------------------------------------------------------------------------- CPU (CI)


@pytest.fixture
def workspace_sizes(monkeypatch):
    """The extension's backward_workspace_bytes (the workspace result's shape): its own where
    it is built, else a stub (lowering needs only a size)."""
    if extension.sm90 is None:
        monkeypatch.setattr(
            extension, "sm90", types.SimpleNamespace(backward_workspace_bytes=lambda *a: 4096)
        )
    return extension.sm90


def _small(n=6, d=16, v=40, layout="vd", bias=True):
    h, w, b, t = _gpu_inputs(n, d, v, layout, jnp.bfloat16, bias, seed=0)
    return h, w, None if b is None else b.astype(jnp.float32), t


def _operand_types(text):
    """The operand types of the backward custom call in a lowered module's text."""
    lines = [
        l for l in text.splitlines() if f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}(" in l
    ]
    assert len(lines) == 1, lines
    sig = re.search(r"\} : \((.*?)\) -> ", lines[0])
    assert sig, lines[0]
    return sig.group(1).split(", ")


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_floor", [False, True])
def test_backward_lowers_with_the_floor_operand(workspace_sizes, layout, with_bias, with_floor):
    h, w, b, t = _small(layout=layout, bias=with_bias)
    n = t.shape[0]
    rows = jnp.ones((n,), jnp.float32)
    floor = jnp.full((n,), -1.5, jnp.float32) if with_floor else None

    def bwd(*a):
        return ffi_linear.linear_backward(*a, weight_layout=layout, temperature=0.7, floor=floor)

    text = (
        jax.jit(bwd)
        .trace(h, w, b, t, rows, rows, rows, rows)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count(f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}") == 1
    assert "stablehlo.while" not in text and ffi_linear.GRAD_TARGET + "(" not in text
    types_ = _operand_types(text)
    assert len(types_) == N_OPERANDS, types_
    assert types_[FLOOR_OPERAND] == (f"tensor<{n}xf32>" if with_floor else "tensor<0xf32>")
    assert ("has_bias = true" in text) == with_bias and "has_entropy = true" in text
    assert "has_floor" not in text  # the operand's size says it: no attribute


def test_backward_lowers_with_the_floor_and_k_ids(workspace_sizes):
    h, w, b, t = _small()
    n = t.shape[0]
    ids = jnp.stack([t, (t + 3) % 40], axis=1)
    g = jnp.ones((n, 2), jnp.float32)
    rows = jnp.ones((n,), jnp.float32)
    floor = jnp.zeros((n,), jnp.float32)
    bwd = lambda *a: ffi_linear.linear_backward(
        *a, weight_layout="vd", temperature=1.0, floor=floor
    )
    text = (
        jax.jit(bwd)
        .trace(h, w, b, ids, rows, rows, g, rows)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    types_ = _operand_types(text)
    assert types_[3] == f"tensor<{n}xi32>"  # row targets: all -1
    assert types_[11:] == [f"tensor<{n}x2xi32>", f"tensor<{n}x2xf32>", f"tensor<{n}xf32>"]


def test_backward_under_vmap_lowers_with_a_batched_floor(workspace_sizes):
    h, w, b, t = _small()
    n = t.shape[0]
    rows = jnp.ones((3, n), jnp.float32)
    floor = jnp.zeros((3, n), jnp.float32)

    def bwd(lse, floor):
        return ffi_linear.linear_backward(
            h, w, b, t, lse, lse, lse, lse, weight_layout="vd", temperature=1.0, floor=floor
        )

    text = jax.jit(jax.vmap(bwd)).trace(rows, floor).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}") >= 1
    assert _operand_types(text)[FLOOR_OPERAND] == f"tensor<{n}xf32>"


def _kernel_model(calls):
    """``jax.ffi.ffi_call`` for the backward target, its results in jnp (float32) from the
    kernel's contract (csrc/sm90_launch.h: GradArgs, BackwardArgs): G = alpha [v = target] −
    p (beta + gamma ln p) with p = 0 where u < floor (a non-empty floor), the ids' terms added,
    acc = G · W, d_weight = dw_scale Gᵀ · h16, d_bias = s · G. Each call's operands go into
    ``calls``."""

    def ffi_call(target, result_shapes, vmap_method=None):
        assert target == ffi_linear.BACKWARD_TARGET
        workspace = result_shapes[3]

        def call(*ops, **attrs):
            assert len(ops) == N_OPERANDS
            calls.append(ops)
            (
                hidden,
                weight,
                bias,
                targets,
                lse,
                alpha,
                beta,
                gamma,
                h16,
                s,
                scalars,
                ids,
                id_coef,
                floor,
            ) = ops
            dv, t = attrs["weight_dv"], float(attrs["temperature"])
            w_vd = (weight.T if dv else weight).astype(jnp.float32)
            y = jnp.dot(hidden.astype(jnp.float32), w_vd.T, precision="highest")
            if attrs["has_bias"]:
                y = y + bias[None, :]
            u = y * np.float32(1.0 / t)
            d = jnp.maximum(u - lse[:, None], -30000.0)
            p = jnp.exp(d)
            if floor.shape[0]:
                p = jnp.where(u >= floor[:, None], p, 0.0)
            coef = beta[:, None] + (gamma[:, None] * d if attrs["has_entropy"] else 0.0)
            cols = jnp.arange(y.shape[1])
            g = jnp.where(targets[:, None] == cols[None, :], alpha[:, None], 0.0) - p * coef
            if ids.shape[0]:
                g = head_ids.add_id_grads(g, ids, id_coef, 0)
            acc = jnp.dot(g, w_vd, precision="highest")
            d_w = scalars[0] * jnp.dot(g.T, h16.astype(jnp.float32), precision="highest")
            d_w = (d_w.T if dv else d_w).astype(weight.dtype)
            d_b = (
                jnp.dot(s, g, precision="highest")
                if attrs["has_bias"]
                else jnp.zeros((0,), jnp.float32)
            )
            return acc, d_w, d_b, jnp.zeros(workspace.shape, workspace.dtype)

        return call

    return ffi_call


CPU_CASES = [  # (N, D, V, layout, dtype, bias, entropy, temperature, K ids)
    (37, 16, 77, "vd", jnp.bfloat16, True, True, 0.8, 0),
    (21, 24, 64, "dv", jnp.float16, False, True, 1.3, 0),
    (13, 16, 50, "vd", jnp.float16, True, False, 1.0, 0),
    (19, 16, 96, "dv", jnp.bfloat16, True, True, 1.0, 3),
]


@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,entropy,temperature,k_ids",
    CPU_CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_glue_over_a_model_of_the_kernel(
    workspace_sizes, monkeypatch, n, d, v, layout, dtype, with_bias, entropy, temperature, k_ids
):
    """linear_backward's Python side (row bound, coefficients, scales, the floor operand) over a
    jnp model of the custom call: the float64 truncated-softmax gradient that the GPU tests
    check the kernel against, with their tolerances."""
    calls = []
    monkeypatch.setattr(jax.ffi, "ffi_call", _kernel_model(calls))
    args, kwargs, want, active, b = _case(
        n, d, v, layout, dtype, with_bias, entropy, temperature, seed=n + v, k_ids=k_ids
    )
    got = ffi_linear.linear_backward(*args, **kwargs)
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(calls[0][FLOOR_OPERAND]), np.asarray(kwargs["floor"]))
    _check(got, want, active, b, dtype)
    # the reference's truncation matters here: without the floor the result is far off
    no_floor = ffi_linear.linear_backward(*args, **{**kwargs, "floor": None})
    assert calls[1][FLOOR_OPERAND].shape == (0,)
    err = np.linalg.norm(np.asarray(no_floor[0], np.float64) - want[0]) / np.linalg.norm(want[0])
    assert err > 1e-2


def test_reference_floors_keep_what_they_say():
    u = np.array([[3.0, 1.0, 2.0, 2.0 - 1e-6, -1.0], [0.5, 0.4, 0.3, 0.2, 0.1]])
    floor = _floors(u, np.array([1, 2]))
    assert floor[0] == np.float32(2.5) and floor[1] == np.float32(0.35)
    floor = _floors(u, np.array([2, 5]))  # 2.0 and 2.0 - 1e-6 are too close: keep three
    assert floor[0] == np.float32(0.5 * (3.0 - 1e-6)) and floor[1] == np.float32(0.15)
    p, lse, ent = _kept_stats(u, np.array([1.5, -np.inf]))
    assert (p[0] > 0).tolist() == [True, False, True, True, False]
    np.testing.assert_allclose(p.sum(axis=1), 1.0)
    np.testing.assert_allclose(ent, -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1))


# ----------------------------------------------------------------------------- GPU (Hopper)

needs_sm90 = pytest.mark.skipif(
    ffi.unavailable_reason() is not None, reason=f"ffi unavailable: {ffi.unavailable_reason()}"
)

# (N, D, V, layout, dtype, bias, entropy, temperature, chunk columns, K ids): ragged rows
# (N % 128), odd V in "vd" (its d_weight tail through the tail buffer), several chunks and a
# narrower last one, a masked last tile, one row, K ids per row.
GPU_CASES = [
    (257, 136, 1000, "vd", jnp.bfloat16, True, True, 0.8, 256, 0),
    (37, 64, 77, "vd", jnp.float16, True, False, 1.0, 256, 0),
    (130, 64, 1001, "vd", jnp.float16, False, True, 1.0, 512, 0),
    (129, 72, 2056, "dv", jnp.bfloat16, True, False, 1.3, 768, 0),
    (1, 64, 304, "dv", jnp.float16, False, True, 1.0, 256, 0),
    (333, 128, 3000, "dv", jnp.float16, True, True, 0.7, 1024, 0),
    (1000, 512, 8191, "vd", jnp.bfloat16, True, True, 1.0, 2048, 0),
    (129, 64, 1000, "vd", jnp.bfloat16, True, True, 1.0, 256, 3),
    (77, 64, 520, "dv", jnp.float16, False, True, 0.9, 256, 2),
]


def _problem(n, d, v, layout, dtype):
    return Problem(
        n_rows=n,
        vocab=v,
        hidden_dim=d,
        dtype=jnp.dtype(dtype).name,
        weight_dtype=jnp.dtype(dtype).name,
        weight_layout=layout,
        platform="gpu",
    )


@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,entropy,temperature,cols,k_ids",
    GPU_CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_gpu_cases_are_served(n, d, v, layout, dtype, with_bias, entropy, temperature, cols, k_ids):
    """The GPU cases are ones the ffi backend accepts (its alignment rules: ffi.declines)."""
    assert ffi_linear.declines("linear_logprobs_backward", _problem(n, d, v, layout, dtype)) is None


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,entropy,temperature,cols,k_ids",
    GPU_CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_gpu_backward_with_floor_against_float64(
    n, d, v, layout, dtype, with_bias, entropy, temperature, cols, k_ids
):
    """The fused custom call with a per-row floor against the float64 truncated-softmax VJP:
    p masked below each row's floor, the kept set's lse and entropy, rows with floor −inf, a
    target below its floor (its one-hot term kept), ignored rows and an out-of-range target."""
    args, kwargs, want, active, b = _case(
        n, d, v, layout, dtype, with_bias, entropy, temperature, seed=n + v, k_ids=k_ids
    )
    got = jax.jit(lambda *a: _backward(cols, n)(*a, **kwargs))(*args)
    # d_hidden unrounded (float32: the engine rounds it once, after any cross-device sum),
    # d_weight in the weight's dtype
    assert got[0].dtype == jnp.float32 and got[1].dtype == args[1].dtype
    _check(got, want, active, b, dtype)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout,dtype", [("vd", jnp.bfloat16), ("dv", jnp.float16)])
def test_gpu_floor_of_minus_inf_is_no_floor_bit_for_bit(layout, dtype):
    """floor = −inf on every row keeps every logit: the kernel with the floor writes the G of
    the kernel without one, so the results agree bit for bit."""
    n, d, v, cols = 300, 128, 3000, 1024
    args, kwargs, _, _, _ = _case(n, d, v, layout, dtype, True, True, 0.9, seed=8)
    h, w, b32, t, _, _, g, g_ent = args
    u = _u64(h, w, b32, layout, 0.9)
    p, lse, ent = _kept_stats(u, np.full(n, -np.inf))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    call = lambda floor: jax.jit(
        lambda *a: _backward(cols, n)(*a, weight_layout=layout, temperature=0.9, floor=floor)
    )(h, w, b32, t, f32(lse), f32(ent), g, g_ent)
    with_floor = call(jnp.full((n,), -jnp.inf, jnp.float32))
    without = call(None)
    for x, y in zip(with_floor, without):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_columns_every_row_masks_get_exact_zeros(layout):
    """Every row keeps only its few largest logits: a column that no active row keeps and
    none targets gets G = 0 in every row, so its d_weight and d_bias are exactly 0 (and the
    rest matches float64)."""
    n, d, v, cols, dtype = 40, 64, 2048, 512, jnp.bfloat16  # few rows: most columns unkept
    args, kwargs, want, active, b = _case(
        n, d, v, layout, dtype, True, True, 1.0, seed=21, all_floored=True
    )
    floor = np.asarray(kwargs["floor"], np.float64)
    assert np.isfinite(floor).all()
    got = jax.jit(lambda *a: _backward(cols, n)(*a, **kwargs))(*args)
    _check(got, want, active, b, dtype)
    u = _u64(args[0], args[1], args[2], layout, 1.0)
    t = np.asarray(args[3])
    live = ((u >= floor[:, None]) & active[:, None]).any(axis=0)
    ok = active & (t >= 0) & (t < v)
    live[t[ok]] = True
    assert (~live).sum() > 0  # some columns are masked in every row
    d_w = np.asarray(got[1], np.float64)
    d_w = d_w if layout == "vd" else d_w.T
    assert not d_w[~live].any() and not np.asarray(got[2])[~live].any()
    assert d_w[live].any(axis=1).mean() > 0.9
