"""The ffi backend's ``kept_set`` kernel (``csrc/kept_set_kernel.cuh``): dispatch, lowering, and
on a Hopper GPU each row's kept set and sums against the float64 oracle.

CPU (CI): automatic choice takes the reference's jnp passes for ``kept_set`` off a GPU, and
ffi says why not; the ffi path lowers for CUDA to one custom call per block of rows (a loop
over the blocks), with the truncation's attributes, and inside ``shard_map`` on a device's
rows. GPU (``-m gpu``): rows from flat
(``u`` within 0.01, a nucleus of every token) to hundreds wide, 16-bit ties, rows whose
top ties exceed the kernel's gathered list, ``-inf`` entries, an anchor above the max (an
lse), inactive rows and V from 1 to 131072, under top-k (1 to 5000), top-p, min-p and
their combinations: the kept set ``u >= floor`` is the oracle's exactly, its mass and
``Σ e·(u − m)`` to float32 rounding, and the same twice (the kernel's atomics do not
change the bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels import dispatch
from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.backends.ffi import kept_set as ffi_kept_set
from jaxrl_kernels.dispatch.contract import Problem
from jaxrl_kernels.formulas import sampler_math
from jaxrl_kernels.head import kept_set
from tests.support import oracle

TRUNCATIONS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=50),
    dict(top_k=5000),
    dict(top_p=0.5),
    dict(top_p=0.95),
    dict(top_p=0.999),
    dict(min_p=0.05),
    dict(top_k=50, top_p=0.95),
    dict(top_k=1000, top_p=0.9, min_p=0.001),
]


def test_cpu_takes_the_reference_passes():
    choice = dispatch.select("linear_logprobs", Problem(n_rows=8, vocab=100), primitive="kept_set")
    if jax.default_backend() != "gpu":
        assert choice.backend == "reference" and choice.impl is kept_set.find
        assert dict(choice.declined)["ffi"] == extension.unavailable_reason()


def test_declines_rows_wider_than_the_kernel_takes():
    assert ffi_kept_set.declines("kept_set", Problem(n_rows=4, vocab=2**23)) is None
    assert "2^23" in ffi_kept_set.declines("kept_set", Problem(n_rows=4, vocab=2**23 + 1))


@pytest.mark.parametrize("trunc", [dict(top_k=50, top_p=0.95), dict(min_p=0.1)])
def test_lowers_to_one_call_per_row_block(monkeypatch, trunc):
    """Blocks of rows (a loop where more than one), the truncation as attributes."""
    monkeypatch.setattr(ffi_kept_set, "ROW_BLOCK_BYTES", 4 * 300 * 16)  # 16 rows a block
    u = jnp.ones((40, 300), jnp.float32)

    def find(u):
        logits = kept_set.Logits.of_array(u)
        found = ffi_kept_set.find_rows(
            logits, 40, 300, jnp.max(u, -1), jnp.ones(40, bool), sampler_math.truncation(**trunc)
        )
        return found.floor, found.s

    text = jax.jit(find).trace(u).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{ffi_kept_set.TARGET}") == 1
    assert "stablehlo.while" in text and "tensor<14x300xf32>" in text  # 3 blocks of 14
    assert f"top_k = {trunc.get('top_k', 0)} : i64" in text
    assert ("has_min_p = true" in text) == ("min_p" in trunc)


def test_lowers_inside_shard_map_with_the_rows_split():
    """Each device's rows (how the engine runs the op under a mesh): the custom call inside
    ``shard_map``, typed as varying over the rows' axis."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    u = jax.device_put(jnp.ones((8, 300)), NamedSharding(mesh, P("x")))

    def local(u):
        logits = kept_set.Logits.of_array(u)
        found = ffi_kept_set.find_rows(
            logits, 4, 300, jnp.max(u, -1), jnp.ones(4, bool), sampler_math.truncation(top_k=5)
        )
        return found.floor, found.s

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
    text = fn.trace(u).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{ffi_kept_set.TARGET}") == 1


@pytest.mark.parametrize("whole_rows", [True, False], ids=("ffi", "reference"))
def test_truncated_lean_head_lowers_without_a_statistics_pass(whole_rows):
    """A lean ffi head whose kept set is ffi's (whole rows): the kept-set search's GEMM of
    each block's rows gives the rows' max and target too, so the forward has no statistics
    call, only the kept-set kernel and the backward; with the reference's search, the
    statistics call and its candidates' passes."""
    from jaxrl_kernels.backends.ffi import linear as ffi_linear
    from jaxrl_kernels.engine import linear_head

    k = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(k[0], (40, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (1000, 64), jnp.float32).astype(jnp.bfloat16)
    t, valid = jnp.zeros((40,), jnp.int32), jnp.ones((40,), bool)

    def loss(h, w):
        call = linear_head.HeadCall(truncation=sampler_math.truncation(top_k=50, top_p=0.9))
        logp, _, _ = linear_head.linear_from_parts(
            ffi_linear.PARTS,
            h,
            w,
            None,
            t,
            valid,
            call,
            backward=lambda: ffi_linear.linear_backward,
            find_kept=ffi_kept_set.find_rows if whole_rows else kept_set.find,
        )
        return jnp.sum(logp)

    text = jax.jit(jax.grad(loss, (0, 1))).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}(") == 1
    statistics_calls = text.count(f"stablehlo.custom_call @{ffi_linear.TARGET}(")
    kernel_calls = text.count(f"stablehlo.custom_call @{ffi_kept_set.TARGET}(")
    assert (statistics_calls, kernel_calls) == ((0, 1) if whole_rows else (1, 0))


def _rows(rng):
    """(u [R, V] float32, the anchor m [R]) for each kind of row."""
    cases = []
    for vocab, spread, rows in (
        (1000, 3.0, 24),
        (50257, 3.0, 6),
        (131072, 4.0, 4),
        (20000, 0.01, 4),
        (20000, 300.0, 4),
        (7, 1.0, 6),
        (1, 1.0, 3),
    ):
        u = (spread * rng.standard_normal((rows, vocab))).astype(np.float32)
        cases.append((f"V={vocab} spread={spread}", u, u.max(-1)))
    u = (3.0 * rng.standard_normal((8, 6000))).astype(jnp.bfloat16).astype(np.float32)
    cases.append(("bfloat16 ties", u, u.max(-1)))
    u = (3.0 * rng.standard_normal((4, 9000))).astype(np.float32)
    u[:, :5000] = u.max(-1, keepdims=True) + 1.0  # 5000 tied at the top: more than one list
    cases.append(("5000 tied at the top", u, u.max(-1)))
    u = np.full((2, 3000), 0.25, np.float32)
    cases.append(("flat", u, u.max(-1)))
    u = (3.0 * rng.standard_normal((6, 2000))).astype(np.float32)
    u[:, ::3] = -np.inf
    cases.append(("-inf entries", u, u.max(-1)))
    u = (2.0 * rng.standard_normal((6, 4000))).astype(np.float32)
    lse = np.log(np.sum(np.exp(u.astype(np.float64)), -1)).astype(np.float32)
    cases.append(("anchor = lse", u, np.maximum(lse, u.max(-1))))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize(
    "trunc", TRUNCATIONS, ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items())
)
def test_gpu_kernel_against_the_oracle(rng, trunc):
    if extension.unavailable_reason():
        pytest.skip(extension.unavailable_reason())
    call = jax.jit(
        lambda u, m, a: ffi_kept_set.kept_set_call(
            u, m, a, sampler_math.truncation(**trunc)
        ).search_fields()
    )
    for name, u, m in _rows(rng):
        active = np.ones(u.shape[0], bool)
        active[1::5] = False
        found = call(jnp.asarray(u), jnp.asarray(m), jnp.asarray(active))
        again = call(jnp.asarray(u), jnp.asarray(m), jnp.asarray(active))
        for x, y in zip(found, again):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
        floor, s, a, passes = (np.asarray(x) for x in found)
        assert np.all(np.isneginf(floor[~active])) and np.all(s[~active] == 0), name
        want = oracle.kept_set(u[active], **trunc)
        np.testing.assert_array_equal(u[active] >= floor[active, None], want, err_msg=name)
        shifted = u[active].astype(np.float64) - m[active, None]
        e = np.where(want, np.exp(shifted), 0.0)
        np.testing.assert_allclose(s[active], e.sum(-1), rtol=2e-6, err_msg=name)
        ent = np.sum(e * np.where(want & np.isfinite(shifted), shifted, 0.0), -1)
        np.testing.assert_allclose(
            a[active], ent, rtol=2e-6, atol=2e-6 * e.sum(-1).max(), err_msg=name
        )
        assert np.all(passes[active] >= 2) and np.all(passes[~active] == 0), name
