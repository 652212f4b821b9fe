"""memory="fast" with 16-bit heads: as accurate as the plain bf16 code users write, op by op.

Every op with a fast mode — ``linear_logprobs`` (with the entropy), ``linear_grpo_loss``,
``linear_ppo_loss``, ``linear_policy_gradient_loss``, ``linear_distill_loss`` (forward KL,
reverse KL, JSD) — runs each case three ways on the same 16-bit inputs:

* **fast**: the op with ``memory="fast"``, under ``jax.jit``;
* **plain**: what a user writes without the fused op: ``z = jnp.einsum(hidden, weight)``
  (16-bit logits: float32 accumulation rounded once to the inputs' dtype), then
  ``(z + bias) / T`` and ``log_softmax`` in float32, the action's entry, and the loss written
  out here in float32 ``jax.numpy`` (the clipped surrogate, k3, group advantages, the
  aggregation weights; nothing from the library), differentiated by ``jax.vjp``, so that the
  logits' gradient enters the backward GEMMs in the 16-bit dtype; for distillation both
  heads' 16-bit logits and their float32 softmaxes (``plain_call`` says why the logits cross a
  jit boundary);
* **exact**: docs/api.md's formulas in float64 NumPy (``oracle.py``, ``Softmax64``,
  ``divergence64``) on the values the 16-bit inputs hold.

With random cotangents on every output (the PPO metrics' included; a scalar loss's a random
signed power of two, which the fused losses apply to ``h`` exactly: docs/api.md says that
another value adds one rounding of ``c·h``), and for the losses once
more as ``jax.grad`` of the loss alone (the fused losses' kept gradient; ``(grad)`` in the
reports), each output — per-token
log-probs, entropies and divergences, the losses, and the gradients ``d_hidden``,
``d_weight``, ``d_bias`` — gets the norm-relative error ``err = ‖got − exact‖ / ‖exact‖``,
and the rule is::

    err_fast <= 1.25 · err_plain + 1e-4      and   err_fast <= (max|z̃| + 1) · eps(dtype)

the second a float64 bound that fails a case where both are bad: logits rounded to the dtype
move the softmax by up to max|z̃|·eps/2 relative (z̃ = (h·Wᵀ + b) / T, both heads for
distillation), and the gradients come back rounded to it. A scalar loss is a sum whose
terms cancel (advantages of both signs), so its ``‖exact‖`` is its condition scale
``Σ_i |∂L/∂x_i · x_i|`` over the per-token quantities ``x`` it is made of (log-probs,
entropies, divergences): the error that relative perturbations of those would make, the vector
rule applied to a functional of the vector.

Clipped losses: the old log-probs are drawn so that no token's ratio ``exp(logp − old_logp)``
lies within ``MARGIN`` of a clip boundary (``1 − clip_low``, ``1 + clip_high``, the dual clip
``c``), with ``logp`` computed in float64 first. 16-bit logits move a log-prob by ~1e-3; a
token that near a boundary changes sides and its whole gradient row with it, in the fast mode
and in the plain code alike: a property of 16-bit logits, not of either. One test puts tokens
within ~1e-3 (bf16; ~1e-4 f16) of a boundary on purpose: there the fast mode and the plain code
put tokens on the wrong side, the lean default (float32 log-probs, ~1e-6) none.

The grids (``test_grids_cover_every_pair`` checks the claims). Axes: weight layout (``vd``,
``dv``) × dtype (bf16, f16) × V × N, and per op its options (``OPTIONS``, what shapes the
cotangent: temperature and ignored targets; group advantages, the reference KL, the dual clip,
the entropy bonus and the aggregation modes; the divergence) and bias. N: 1 (``SINGLE_DRAWS``
draws of fresh hidden states, the norms over all of them), an odd N, and an N of more than four row
blocks of the fast paths (``fused_loss.ROW_BLOCK_BYTES`` and ``fused_distill.BLOCK_BYTES``
patched to ``block_rows`` rows; ``linear_logprobs`` keeps its logits whole).

* ``gpu`` tier (``@pytest.mark.gpu``): V ∈ {4099, 32003, 50257, 151936}, N ∈ {1, 21, 72}
  (16-row blocks), D = 192 (teacher 256). Per op the half of layout × dtype × V × N with an
  even index sum (every pair of values of two axes appears), the option and bias set by
  ``gpu_grid`` so that every (op, option) meets every value of every axis and both bias
  values: 5 ops × 24 = 120 cases.
* CPU tier: V = 4099, N ∈ {1, 15, 36} (8-row blocks), D = 48 (teacher 64). Per op the half of
  layout × dtype × N with an even index sum, the options in turn, bias on every other case
  (6 cases), and one case at V = 32003: 5 × 7 = 35 cases; every value of every axis and every
  (op, option) appears.

Weights are scaled 2/sqrt(D), so the logits are O(1–10).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels.engine import fused_distill, fused_loss
from tests.conftest import random_mask
from tests.support import oracle

FACTOR, FLOOR = 1.25, 1e-4
"""err_fast <= FACTOR · err_plain + FLOOR (the module docstring)."""
MARGIN = 0.03
"""No token's ratio lies within this of a clip boundary (see the module docstring)."""
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}

# Per op, the options that shape the cotangent, by name (the test ids). ``ref=True``: pass
# ``ref_logp``; ``ignore=True``: a quarter of the targets are ``ignore_index``.
OPTIONS = {
    "logprobs": {
        "T1": dict(),
        "T0.7-ignore": dict(temperature=0.7, ignore=True),
    },
    "grpo": {
        "group": dict(),
        "ref_kl": dict(ref=True, beta=0.04),
        "dual_clip": dict(dual_clip=3.0, clip_high=0.28),
        "seq_mean_token_mean": dict(loss_agg_mode="seq_mean_token_mean", temperature=0.9),
        "seq_mean_token_sum-ref_kl": dict(loss_agg_mode="seq_mean_token_sum", ref=True, beta=0.1),
    },
    "ppo": {
        "default": dict(),
        "ref_kl": dict(ref=True, kl_coef=0.05),
        "dual_clip": dict(dual_clip=3.0),
        "entropy": dict(entropy_coef=0.01, temperature=0.9),
        "seq_mean_token_mean": dict(loss_agg_mode="seq_mean_token_mean"),
        "seq_mean_token_sum-dual_clip": dict(loss_agg_mode="seq_mean_token_sum", dual_clip=2.5),
    },
    "pg": {
        "token_mean": dict(loss_agg_mode="token_mean"),
        "seq_mean_token_mean": dict(loss_agg_mode="seq_mean_token_mean"),
        "seq_mean_token_sum": dict(loss_agg_mode="seq_mean_token_sum"),
        "seq_mean_token_sum_norm": dict(loss_agg_mode="seq_mean_token_sum_norm", max_len=40),
    },
    "distill": {
        "forward_kl": dict(divergence="forward_kl"),
        "reverse_kl": dict(
            divergence="reverse_kl", loss_agg_mode="seq_mean_token_mean", temperature=0.8
        ),
        "jsd": dict(divergence="jsd", jsd_beta=0.3, loss_agg_mode="seq_mean_token_sum"),
    },
}


# -- the grids -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    option: str
    layout: str
    dtype: str
    vocab: int
    rows: tuple[int, int]  # [B, T]
    bias: bool
    d: int
    block_rows: int
    peaked: bool = False  # the head of ``peaked_head``, actions sampled: an RL batch's rows

    @property
    def id(self):
        n = self.rows[0] * self.rows[1]
        return (
            f"{self.op}-{self.option}-{self.layout}-{self.dtype}-V{self.vocab}-N{n}"
            + ("-bias" if self.bias else "")
            + ("-peaked" if self.peaked else "")
        )


def gpu_grid(vocabs, rows, *, d, block_rows):
    """Per op, the half of layout × dtype × V × N whose indices (i, j, k, l) have an even sum
    (every pair of values of two axes appears), with the option and bias::

        option = options[(3·i + 2·k + l) mod len(options)]      bias = (i + j) mod 2

    so that every option (2 to 6 of them) meets every value of every axis and both bias
    values (``test_grids_cover_every_pair``)."""
    cases = []
    for op, options in OPTIONS.items():
        names = list(options)
        for (i, layout), (j, dtype), (k, vocab), (l, bt) in itertools.product(
            enumerate(("vd", "dv")), enumerate(DTYPES), enumerate(vocabs), enumerate(rows)
        ):
            if (i + j + k + l) % 2 == 0:
                cases.append(
                    Case(
                        op,
                        names[(3 * i + 2 * k + l) % len(names)],
                        layout,
                        dtype,
                        vocab,
                        bt,
                        bool((i + j) % 2),
                        d,
                        block_rows,
                    )
                )
    return cases


def half_grid(vocab, rows, *, d, block_rows, extra_vocab):
    """Per op, the half of layout × dtype × N with i + j + l even (the values' indices): every
    pair of values of two of these axes appears once or twice. The op's options are taken in
    turn, bias on every other case; and one case at ``extra_vocab`` and the largest N, its
    option, layout, dtype and bias stepping from op to op."""
    cases = []
    for m, (op, options) in enumerate(OPTIONS.items()):
        names = list(options)
        half = [
            (layout, dtype, bt)
            for (i, layout), (j, dtype), (l, bt) in itertools.product(
                enumerate(("vd", "dv")), enumerate(DTYPES), enumerate(rows)
            )
            if (i + j + l) % 2 == 0
        ]
        cases += [
            Case(op, names[n % len(names)], layout, dtype, vocab, bt, bool(n % 2), d, block_rows)
            for n, (layout, dtype, bt) in enumerate(half)
        ]
        cases.append(
            Case(
                op,
                names[m % len(names)],
                ("vd", "dv")[m % 2],
                list(DTYPES)[m // 2 % 2],
                extra_vocab,
                rows[-1],
                bool(m % 2),
                d,
                block_rows,
            )
        )
    return cases


def peaked_grid(vocabs, rows, *, d, block_rows):
    """Per op and V, two peaked cases (``peaked_hidden``) of ``rows``: bf16 "vd" and f16 "dv",
    the second with a bias, the op's options taken in turn."""
    cases = []
    for m, (op, options) in enumerate(OPTIONS.items()):
        names = list(options)
        for k, vocab in enumerate(vocabs):
            for n, (layout, dtype, bt) in enumerate((("vd", "bf16", rows), ("dv", "f16", rows))):
                option = names[(m + 2 * k + n) % len(names)]
                cases.append(
                    Case(op, option, layout, dtype, vocab, bt, bool(n), d, block_rows, True)
                )
    return cases


GPU_GRID = gpu_grid((4099, 32003, 50257, 151936), ((1, 1), (3, 7), (8, 9)), d=192, block_rows=16)
CPU_GRID = half_grid(4099, ((1, 1), (3, 5), (4, 9)), d=48, block_rows=8, extra_vocab=32003)
GPU_PEAKED = peaked_grid((32003, 151936), (8, 9), d=192, block_rows=16)
CPU_PEAKED = peaked_grid((4099,), (4, 9), d=48, block_rows=8)


def test_grids_cover_every_pair():
    """Both tiers: every value of every axis appears for every op, every (op, option)
    appears. The GPU tier: every (op, option) meets every value of every axis and both bias
    values. Both: the largest N crosses more than four row blocks."""
    for grid, n_cases in ((GPU_GRID, 120), (CPU_GRID, 35)):
        assert len(grid) == n_cases == len({c.id for c in grid})
        for op, options in OPTIONS.items():
            cases = [c for c in grid if c.op == op]
            assert {c.option for c in cases} == set(options), op
            for axis in ("layout", "dtype", "vocab", "rows", "bias"):
                everywhere = {getattr(c, axis) for c in grid}
                assert {getattr(c, axis) for c in cases} == everywhere, (op, axis)
                for option in options if grid is GPU_GRID else ():
                    seen = {getattr(c, axis) for c in cases if c.option == option}
                    assert seen == everywhere, (op, option, axis, seen)
        assert max(c.rows[0] * c.rows[1] for c in grid) > 4 * grid[0].block_rows


# -- inputs ----------------------------------------------------------------------------------


def as_pair(x64, dtype):
    """A float64 array as a jax array of ``dtype`` and the float64 values that holds."""
    x = jnp.asarray(np.asarray(x64, np.float32)).astype(dtype)
    return x, np.asarray(x).astype(np.float64)


def head(rng, case, kept, *, d=None, layout=None):
    """``(hidden, weight, bias)`` of the case's dtype (bias None without), and their float64
    values: ``hidden`` [B, T, D] N(0, 1), ``weight`` N(0, 4/D) (logits O(1–10)), bias
    N(0, 0.25). ``d`` and ``layout`` default to the case's. The weight and bias are drawn once
    per case and kept in the dict ``kept`` (the draws of an N = 1 case share them, as the
    tokens of one call do); the hidden states are fresh."""
    d, layout, dtype = d or case.d, layout or case.layout, DTYPES[case.dtype]
    if (d, layout) not in kept:
        w = rng.standard_normal((case.vocab, d)) * 2 / np.sqrt(d)
        if case.peaked:
            w = w / np.linalg.norm(w, axis=1, keepdims=True)
        w = as_pair(w if layout == "vd" else w.T, dtype)
        b = as_pair(0.5 * rng.standard_normal(case.vocab), dtype) if case.bias else (None,) * 2
        kept[d, layout] = w, b
    w, b = kept[d, layout]
    if case.peaked:
        h = as_pair(peaked_hidden(rng, w[1] if layout == "vd" else w[1].T, case.rows), dtype)
    else:
        h = as_pair(rng.standard_normal(case.rows + (d,)), dtype)
    primals = (h[0], w[0]) + ((b[0],) if case.bias else ())
    return primals, (h[1], w[1], b[1])


def peaked_hidden(rng, w_vd, rows):
    """Hidden states [*rows, D] of peaked next-token distributions over the unit rows of
    ``w_vd`` [V, D]: each points at a token ``a`` with sharpness ``κ ~ U(log V, log V + 8)``
    (so ``z_a ≈ κ`` against ``z ≈ N(0, κ²/D)`` elsewhere) and, on half the rows, at a
    second token ``b`` with ``κ − U(0, 4)``: per-row entropy ~0.01–2 nats, top-1 mass mostly
    above 0.5, the target logit 8–16, where bfloat16's spacing is 2⁻⁴ to 2⁻³."""
    n, vocab = int(np.prod(rows)), w_vd.shape[0]
    kappa = rng.uniform(np.log(vocab), np.log(vocab) + 8, n)
    second = (rng.random(n) < 0.5) * np.maximum(kappa - rng.uniform(0, 4, n), 0)
    a, b = rng.integers(0, vocab, n), rng.integers(0, vocab, n)
    h = kappa[:, None] * w_vd[a] + second[:, None] * w_vd[b]
    return h.reshape(tuple(rows) + (w_vd.shape[1],))


def actions(rng, case, z64, temperature=1.0):
    """The actions [*rows]: uniform over the vocabulary, or on a peaked case drawn from the
    float64 distribution ``softmax(z64 / T)`` (as a sampler draws its rollout's tokens)."""
    if not case.peaked:
        return rng.integers(0, case.vocab, case.rows)
    u = z64.reshape(-1, case.vocab) / temperature
    p = np.exp(u - u.max(-1, keepdims=True))
    cdf = np.cumsum(p / p.sum(-1, keepdims=True), -1)
    picks = (cdf < rng.random((cdf.shape[0], 1))).sum(-1)
    return np.minimum(picks, case.vocab - 1).reshape(case.rows)


def logits64(h64, w64, b64, layout):
    """``h·Wᵀ + b`` in float64 (before the temperature)."""
    return oracle.linear_logits(h64, w64, b64, weight_layout=layout)


class Softmax64:
    """docs/api.md's log-probs of float64 logits ``z`` [..., V] at temperature ``T``, with the
    row statistics taken once (``oracle.token_logprobs`` and its VJP take them per call)::

        z̃ = z / T,  p = softmax(z̃),  logp = z̃_t − lse,  H = lse − Σ p·z̃
        ∂/∂z = (g·(onehot_t − p) − g_H·p·(z̃ − Σ p·z̃)) / T

    Rows whose target is ``ignore`` give 0 and get no gradient."""

    def __init__(self, z, targets, temperature=1.0, ignore=None):
        self.z, self.temperature = z / temperature, temperature
        targets = np.asarray(targets)
        self.keep = np.ones(targets.shape, bool) if ignore is None else targets != ignore
        self.t = np.where(self.keep, targets, 0)
        m = self.z.max(-1, keepdims=True)
        e = np.exp(self.z - m)
        s = e.sum(-1, keepdims=True)
        self.p = e / s
        self.lse = (m + np.log(s))[..., 0]
        self.mean = np.sum(self.p * self.z, -1)
        z_t = np.take_along_axis(self.z, self.t[..., None], -1)[..., 0]
        self.logp = np.where(self.keep, z_t - self.lse, 0.0)
        self.entropy = np.where(self.keep, self.lse - self.mean, 0.0)

    def vjp(self, g, g_ent=None):
        """The logits' cotangent for cotangents ``g`` of logp and ``g_ent`` of the entropy."""
        g = np.where(self.keep, g, 0.0)[..., None]
        dz = -g * self.p
        np.put_along_axis(
            dz, self.t[..., None], np.take_along_axis(dz, self.t[..., None], -1) + g, -1
        )
        if g_ent is not None:
            g_ent = np.where(self.keep, g_ent, 0.0)[..., None]
            dz -= g_ent * self.p * (self.z - self.mean[..., None])
        return dz / self.temperature


def test_softmax64_is_the_oracle():
    rng = np.random.default_rng(0)
    z, t = 3 * rng.standard_normal((2, 3, 50)), rng.integers(0, 50, (2, 3))
    t[0, 1] = -100
    g, g_ent = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    kw = dict(temperature=0.7, ignore_index=-100)
    sm = Softmax64(z, t, 0.7, -100)
    logp, ent = oracle.token_logprobs(z, t, **kw)
    np.testing.assert_allclose(sm.logp, logp, atol=1e-12)
    np.testing.assert_allclose(sm.entropy, ent, atol=1e-12)
    np.testing.assert_allclose(
        sm.vjp(g, g_ent), oracle.token_logprobs_vjp(z, t, g, g_ent, **kw), atol=1e-12
    )


def log_ratios(rng, shape, boundaries):
    """``logp − old_logp`` [shape]: every other token (the first among them, so that N = 1
    has a gradient) near the sampling policy, U(−0.1, 0.1), inside every clip range here; the
    others 0.6·N(0, 1), redrawn wherever the ratio lies within MARGIN of a boundary."""
    n = int(np.prod(shape))
    rho = np.where(np.arange(n) % 2 == 0, rng.uniform(-0.1, 0.1, n), 0.6 * rng.standard_normal(n))
    while True:
        near = np.zeros(n, bool)
        for b in boundaries:
            near |= np.abs(np.exp(rho) - b) < MARGIN
        if not near.any():
            return rho.reshape(shape)
        rho[near] = 0.6 * rng.standard_normal(int(near.sum()))


def boundaries(kw):
    """The ratios at which a token's surrogate changes branch."""
    found = [1 - kw.get("clip_low", 0.2), 1 + kw.get("clip_high", 0.2)]
    return found + ([kw["dual_clip"]] if kw.get("dual_clip") else [])


# -- the plain code, in float32 jax.numpy --------------------------------------------------


def product16(h, w, layout):
    """``h·Wᵀ``: the 16-bit logits (float32 accumulation, rounded once to the inputs' dtype)."""
    return jnp.einsum("...d,vd->...v" if layout == "vd" else "...d,dv->...v", h, w)


def plain_scaled(z, b, temperature):
    """``(z + b) / T`` in float32."""
    z = z.astype(jnp.float32)
    if b is not None:
        z = z + b.astype(jnp.float32)
    return z / temperature


def plain_logprobs(z, targets, ignore=None):
    """``(logp, entropy)`` from float32 logits: ``log_softmax``, the target's entry, and
    ``−Σ p·log p``; 0 where ``targets == ignore``."""
    ls = jax.nn.log_softmax(z, axis=-1)
    ignored = jnp.zeros(targets.shape, bool) if ignore is None else targets == ignore
    safe = jnp.where(ignored, 0, targets)
    logp = jnp.take_along_axis(ls, safe[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(ls) * ls, axis=-1)
    return jnp.where(ignored, 0.0, logp), jnp.where(ignored, 0.0, ent)


def plain_weights(mask, mode, max_len=None):
    """``w`` with ``aggregate(x, mask, mode) = Σ w·x`` (docs/api.md "aggregate")."""
    b, t = mask.shape
    if mode == "token_mean":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = mask.sum(1, keepdims=True)
        n_valid = jnp.maximum(jnp.sum(per_seq > 0), 1)
        return mask / jnp.maximum(per_seq, 1.0) / n_valid
    if mode == "seq_mean_token_sum":
        return mask / b
    return mask / (b * (t if max_len is None else max_len))


def plain_group_advantages(rewards, group_size, eps=1e-6):
    """``(r − mean_g) / (std_g + eps)`` over consecutive groups; a group of one gets 0."""
    if group_size == 1:
        return jnp.zeros_like(rewards)
    r = rewards.reshape(-1, group_size)
    c = r - r.mean(1, keepdims=True)
    return (c / (jnp.sqrt(jnp.mean(c * c, 1, keepdims=True)) + eps)).reshape(-1)


def plain_surrogate(logp, old, adv, *, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """``max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))``, capped at ``−A·c`` where ``A < 0``,
    with ``r = exp(clip(logp − old, −20, 20))``; the unclipped branch on ties."""
    r = jnp.exp(jnp.clip(logp - old, -20.0, 20.0))
    unclipped = -adv * r
    clipped = -adv * jnp.clip(r, 1 - clip_low, 1 + clip_high)
    pg = jnp.where(clipped > unclipped, clipped, unclipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        pg = jnp.where((adv < 0) & (cap < pg), cap, pg)
    return pg


def plain_k3(logp, ref):
    """``exp(d) − d − 1``, ``d = clip(ref − logp, −20, 20)``."""
    d = jnp.clip(ref - logp, -20.0, 20.0)
    return jnp.exp(d) - d - 1


# -- float64 pieces ----------------------------------------------------------------------------


def head_vjp64(h64, w64, dz, layout, with_bias):
    """``(d_hidden, d_weight, d_bias | None)`` of the logits' cotangent ``dz`` [..., V]."""
    h2, dz2 = h64.reshape(-1, h64.shape[-1]), dz.reshape(-1, dz.shape[-1])
    dh = dz2 @ (w64 if layout == "vd" else w64.T)
    dw = dz2.T @ h2 if layout == "vd" else h2.T @ dz2
    return dh.reshape(h64.shape), dw, (dz2.sum(0) if with_bias else None)


def log_softmax64(z):
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def divergence64(zs, zt, divergence, beta):
    """Per row ``(d, ∂d/∂z_s)`` in float64 (docs/api.md "linear_distill_loss")::

    forward_kl  d = Σ p_t (log p_t − log p_s)       ∂d/∂z_s = p_s − p_t
    reverse_kl  d = Σ p_s (log p_s − log p_t)       ∂d/∂z_s = p_s ⊙ (log p_s − log p_t − d)
    jsd         d = β KL(p_t‖m) + (1−β) KL(p_s‖m)   ∂d/∂z_s = (1−β) p_s ⊙ (log p_s − log m
                m = β p_t + (1−β) p_s                                          − KL(p_s‖m))
    """
    ls, lt = log_softmax64(zs), log_softmax64(zt)
    ps, pt = np.exp(ls), np.exp(lt)
    if divergence == "forward_kl":
        return (pt * (lt - ls)).sum(-1), ps - pt
    if divergence == "reverse_kl":
        d = (ps * (ls - lt)).sum(-1)
        return d, ps * (ls - lt - d[..., None])
    lm = np.logaddexp(np.log(beta) + lt, np.log1p(-beta) + ls)
    kl_t, kl_s = (pt * (lt - lm)).sum(-1), (ps * (ls - lm)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s, (1 - beta) * ps * (ls - lm - kl_s[..., None])


def plain_divergence(zs, zt, divergence, beta):
    """``d`` per row from float32 logits, the formulas of :func:`divergence64`."""
    ls, lt = jax.nn.log_softmax(zs, -1), jax.nn.log_softmax(zt, -1)
    ps, pt = jnp.exp(ls), jnp.exp(lt)
    if divergence == "forward_kl":
        return jnp.sum(pt * (lt - ls), -1)
    if divergence == "reverse_kl":
        return jnp.sum(ps * (ls - lt), -1)
    lm = jnp.logaddexp(np.log(beta) + lt, np.log1p(-beta) + ls)
    return beta * jnp.sum(pt * (lt - lm), -1) + (1 - beta) * jnp.sum(ps * (ls - lm), -1)


def cond_scale(*pairs):
    """``Σ |∂L/∂x · x|`` over (∂L/∂x, x) pairs: the scale of a scalar loss of per-token x."""
    return float(sum(np.sum(np.abs(u * x)) for u, x in pairs))


# -- one op per case -------------------------------------------------------------------------
#
# A builder makes, once per case, an Op: ``fast(hidden, weight, bias, data)`` and
# ``plain(z, bias, data)`` (z: the head's 16-bit logits, ``product16``; bias None without one),
# each jitted once and run on every draw, and ``draw(rng)``: a Draw of fresh inputs.


@dataclasses.dataclass
class Op:
    fast: object
    plain: object
    draw: object
    compared: tuple  # the output names held to the rule
    layout: str


@dataclasses.dataclass
class Draw:
    primals: tuple  # (hidden, weight) or (hidden, weight, bias)
    data: dict  # the other arrays fast and plain read, as jit arguments
    exact: object  # cot -> ({name: (float64 value, scale | None)}, float64 grads)
    zmax: float  # max |z̃| of the logits (both heads' for distillation)


def logprobs_op(case, kw):
    temp = kw.get("temperature", 1.0)
    ignore = -100 if kw.get("ignore") else None
    lkw = dict(weight_layout=case.layout, temperature=temp, ignore_index=ignore)
    with_entropy = kw.get("entropy", True)  # False: the log-probs alone (the relative form)
    compared = ("logp", "entropy") if with_entropy else ("logp",)
    kept = {}

    def fast(h, w, b, data):
        out = jk.linear_logprobs(
            h, w, data["targets"], b, return_entropy=with_entropy, memory="fast", **lkw
        )
        return dict(zip(compared, out if with_entropy else (out,)))

    def plain(z, b, data):
        out = plain_logprobs(plain_scaled(z, b, temp), data["targets"], ignore)
        return dict(zip(compared, out))

    def draw(rng):
        primals, (h64, w64, b64) = head(rng, case, kept)
        targets = actions(rng, case, logits64(h64, w64, b64, case.layout), temp)
        if ignore is not None:
            targets = np.where(rng.random(case.rows) < 0.25, ignore, targets)
        sm = Softmax64(logits64(h64, w64, b64, case.layout), targets, temp, ignore)

        def exact(cot):
            dz = sm.vjp(cot["logp"], cot.get("entropy"))
            return (
                dict(logp=(sm.logp, None), entropy=(sm.entropy, None)),
                head_vjp64(h64, w64, dz, case.layout, case.bias),
            )

        return Draw(
            primals, dict(targets=jnp.asarray(targets, jnp.int32)), exact, np.abs(sm.z).max()
        )

    return Op(fast, plain, draw, compared, case.layout)


def policy_draw(rng, case, kw, kept):
    """Head and actions, the exact log-probs, ``old_logp`` clear of the clip boundaries,
    ``ref_logp`` 0.3·N(0, 1) from the log-probs (with ``kw["ref"]``), a mask; ``data`` holds
    them as the ops take them."""
    primals, (h64, w64, b64) = head(rng, case, kept)
    z64, temp = logits64(h64, w64, b64, case.layout), kw.get("temperature", 1.0)
    acts = actions(rng, case, z64, temp)
    sm = Softmax64(z64, acts, temp)
    old = as_pair(sm.logp - log_ratios(rng, case.rows, boundaries(kw)), jnp.float32)
    ref = as_pair(sm.logp + 0.3 * rng.standard_normal(case.rows), jnp.float32)
    mask = random_mask(rng, *case.rows, empty_rows=(1,) if case.rows[0] > 1 else ())
    data = dict(targets=jnp.asarray(acts, jnp.int32), old=old[0], mask=jnp.asarray(mask))
    if kw.get("ref"):
        data["ref"] = ref[0]
    return dict(
        primals=primals,
        h64=h64,
        w64=w64,
        sm=sm,
        old=old[1],
        ref=ref[1] if kw.get("ref") else None,
        mask=mask,
        data=data,
    )


def grpo_op(case, kw):
    bsz, temp = case.rows[0], kw.get("temperature", 1.0)
    group = bsz if bsz % 2 else 2  # one group of an odd B, else pairs
    given = bsz == 1  # a group of one has advantage 0 (no policy gradient): advantages given
    clip = dict(
        clip_low=kw.get("clip_low", 0.2),
        clip_high=kw.get("clip_high", 0.2),
        dual_clip=kw.get("dual_clip"),
    )
    mode, beta = kw.get("loss_agg_mode", "token_mean"), kw.get("beta", 0.0)
    kept = {}

    config = jk.PolicyLoss(kl_coef=beta, loss_agg_mode=mode, **clip)

    def fast(h, w, b, data):
        group_kw = dict(advantages=data["adv"]) if given else dict(groups=jk.Groups(size=group))
        loss, pl, kl = jk.linear_grpo_loss(
            h,
            w,
            data["targets"],
            data["old"],
            data["rewards"],
            data["mask"],
            bias=b,
            weight_layout=case.layout,
            ref_logp=data.get("ref"),
            config=config,
            temperature=temp,
            memory="fast",
            **group_kw,
        )
        return dict(loss=loss, policy_loss=pl, kl=kl)

    def plain(z, b, data):
        logp, _ = plain_logprobs(plain_scaled(z, b, temp), data["targets"])
        a = data["adv"] if given else plain_group_advantages(data["rewards"], group)
        pg = plain_surrogate(logp, data["old"], a[:, None], **clip)
        kl = plain_k3(logp, data["ref"]) if "ref" in data else jnp.zeros_like(pg)
        wts = plain_weights(data["mask"], mode)
        return dict(
            loss=jnp.sum(wts * (pg + beta * kl)),
            policy_loss=jnp.sum(wts * pg),
            kl=jnp.sum(wts * kl),
        )

    def draw(rng):
        x = policy_draw(rng, case, kw, kept)
        rewards = as_pair(rng.standard_normal(bsz), jnp.float32)
        adv = as_pair(rng.standard_normal(bsz), jnp.float32)
        lp = x["sm"].logp

        def exact(cot):
            outs, d_logp, _ = oracle._grpo_from_logp(
                lp,
                x["ref"],
                x["old"],
                rewards[1],
                x["mask"],
                group_size=None if given else group,
                group_boundaries=None,
                advantages=adv[1] if given else None,
                beta=beta,
                kl_estimator="k3",
                loss_agg_mode=mode,
                normalize_std=True,
                eps=1e-6,
                dt=np.float64,
                **clip,
            )
            names = ("loss", "policy_loss", "kl")
            values = {
                n: (v, cond_scale((d_logp(*np.eye(3)[i]), lp)))
                for i, (n, v) in enumerate(zip(names, outs))
            }
            dz = x["sm"].vjp(d_logp(*(cot[n] for n in names)))
            return values, head_vjp64(x["h64"], x["w64"], dz, case.layout, case.bias)

        data = dict(x["data"], rewards=rewards[0], adv=adv[0])
        return Draw(x["primals"], data, exact, np.abs(x["sm"].z).max())

    return Op(fast, plain, draw, ("loss", "policy_loss", "kl"), case.layout)


def ppo_op(case, kw):
    temp = kw.get("temperature", 1.0)
    options = dict(
        clip_low=kw.get("clip_low", 0.2),
        clip_high=kw.get("clip_high", 0.2),
        dual_clip=kw.get("dual_clip"),
        kl_coef=kw.get("kl_coef", 0.0),
        entropy_coef=kw.get("entropy_coef", 0.0),
        loss_agg_mode=kw.get("loss_agg_mode", "token_mean"),
    )
    clip = {k: options[k] for k in ("clip_low", "clip_high", "dual_clip")}
    kept = {}

    def fast(h, w, b, data):
        loss, metrics = jk.linear_ppo_loss(
            h,
            w,
            data["targets"],
            data["old"],
            data["adv"],
            data["mask"],
            bias=b,
            weight_layout=case.layout,
            ref_logp=data.get("ref"),
            config=jk.PolicyLoss(**options),
            temperature=temp,
            memory="fast",
        )
        return dict(loss=loss, metrics=metrics)

    def plain(z, b, data):
        logp, ent = plain_logprobs(plain_scaled(z, b, temp), data["targets"])
        per_token = plain_surrogate(logp, data["old"], data["adv"][:, None], **clip)
        if "ref" in data:
            per_token = per_token + options["kl_coef"] * plain_k3(logp, data["ref"])
        per_token = per_token - options["entropy_coef"] * ent
        return dict(loss=jnp.sum(plain_weights(data["mask"], options["loss_agg_mode"]) * per_token))

    def draw(rng):
        x = policy_draw(rng, case, kw, kept)
        adv = as_pair(rng.standard_normal(case.rows[0]), jnp.float32)
        sm, with_ent = x["sm"], options["entropy_coef"] != 0

        def exact(cot):
            loss, _, d_logp, d_ent, _ = oracle.ppo_loss(
                sm.logp,
                x["old"],
                adv[1],
                x["mask"],
                ref_logp=x["ref"],
                entropy=sm.entropy if with_ent else None,
                **options,
            )
            pairs = [(d_logp, sm.logp)] + ([(d_ent, sm.entropy)] if with_ent else [])
            c = cot["loss"]
            dz = sm.vjp(c * d_logp, None if d_ent is None else c * d_ent)
            return (
                dict(loss=(loss, cond_scale(*pairs))),
                head_vjp64(x["h64"], x["w64"], dz, case.layout, case.bias),
            )

        return Draw(x["primals"], dict(x["data"], adv=adv[0]), exact, np.abs(sm.z).max())

    return Op(fast, plain, draw, ("loss",), case.layout)


def pg_op(case, kw):
    temp, mode, max_len = kw.get("temperature", 1.0), kw["loss_agg_mode"], kw.get("max_len")
    kept = {}

    def fast(h, w, b, data):
        return dict(
            loss=jk.linear_policy_gradient_loss(
                h,
                w,
                data["targets"],
                data["adv"],
                data["mask"],
                bias=b,
                weight_layout=case.layout,
                temperature=temp,
                config=jk.PolicyLoss(loss_agg_mode=mode, max_len=max_len),
                memory="fast",
            )
        )

    def plain(z, b, data):
        logp, _ = plain_logprobs(plain_scaled(z, b, temp), data["targets"])
        wts = plain_weights(data["mask"], mode, max_len)
        return dict(loss=jnp.sum(wts * -data["adv"] * logp))

    def draw(rng):
        x = policy_draw(rng, case, kw, kept)
        adv = as_pair(rng.standard_normal(case.rows), jnp.float32)
        sm = x["sm"]

        def exact(cot):
            loss, d_logp = oracle.policy_gradient_loss(
                sm.logp, adv[1], x["mask"], loss_agg_mode=mode, max_len=max_len
            )
            dz = sm.vjp(cot["loss"] * d_logp)
            return (
                dict(loss=(loss, cond_scale((d_logp, sm.logp)))),
                head_vjp64(x["h64"], x["w64"], dz, case.layout, case.bias),
            )

        return Draw(x["primals"], dict(x["data"], adv=adv[0]), exact, np.abs(sm.z).max())

    return Op(fast, plain, draw, ("loss",), case.layout)


def distill_op(case, kw):
    """A student head and a teacher head (D_t = 4/3 D, the other layout), both of the case's
    dtype and bias; the teacher is a constant."""
    t_layout = "dv" if case.layout == "vd" else "vd"
    div, beta = kw["divergence"], kw.get("jsd_beta", 0.5)
    temp, mode = kw.get("temperature", 1.0), kw.get("loss_agg_mode", "token_mean")
    kept = {}

    def fast(h, w, b, data):
        loss, per_token = jk.linear_distill_loss(
            h,
            w,
            data["t_hidden"],
            data["t_weight"],
            data["mask"],
            config=jk.DistillLoss(divergence=div, jsd_beta=beta, loss_agg_mode=mode),
            temperature=temp,
            weight_layout=case.layout,
            teacher_weight_layout=t_layout,
            bias=b,
            teacher_bias=data["t_bias"],
            memory="fast",
        )
        return dict(loss=loss, per_token=per_token)

    def plain(z, b, data):
        zs, zt = plain_scaled(z, b, temp), plain_scaled(data["t_logits"], data["t_bias"], temp)
        mask = data["mask"]
        per_token = jnp.where(mask != 0, plain_divergence(zs, zt, div, beta), 0.0)
        return dict(loss=jnp.sum(plain_weights(mask, mode) * per_token), per_token=per_token)

    def draw(rng):
        primals, (h64, w64, b64) = head(rng, case, kept)
        teacher, (th64, tw64, tb64) = head(rng, case, kept, d=case.d * 4 // 3, layout=t_layout)
        th, tw, tb = teacher + (None,) * (3 - len(teacher))
        mask = random_mask(rng, *case.rows, empty_rows=(1,) if case.rows[0] > 1 else ())
        zs = logits64(h64, w64, b64, case.layout) / temp
        zt = logits64(th64, tw64, tb64, t_layout) / temp

        def exact(cot):
            d, dd = divergence64(zs, zt, div, beta)
            per_token = np.where(mask != 0, d, 0.0)
            wts = oracle.aggregate_weights(mask, mode)
            coef = np.where(mask != 0, cot["per_token"] + cot["loss"] * wts, 0.0)
            values = dict(
                loss=(np.sum(wts * per_token), cond_scale((wts, per_token))),
                per_token=(per_token, None),
            )
            return values, head_vjp64(h64, w64, coef[..., None] * dd / temp, case.layout, case.bias)

        data = dict(
            t_hidden=th,
            t_weight=tw,
            t_bias=tb,
            mask=jnp.asarray(mask),
            t_logits=product16(th, tw, t_layout),
        )
        return Draw(primals, data, exact, max(np.abs(zs).max(), np.abs(zt).max()))

    return Op(fast, plain, draw, ("loss", "per_token"), case.layout)


OPS = dict(logprobs=logprobs_op, grpo=grpo_op, ppo=ppo_op, pg=pg_op, distill=distill_op)


# -- the rule --------------------------------------------------------------------------------

SINGLE_DRAWS = 8
"""At N = 1 each output is one draw of each rounding, and the fast mode's log-prob error (the
lse's rounding alone) can exceed, by chance, the plain code's (the lse's and the target
logit's, which may cancel): a case of N = 1 takes this many draws through the same compiled
functions (fresh hidden states and per-token inputs, the head drawn once, as the tokens of one
call share it), and its norms are taken over all of them."""


PEAKED_DRAWS = 12
"""A peaked case's error sits in a few rows (those whose second token holds a fair share of
the mass: their gradient is the largest, their rounding the largest), so one draw's norm is
one or two rows' luck, fast's or plain's: a peaked case takes this many draws of its (larger)
N, its norms over all of them. Over draws the fast mode's errors are at or below the plain
code's (ratios 0.6-1.0 typically); fewer rows per case let one unlucky row decide it."""


def plain_call(tail, layout, h, w, b, data):
    """The plain code: the 16-bit product, then ``tail`` (jitted). The logits cross the jit
    boundary, and their cotangent comes back across it, in the 16-bit dtype, as on a GPU
    (inside one jit, XLA's CPU compiler computes a 16-bit product in float32 and may then skip
    the rounding, as its default ``xla_allow_excess_precision`` lets it)."""
    return tail(product16(h, w, layout), b, data)


class Errors:
    """Per output, ``‖got − exact‖`` of fast and plain and ``‖exact‖`` (or the scale),
    accumulated in squares over draws; ``table()`` gives ``{name: (err_fast, err_plain)}``,
    absolute where the norm is 0."""

    def __init__(self):
        self.sums = {}

    def add(self, name, fast, plain, exact, scale=None):
        exact = np.asarray(exact, np.float64)
        sq = lambda x: float(np.sum((np.asarray(x, np.float64) - exact) ** 2))
        norm2 = float(np.sum(exact**2)) if scale is None else scale**2
        self.sums[name] = self.sums.get(name, np.zeros(3)) + (sq(fast), sq(plain), norm2)

    def table(self):
        return {
            name: tuple(np.sqrt(s[:2] / (s[2] if s[2] > 0 else 1.0)))
            for name, s in self.sums.items()
        }


def small_blocks(monkeypatch, case):
    """The fast paths' row blocks cut to ``case.block_rows`` rows (the kept 16-bit logits
    for the losses; both heads' float32 logits for distillation)."""
    monkeypatch.setattr(fused_loss, "ROW_BLOCK_BYTES", case.block_rows * case.vocab * 2)
    monkeypatch.setattr(fused_distill, "BLOCK_BYTES", case.block_rows * 2 * case.vocab * 4)


def errors(case, rng):
    """``({output: (err_fast, err_plain)}, sanity bound)`` of one case, random cotangents on
    every output."""
    op = OPS[case.op](case, OPTIONS[case.op][case.option])
    fast, tail = jax.jit(op.fast), jax.jit(op.plain)
    errs, zmax = Errors(), 0.0
    for _ in range(SINGLE_DRAWS if case.rows == (1, 1) else PEAKED_DRAWS if case.peaked else 1):
        draw = op.draw(rng)
        out_fast, pullback = jax.vjp(lambda h, w, b=None: fast(h, w, b, draw.data), *draw.primals)
        cot = jax.tree.map(
            lambda o: jnp.asarray(rng.standard_normal(np.shape(o)), o.dtype), out_fast
        )
        if "loss" in cot:  # a signed power of two: the fused losses scale h by it exactly
            cot["loss"] = jnp.asarray(
                rng.choice([-1.0, 1.0]) * 2.0 ** rng.integers(-3, 4), cot["loss"].dtype
            )
        grads_fast = pullback(cot)
        out_plain, pullback = jax.vjp(
            lambda h, w, b=None: plain_call(tail, op.layout, h, w, b, draw.data), *draw.primals
        )
        grads_plain = pullback({k: cot[k] for k in op.compared})
        values, grads_exact = draw.exact({k: np.asarray(cot[k], np.float64) for k in op.compared})
        for name in op.compared:
            errs.add(name, out_fast[name], out_plain[name], *values[name])
        for name, gf, gp, want, p in zip(
            ("d_hidden", "d_weight", "d_bias"), grads_fast, grads_plain, grads_exact, draw.primals
        ):
            assert gf.dtype == p.dtype and gf.shape == p.shape, name
            errs.add(name, gf, gp, want)
        if "loss" in out_fast and len(out_fast) > 1:
            # jax.grad of the loss alone: the other outputs' cotangents are symbolic zeros,
            # so the fused losses take their kept gradient (the cotangents above, on every
            # output, take the recomputed logits)
            argnums = tuple(range(len(draw.primals)))
            grads_fast = jax.grad(lambda h, w, b=None: fast(h, w, b, draw.data)["loss"], argnums)(
                *draw.primals
            )
            one = {k: (1.0 if k == "loss" else 0.0) * jnp.ones_like(cot[k]) for k in op.compared}
            grads_plain = pullback(one)
            _, grads_exact = draw.exact({k: np.asarray(one[k], np.float64) for k in op.compared})
            for name, gf, gp, want in zip(
                ("d_hidden", "d_weight", "d_bias"), grads_fast, grads_plain, grads_exact
            ):
                errs.add(name + " (grad)", gf, gp, want)
        zmax = max(zmax, draw.zmax)
    return errs.table(), (zmax + 1) * float(jnp.finfo(DTYPES[case.dtype]).eps)


def check_case(case, rng, monkeypatch):
    small_blocks(monkeypatch, case)
    table, sanity = errors(case, rng)
    report = "\n".join(
        f"  {k:12s} fast {f:.3e}  plain {p:.3e}  bound {FACTOR * p + FLOOR:.3e}"
        for k, (f, p) in table.items()
    )
    bad = [k for k, (f, p) in table.items() if not (f <= FACTOR * p + FLOOR and f <= sanity)]
    assert not bad, (
        f"{case.id}: {bad} fail err_fast <= {FACTOR}·err_plain + {FLOOR} and "
        f"<= {sanity:.3e}\n{report}"
    )


def cpu_sample(grid, slow):
    """The grid's cases, those for which ``slow(case)`` holds marked slow."""
    return [pytest.param(c, marks=pytest.mark.slow) if slow(c) else c for c in grid]


# The large vocabulary (V 32003) on one op (logprobs, the cheapest); the other ops' V 32003
# cases are slow: their 4099 cases run the same code at every layout × dtype × N.
@pytest.mark.parametrize(
    "case",
    cpu_sample(CPU_GRID, lambda c: c.vocab != CPU_GRID[0].vocab and c.op != "logprobs"),
    ids=lambda c: c.id,
)
def test_fast_accuracy(case, rng, monkeypatch):
    check_case(case, rng, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: c.id)
def test_fast_accuracy_gpu(case, rng, monkeypatch):
    check_case(case, rng, monkeypatch)


# Peaked rows: one case per op, bf16 "vd" and f16 "dv" (with bias) in turn from op to op; the
# other slow (the half grid runs every op at both layouts and dtypes).
@pytest.mark.parametrize(
    "case",
    cpu_sample(CPU_PEAKED, lambda c: (c.layout == "dv") != bool(list(OPTIONS).index(c.op) % 2)),
    ids=lambda c: c.id,
)
def test_fast_accuracy_peaked(case, rng, monkeypatch):
    """Peaked rows (``peaked_hidden``), sampled actions: the target holds most of the mass
    and its logit is large, where the 16-bit rounding of that one logit would dominate the
    log-prob's error (``head.rounded_logits`` says how the fast mode avoids it)."""
    check_case(case, rng, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_PEAKED, ids=lambda c: c.id)
def test_fast_accuracy_peaked_gpu(case, rng, monkeypatch):
    check_case(case, rng, monkeypatch)


# -- at a clip boundary ----------------------------------------------------------------------


def flipped_rows(grad, want):
    """Rows of ``d_hidden`` [N, D] that are zero (clipped token) in one and not the other."""
    return int(
        np.sum((np.abs(np.asarray(grad, np.float64)).max(-1) == 0) != (np.abs(want).max(-1) == 0))
    )


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_tokens_at_a_clip_boundary_flip_with_16bit_logits(rng, dtype):
    """Every token's log-ratio within ``eps/8`` of ``log(1 + clip_high)`` (~1e-3 for bf16,
    ~1e-4 for f16: the size of the 16-bit logits' error in a log-prob), at least 2e-5 from it,
    on either side; A > 0, so a token above the boundary is clipped and its gradient row is
    exactly zero. The fast mode and the plain code put some tokens on the wrong side; the lean
    default, whose float32 log-probs are accurate to ~1e-6, puts none."""
    case = Case("ppo", "boundary", "vd", dtype, 4099, (4, 32), False, 48, 8)
    high, d = 0.2, case.d
    x = policy_draw(rng, case, {}, {})
    lp, eps = x["sm"].logp, float(jnp.finfo(DTYPES[dtype]).eps)
    dist = rng.uniform(2e-5, eps / 8, case.rows) * rng.choice([-1, 1], case.rows)
    old = as_pair(lp - np.log1p(high) - dist, jnp.float32)
    adv = as_pair(0.5 + rng.random(case.rows[0]), jnp.float32)
    mask = np.ones(case.rows, np.float32)
    _, _, d_logp, _, _ = oracle.ppo_loss(lp, old[1], adv[1], mask, clip_high=high)
    want = head_vjp64(x["h64"], x["w64"], x["sm"].vjp(d_logp), "vd", False)[0].reshape(-1, d)
    clipped = np.exp(lp - old[1]) > 1 + high
    assert 0 < clipped.sum() < clipped.size
    h, w = x["primals"]
    t = x["data"]["targets"]

    def loss(memory):
        return lambda h: jk.linear_ppo_loss(
            h,
            w,
            t,
            old[0],
            adv[0],
            jnp.asarray(mask),
            config=jk.PolicyLoss(clip_high=high),
            memory=memory,
        )[0]

    @jax.jit
    def tail(z, b, data):
        logp, _ = plain_logprobs(plain_scaled(z, b, 1.0), t)
        return jnp.mean(plain_surrogate(logp, old[0], adv[0][:, None], clip_high=high))

    grads = dict(
        fast=jax.grad(loss("fast"))(h),
        lean=jax.grad(loss("lean"))(h),
        plain=jax.grad(lambda h: plain_call(tail, "vd", h, w, None, None))(h),
    )
    flips = {name: flipped_rows(g.reshape(-1, d), want) for name, g in grads.items()}
    assert flips["fast"] >= 1 and flips["plain"] >= 1 and flips["lean"] == 0, flips
