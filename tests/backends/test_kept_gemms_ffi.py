"""The fast mode's backward GEMMs on ffi (``kept_gemms``): one custom call that reads a
row-skipping branch's rows of the kept gradient in place (docs/api.md, "Padded and masked rows").

CPU (CI): dispatch's reasons; the fused loss lowers for CUDA with the call in every branch of
fewer rows than the kept buffer, handed the whole buffer, and XLA's GEMMs in the branch of
every row. GPU (Hopper): the call against float64 (both layouts and dtypes, S below and at the
buffer's rows, no rows at all); the fast GRPO loss under row skipping against every row run,
its masked rows inert, and its temp about one ``[N, V]``, where XLA's GEMMs held up to 7/8 of
that again.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels.backends import ffi
from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.backends.ffi import kept_gemms as ffi_kept_gemms
from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels.engine import fused_loss, row_skip
from jaxrl_kernels.engine.linear_head import HeadCall
from tests.engine import test_row_skip as skipping

TARGET = ffi_kept_gemms.TARGET


@pytest.mark.parametrize(
    "kw,expect",
    [
        (dict(dtype="float32"), "serves bfloat16 and float16"),
        (dict(weight_dtype="float16"), "one 16-bit dtype"),
        (dict(hidden_dim=20), "D = 20 is not a multiple of 8"),
        (dict(vocab=4099), "V = 4099 is not a multiple of 8"),
        (dict(vocab=4099, weight_layout="dv"), "V = 4099 is not a multiple of 8"),
        (dict(), None),
    ],
)
def test_declines_what_the_call_does_not_serve(kw, expect):
    base = dict(n_rows=4096, vocab=4096, hidden_dim=64, dtype="bfloat16", weight_dtype="bfloat16")
    why = ffi_kept_gemms.declines("kept_gemms", Problem(**{**base, **kw}))
    assert (why is None) if expect is None else (expect in why), why


def test_taken_automatically_where_it_serves():
    """Automatic choice takes the call wherever it serves (measured on an H100: about one
    ``[N, V]`` of temp, XLA's speed), and gives the same reason as ``declines`` elsewhere."""
    problem = Problem(n_rows=4096, vocab=4096, hidden_dim=64, dtype="bfloat16")
    assert ffi.automatic("kept_gemms", problem) is None
    assert ffi.declines("kept_gemms", problem) is None
    odd = Problem(n_rows=4096, vocab=4099, hidden_dim=64, dtype="bfloat16")
    assert "not a multiple of 8" in ffi.declines("kept_gemms", odd)


@pytest.fixture
def sm90():
    if extension.sm90 is None:
        pytest.skip(f"extension not built: {extension.IMPORT_ERROR}")
    return extension.sm90


def test_fused_loss_branches_read_the_kept_rows_in_place_for_cuda(sm90):
    """1024 rows, the last 300 masked: each branch of S < 1024 rows calls ``kept_gemms`` on the
    whole ``[1024, V]`` gradient and its S rows of hidden states; the branch of every row runs
    XLA's two GEMMs."""
    del sm90
    n, d, v = 1024, 16, 48
    key = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(key[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(key[1], (v, d), jnp.float32) / 4).astype(jnp.bfloat16)
    t = jnp.arange(n, dtype=jnp.int32) % v
    rv = jnp.arange(n) < n - 300
    loss_fn = lambda logp, entropy, inputs: jnp.sum(logp * inputs)  # noqa: E731

    def loss(h, w):
        call = HeadCall(weight_layout="vd", temperature=1.0, return_entropy=False)
        return fused_loss.fused_linear_loss(
            ffi_linear.kept_logits,
            loss_fn,
            h,
            w,
            None,
            t,
            rv,
            jnp.ones((n,)),
            call,
            gemms=ffi_kept_gemms.kept_grad_gemms,
        )

    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(h, w)
    text = grad.lower(lowering_platforms=("cuda",)).as_text()
    signature = re.compile(rf"@{TARGET}\(.*: \(tensor<(\d+)x{v}xbf16>, tensor<(\d+)x{d}xbf16>")
    calls = [m.groups() for m in map(signature.search, text.splitlines()) if m]
    assert sorted(int(s) for _, s in calls) == list(row_skip.bucket_sizes(n)[:-1]), calls
    assert all(int(rows) == n for rows, _ in calls), calls
    assert re.search(rf"dot_general.*tensor<{n}x{v}xbf16>", text), "the branch of every row"


# ----------------------------------------------------------------------------- GPU (Hopper)

needs_sm90 = pytest.mark.skipif(
    ffi.unavailable_reason() is not None, reason=f"ffi unavailable: {ffi.unavailable_reason()}"
)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "s,r,d,v,layout,dtype",
    [
        (1, 129, 64, 1024, "vd", jnp.bfloat16),
        (300, 1024, 256, 4096, "dv", jnp.bfloat16),
        (640, 4096, 4096, 8192, "vd", jnp.bfloat16),
        (1024, 1024, 2048, 32768, "vd", jnp.float16),
        (384, 2048, 512, 50264, "dv", jnp.float16),
        (0, 128, 64, 1024, "vd", jnp.bfloat16),
        (2560, 4096, 2048, 65536, "vd", jnp.bfloat16),  # d_hidden's 160 tiles: K in 4 parts
    ],
)
def test_gpu_kept_gemms_against_float64(s, r, d, v, layout, dtype):
    """``c·dz[:S]·W`` (float32) and ``c·dz[:S]ᵀ·h`` (W's dtype, rounded once) against float64;
    the rows of ``dz`` past S hold large values the call must not read."""
    key = jax.random.split(jax.random.key(1), 3)
    dz = jax.random.normal(key[0], (r, v), jnp.float32) * 1e-2
    dz = dz.at[s:].set(1e4).astype(dtype)
    h = jax.random.normal(key[1], (s, d), jnp.float32).astype(dtype)
    w_vd = (jax.random.normal(key[2], (v, d), jnp.float32) / np.sqrt(d)).astype(dtype)
    w = w_vd if layout == "vd" else w_vd.T
    c = -0.75
    d_hidden, d_weight = jax.jit(
        lambda dz, h, w: ffi_kept_gemms.kept_grad_gemms(h, w, dz, c, weight_layout=layout)
    )(dz, h, w)
    assert d_hidden.dtype == jnp.float32 and d_hidden.shape == (s, d)
    assert d_weight.dtype == dtype and d_weight.shape == w.shape
    dz64 = np.asarray(dz[:s], np.float64)
    h64, w64 = np.asarray(h, np.float64), np.asarray(w_vd, np.float64)
    want_h = c * dz64 @ w64
    want_w = c * dz64.T @ h64
    got_w = np.asarray(d_weight, np.float64)
    got_w = got_w if layout == "vd" else got_w.T
    # float32 accumulation over K = V products: a few units of 2**-24 times sqrt(K) times the
    # sum of the products' magnitudes (at K = 32768 about 4e-5 of that sum; dz's rows past S,
    # 1e4 each, or a lost K block would be off by far more)
    bound_h = 2.0**-22 * np.sqrt(v) * abs(c) * (np.abs(dz64) @ np.abs(w64))
    np.testing.assert_array_less(np.abs(np.asarray(d_hidden) - want_h), bound_h + 1e-30)
    ulp = 2.0**-8 if dtype == jnp.bfloat16 else 2.0**-11
    scale_w = max(np.max(np.abs(want_w), initial=0.0), 1e-30)
    np.testing.assert_array_less(np.abs(got_w - want_w), ulp * np.abs(want_w) + 1e-5 * scale_w)


@pytest.mark.gpu
@needs_sm90
def test_gpu_fast_loss_row_skipping_reads_rows_in_place(rng, monkeypatch):
    """The fast GRPO loss on 4096 padded rows (D 256, V 32768, bf16), ffi's ``kept_gemms``
    chosen automatically: its masked rows inert, value and gradients as with every row run
    (one rounding of d_weight apart), ``explain`` naming it, and a temp of about one
    ``[N, V]`` bf16."""
    b, t, d, v = 16, 256, 256, 32768
    hidden, weight, actions, mask, _ = skipping.check_inert(rng, "grpo", "fast", None, b, t, d, v)
    old = jnp.asarray(-rng.uniform(3, 9, (b, t)), jnp.float32)
    rewards = jnp.arange(b) % 3 * 1.0
    fn = skipping.grpo("fast", None)
    (value, _), grads = fn(hidden, weight, actions, mask, old, rewards)
    with monkeypatch.context() as m:
        m.setattr(row_skip, "MIN_ROWS", 10**9)
        (value_all, _), grads_all = skipping.grpo("fast", None)(
            hidden, weight, actions, mask, old, rewards
        )
    np.testing.assert_allclose(float(value), float(value_all), rtol=1e-6)
    for got, want in zip(grads, grads_all):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_array_less(
            np.abs(got - want), 2.0**-7 * np.abs(want) + 1e-3 * np.max(np.abs(want))
        )
    text = jk.explain(
        "linear_grpo_loss",
        hidden,
        weight,
        actions,
        old,
        rewards,
        mask,
        groups=jk.Groups(size=2),
        memory="fast",
    )
    assert "kept_gemms: ffi" in text and "7/8" not in text, text
    temp = fn.lower(hidden, weight, actions, mask, old, rewards).compile().memory_analysis()
    logits = b * t * v * 2
    assert temp.temp_size_in_bytes <= 1.25 * logits, temp.temp_size_in_bytes / logits
