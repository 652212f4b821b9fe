"""Rows without a gradient cost no work and are inert (docs/api.md, "Padded and masked rows").

A masked row (``mask`` 0 in a loss, ``ignore_index`` in ``linear_logprobs``) gives 0 and a
``d_hidden`` row of exactly 0, and no result depends on what it holds: redrawing the masked
rows' hidden states at 1000× scale and their actions changes nothing, bitwise, on every
backend, lean and fast, value and gradient. The GEMMs run only on the kept rows
(``engine.row_skip``: the compiled program's branches multiply ``ceil(j/8)`` of the rows).

CPU tier: ``row_skip.MIN_ROWS`` lowered so that small batches take the branches (and once at
its own value); GPU tier: 4096 rows at its own value, ffi and pallas.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels.engine import row_skip
from tests.conftest import assert_bitwise, assert_zero
from tests.support import oracle


def test_bucket_sizes():
    for n in (1, 100, 128, 1000, 1024, 4097, 16384):
        sizes = row_skip.bucket_sizes(n)
        assert sizes[-1] == n and list(sizes) == sorted(set(sizes))
        assert all(s % row_skip.ROW_QUANTUM == 0 for s in sizes[:-1])
        # every count fits the first size that holds it, at most N/8 + a quantum more
        for count in range(0, n + 1, max(1, n // 37)):
            size = next(s for s in sizes if s >= count)
            assert size - count <= -(-n // row_skip.BUCKETS) + row_skip.ROW_QUANTUM
    assert row_skip.bucket_sizes(16384) == tuple(2048 * j for j in range(1, 9))


def padded_batch(rng, b, t, d, v, *, dtype=jnp.bfloat16, padded=0.35):
    """A [B, T] batch whose sequences end at lengths U(0.3, 1)·T (their tails masked, about
    ``padded`` of the positions), hidden states N(0, 1), a head N(0, 1/D)."""
    lengths = np.maximum(1, (rng.uniform(1 - 2 * padded, 1.0, b) * t).astype(int))
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    weight = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(np.float32)
    actions = rng.integers(0, v, (b, t))
    return (
        jnp.asarray(hidden, dtype),
        jnp.asarray(weight, dtype),
        jnp.asarray(actions, jnp.int32),
        jnp.asarray(mask),
    )


def redrawn(rng, hidden, actions, mask):
    """The masked rows' hidden states redrawn at 1000× scale, their actions redrawn."""
    off = np.asarray(mask) == 0
    h = np.array(hidden.astype(jnp.float32))
    h[off] = 1000 * rng.standard_normal((int(off.sum()), h.shape[-1]))
    a = np.array(actions)
    a[off] = rng.integers(0, 7, int(off.sum()))
    return jnp.asarray(h, hidden.dtype), jnp.asarray(a, jnp.int32)


def grpo(memory, backend):
    def loss(hidden, weight, actions, mask, old, rewards):
        out = jk.linear_grpo_loss(
            hidden,
            weight,
            actions,
            old,
            rewards,
            mask,
            groups=jk.Groups(size=2),
            memory=memory,
            backend=backend,
        )
        return out[0], out[1:]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def logprobs(memory, backend, with_entropy=True):
    def f(hidden, weight, actions, mask):
        targets = jnp.where(mask != 0, actions, -100)
        out = jk.linear_logprobs(
            hidden,
            weight,
            targets,
            ignore_index=-100,
            return_entropy=with_entropy,
            memory=memory,
            backend=backend,
        )
        logp, ent = out if with_entropy else (out, jnp.zeros_like(out))
        return jnp.sum(logp * jnp.cos(jnp.arange(logp.size).reshape(logp.shape))) + jnp.sum(ent), (
            logp,
            ent,
        )

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


MODES = [("lean", "reference"), ("lean", "chunked"), ("lean", "pallas"), ("fast", None)]


def check_inert(rng, op, memory, backend, b, t, d, v):
    hidden, weight, actions, mask = padded_batch(rng, b, t, d, v)
    # "logp": the log-probs without the entropy (the fast mode's relative form)
    fn = grpo(memory, backend) if op == "grpo" else logprobs(memory, backend, op != "logp")
    extra = ()
    if op == "grpo":
        extra = (jnp.asarray(-rng.uniform(3, 9, (b, t)), jnp.float32), jnp.arange(b) % 3 * 1.0)
    (value, aux), grads = fn(hidden, weight, actions, mask, *extra)
    h2, a2 = redrawn(rng, hidden, actions, mask)
    again = fn(h2, weight, a2, mask, *extra)
    assert_bitwise(((value, aux), grads), again, "masked rows redrawn")
    d_hidden = np.asarray(grads[0].astype(jnp.float32))
    assert_zero(d_hidden[np.asarray(mask) == 0], "d_hidden of masked rows")
    assert np.all(np.isfinite(np.asarray(value)))
    return hidden, weight, actions, mask, (value, aux, grads)


@pytest.mark.parametrize("memory,backend", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("op", ["grpo", "logprobs"])
def test_masked_rows_are_inert(rng, monkeypatch, op, memory, backend):
    """The branches taken (``MIN_ROWS`` 0), 6 × 40 rows in buckets of 128."""
    monkeypatch.setattr(row_skip, "MIN_ROWS", 0)
    check_inert(rng, op, memory, backend, 6, 40, 32, 301)


@pytest.mark.parametrize("memory,backend", [("lean", "chunked"), ("fast", None)])
def test_masked_rows_are_inert_without_branches(rng, monkeypatch, memory, backend):
    """Below ``MIN_ROWS`` (every row runs, masked ones zeroed first): the same contract."""
    monkeypatch.setattr(row_skip, "MIN_ROWS", 10**9)
    check_inert(rng, "grpo", memory, backend, 4, 24, 32, 301)


@pytest.mark.parametrize("memory,backend", [("lean", "chunked"), ("fast", None)])
def test_skipping_matches_float64(rng, memory, backend):
    """At ``MIN_ROWS`` itself (1024 rows, 8 buckets): the log-probs, entropies and their
    gradient against the float64 formulas, and against every row run (no branches)."""
    b, t, d, v = 8, 128, 16, 97
    hidden, weight, actions, mask = padded_batch(rng, b, t, d, v, dtype=jnp.float32)
    fn = logprobs(memory, backend)
    (value, (logp, ent)), (d_h, d_w) = fn(hidden, weight, actions, mask)
    keep = np.asarray(mask) != 0
    h64, w64 = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
    t64 = np.where(keep, np.asarray(actions), -100)
    z = oracle.linear_logits(h64, w64)
    lp64, ent64 = oracle.token_logprobs(z, t64, ignore_index=-100)
    np.testing.assert_allclose(np.asarray(logp), lp64, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), ent64, rtol=2e-5, atol=2e-5)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(row_skip, "MIN_ROWS", 10**9)
        (_, (logp_all, _)), (d_h_all, d_w_all) = logprobs(memory, backend)(
            hidden, weight, actions, mask
        )
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_all), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_h), np.asarray(d_h_all), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(d_w), np.asarray(d_w_all), rtol=1e-4, atol=1e-6)


def dot_rows(jaxpr) -> set[int]:
    """The leading dims of every dot_general's result in ``jaxpr``'s text, branches
    included (a GEMM over rows gives ``[rows, ...]``)."""
    return {int(m) for m in re.findall(r":(?:f32|bf16|f16)\[(\d+),\d+\] = dot_general", str(jaxpr))}


@pytest.mark.parametrize("memory", ["lean", "fast"])
def test_branches_multiply_only_kept_rows(rng, memory):
    """The program of a 2048-row loss (value and gradient) holds GEMMs of 256, 512, …, 2048
    rows, one per branch: the device runs the one that holds the kept rows."""
    hidden, weight, actions, mask = padded_batch(rng, 16, 128, 16, 97)
    old, rewards = jnp.zeros((16, 128)), jnp.arange(16.0)
    backend = "chunked" if memory == "lean" else None
    jaxpr = jax.make_jaxpr(grpo(memory, backend))(hidden, weight, actions, mask, old, rewards)
    rows = dot_rows(jaxpr)
    assert set(row_skip.bucket_sizes(2048)) <= rows, sorted(rows)


@pytest.mark.gpu
@pytest.mark.parametrize("memory,backend", [("lean", "ffi"), ("lean", "pallas"), ("fast", None)])
@pytest.mark.parametrize("op", ["grpo", "logprobs"])
def test_masked_rows_are_inert_gpu(rng, op, memory, backend):
    """4096 rows (branches at their own ``MIN_ROWS``), D 256, V 4099, bf16."""
    check_inert(rng, op, memory, backend, 16, 256, 256, 4099)
