"""No [N, V] float32 buffer on the vocabulary-chunked backends, measured by XLA's buffer
assignment: jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes.

Only lowering and compiling happen (ShapeDtypeStructs in): nothing big is allocated or run.
The measured numbers are printed (``pytest -s``) and written as JSON lines to
``$JAXRL_TEST_MEMORY_JSON`` when that variable is set.
"""

import json
import os

import jax
import jax.numpy as jnp
import pytest

import jaxrl_kernels as jk
from tests.conftest import CPU_BACKENDS

S = jax.ShapeDtypeStruct
F32, I32 = jnp.float32, jnp.int32
# Pallas on CPU runs in interpret mode, whose buffers say nothing about its GPU kernels.
LEAN_BACKENDS = [
    b
    for b in CPU_BACKENDS
    if b != "reference" and (b != "pallas" or jax.default_backend() == "gpu")
]


def temp_bytes(f, *args):
    return int(jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def record(**fields):
    line = json.dumps(fields, sort_keys=True)
    print("memory:", line)
    path = os.environ.get("JAXRL_TEST_MEMORY_JSON")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def linear_logprobs_fns(backend, layout, return_entropy):
    def fwd(h, w, t):
        return jk.linear_logprobs(
            h, w, t, weight_layout=layout, return_entropy=return_entropy, backend=backend
        )

    def vjp(h, w, t, g):
        def scalar(h, w):
            out = fwd(h, w, t)
            return jnp.sum(g * (out[0] + out[1] if return_entropy else out))

        return jax.value_and_grad(scalar, argnums=(0, 1))(h, w)

    return fwd, vjp


N, V, D = 2048, 32000, 256
LOGITS_BYTES = 4 * N * V


@pytest.mark.parametrize("layout,return_entropy", [("vd", False), ("dv", False), ("vd", True)])
@pytest.mark.parametrize("lean", LEAN_BACKENDS)
def test_linear_logprobs_temp_bytes(lean, layout, return_entropy):
    """N=2048, V=32000, D=256: forward and value_and_grad w.r.t. hidden and weight stay under 10%
    of the float32 [N, V] logits (a transposed copy of W, V*D*4 bytes, would not fit either);
    the reference backend, which holds the logits, is above it."""
    h, t, g = S((N, D), F32), S((N,), I32), S((N,), F32)
    w = S((V, D) if layout == "vd" else (D, V), F32)
    results = {}
    for backend in (lean, "reference"):
        fwd, vjp = linear_logprobs_fns(backend, layout, return_entropy)
        results[backend] = (temp_bytes(fwd, h, w, t), temp_bytes(vjp, h, w, t, g))
        record(
            op="linear_logprobs",
            backend=backend,
            N=N,
            V=V,
            D=D,
            layout=layout,
            return_entropy=return_entropy,
            logits_f32_bytes=LOGITS_BYTES,
            forward_temp_bytes=results[backend][0],
            value_and_grad_temp_bytes=results[backend][1],
        )
    limit = LOGITS_BYTES // 10
    fwd_b, vjp_b = results[lean]
    assert fwd_b < limit, f"{lean} forward temp {fwd_b} B >= 10% of logits ({limit} B)"
    assert vjp_b < limit, f"{lean} value_and_grad temp {vjp_b} B >= 10% of logits ({limit} B)"
    ref_f, ref_v = results["reference"]
    assert ref_f > limit and ref_v > limit, "the measurement does not see the reference's logits"


@pytest.mark.parametrize("lean", LEAN_BACKENDS)
def test_linear_ppo_loss_temp_bytes_at_1gib_logits(lean):
    """linear_ppo_loss at B*T=8192, V=32768 (float32 logits = 1 GiB), with entropy and KL terms:
    forward and gradient w.r.t. hidden, weight and bias compile to under 10% of that."""
    b, t, v, d = 8, 1024, 32768, 256
    logits_bytes = 4 * b * t * v
    assert logits_bytes >= 2**30
    tok = S((b, t), F32)
    args = (
        S((b, t, d), F32),
        S((d, v), F32),
        S((v,), F32),
        S((b, t), I32),
        tok,
        S((b,), F32),
        tok,
        tok,
    )

    def loss(backend):
        def f(h, w, bias, a, old, adv, m, ref):
            out, _ = jk.linear_ppo_loss(
                h,
                w,
                a,
                old,
                adv,
                m,
                bias=bias,
                weight_layout="dv",
                ref_logp=ref,
                kl_coef=0.1,
                entropy_coef=0.01,
                backend=backend,
            )
            return out

        return f

    sizes = {}
    for backend in (lean, "reference"):
        f = loss(backend)
        fwd = temp_bytes(f, *args)
        vg = temp_bytes(jax.value_and_grad(f, argnums=(0, 1, 2)), *args)
        sizes[backend] = (fwd, vg)
        record(
            op="linear_ppo_loss",
            backend=backend,
            B=b,
            T=t,
            V=v,
            D=d,
            layout="dv",
            logits_f32_bytes=logits_bytes,
            forward_temp_bytes=fwd,
            value_and_grad_temp_bytes=vg,
        )
    limit = logits_bytes // 10
    assert sizes[lean][0] < limit and sizes[lean][1] < limit, sizes
    assert sizes["reference"][1] > limit, sizes
