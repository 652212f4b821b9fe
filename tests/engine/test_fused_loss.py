"""memory="fast" on the linear losses: the loss's gradient taken in the forward (fused_loss).

Against the float64 oracle, through the paths its backward takes: the loss's own cotangent
alone (the other outputs' cotangents are symbolic zeros: the two GEMMs on the gradient kept
from the forward, scaled), another output's cotangent alone (the loss's is a symbolic zero:
the recompute path only), and all of them at once (both, added).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from jaxrl_kernels.engine import fused_loss, row_skip
from tests.conftest import as_jnp, assert_close, assert_zero, cotangent, random_mask
from tests.engine.test_fast_mode import fast_formula
from tests.ops.test_linear_losses import (
    GRPO_OPTIONS,
    PPO_OPTIONS,
    _grads_check,
    _head_case,
    _split_options,
    make_head,
)
from tests.support import oracle

# float32 heads here: with 16-bit heads the kept logits are rounded (docs/api.md, memory=
# "fast"), which moves clipped ratios across the clip bounds; bfloat16 is checked on losses
# whose ratios stay inside them, against the fast mode's own float64 formula.
LAYOUTS = ["vd", "dv"]


def _ppo_case(rng, options, dtype, layout):
    x = make_head(rng, 4, 5, 37, 8, dtype, layout, with_bias=options != "default")
    (h, h64), (w, w64), (bias, b64), (actions, acts), (mask, m64), (old, old64), primals = (
        _head_case(x)
    )
    b, t = acts.shape
    adv, adv64 = as_jnp(rng.standard_normal(b), jnp.float32)
    lib_kw, orc_kw = _split_options(
        rng,
        x,
        PPO_OPTIONS[options],
        rollout=lambda _: (
            "rollout_logp",
            as_jnp(old64 + 0.3 * rng.standard_normal((b, t)), jnp.float32),
        ),
    )

    def f(*p):
        return jk.linear_ppo_loss(
            p[0],
            p[1],
            actions,
            old,
            adv,
            mask,
            bias=p[2] if len(p) > 2 else None,
            weight_layout=layout,
            memory="fast",
            **lib_kw,
        )

    def want(dt):
        return oracle.linear_ppo_loss(
            h64, w64, acts, old64, adv64, m64, bias=b64, weight_layout=layout, dt=dt, **orc_kw
        )

    return f, primals, want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", list(PPO_OPTIONS))
def test_ppo_loss_gradient_in_the_forward(rng, options, layout):
    """jax.grad of c·loss (the metrics' cotangents symbolic zeros), c ≠ 1."""
    dtype = jnp.float32
    f, primals, want = _ppo_case(rng, options, dtype, layout)
    c = float(cotangent(rng, ()))
    grads = jax.jit(jax.grad(lambda *p: c * f(*p)[0], argnums=tuple(range(len(primals)))))(*primals)
    _grads_check(grads, primals, want(np.float64)[2](c), want(np.float32)[2](c), dtype)


def _grpo_case(rng, options, dtype, layout):
    x = make_head(rng, 4, 5, 37, 8, dtype, layout, with_bias=options != "default")
    (h, h64), (w, w64), (bias, b64), (actions, acts), (mask, m64), (old, old64), primals = (
        _head_case(x)
    )
    b = acts.shape[0]
    rewards, r64 = as_jnp(rng.standard_normal(b), jnp.float32)
    lib_kw, orc_kw = _split_options(
        rng,
        x,
        GRPO_OPTIONS[options],
        advantages=lambda _: ("advantages", as_jnp(rng.standard_normal(b), jnp.float32)),
        group_boundaries=lambda v: ("group_boundaries", (jnp.asarray(v), v)),
    )

    def f(*p):
        return jk.linear_grpo_loss(
            p[0],
            p[1],
            actions,
            old,
            rewards,
            mask,
            bias=p[2] if len(p) > 2 else None,
            weight_layout=layout,
            memory="fast",
            **lib_kw,
        )

    def want(dt):
        return oracle.linear_grpo_loss(
            h64, w64, acts, old64, r64, m64, bias=b64, weight_layout=layout, dt=dt, **orc_kw
        )

    return f, primals, want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("options", list(GRPO_OPTIONS))
@pytest.mark.parametrize("which", ["loss", "policy_loss", "kl", "all"])
def test_grpo_loss_every_output_exact(rng, options, layout, which):
    """The gradient of any one output (symbolic zeros on the others), or of all three."""
    dtype = jnp.float32
    f, primals, want = _grpo_case(rng, options, dtype, layout)
    argnums = tuple(range(len(primals)))
    gs = [float(cotangent(rng, ())) for _ in range(3)]
    if which != "all":
        index = ("loss", "policy_loss", "kl").index(which)
        gs = [g if i == index else 0.0 for i, g in enumerate(gs)]
        grads = jax.grad(lambda *p: gs[index] * f(*p)[index], argnums=argnums)(*primals)
    else:
        _, vjp = jax.vjp(f, *primals)
        grads = vjp(tuple(jnp.float32(g) for g in gs))
    _grads_check(grads, primals, want(np.float64)[1](*gs), want(np.float32)[1](*gs), dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum_norm"])
def test_policy_gradient_loss_bf16_gradient_in_the_forward(rng, mode, layout):
    """bfloat16 head, c·loss: the float64 oracle, within the fast mode's own rule (its float64
    formula with the two roundings, tests/engine/test_fast_mode.fast_formula, plus 1e-3)."""
    b, t, vocab, d = 3, 4, 29, 8
    x = make_head(rng, b, t, vocab, d, jnp.bfloat16, layout, with_bias=True)
    (h, h64), (w, w64), (bias, b64), (actions, acts), (mask, m64), _, primals = _head_case(x)
    adv, adv64 = as_jnp(rng.standard_normal(b), jnp.float32)
    c = float(cotangent(rng, ()))

    def loss(h, w, bb):
        return c * jk.linear_policy_gradient_loss(
            h,
            w,
            actions,
            adv,
            mask,
            bias=bb,
            weight_layout=layout,
            loss_agg_mode=mode,
            max_len=6,
            memory="fast",
        )

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*primals)
    d_lp = -c * np.broadcast_to(adv64[:, None], (b, t)) * oracle.aggregate_weights(m64, mode, 6)
    want = oracle.linear_logprobs_vjp(h64, w64, acts, d_lp, None, b64, weight_layout=layout)
    _, want_fast = fast_formula(
        h64,
        w64,
        b64,
        acts,
        d_lp / c,
        np.zeros_like(d_lp),
        layout=layout,
        temperature=1.0,
        ignore=-1,
        dtype=jnp.bfloat16,
        loss_cotangent=c,
    )
    _grads_check(grads, primals, want, want_fast, jnp.bfloat16)


def test_entropy_bonus_and_no_loss_cotangent(rng):
    """PPO with an entropy bonus: the gradient of the entropy metric alone (the loss's
    cotangent a symbolic zero) equals the lean op's."""
    x = make_head(rng, 3, 4, 23, 6, jnp.float32, "dv", with_bias=True)
    (h, _), (w, _), (bias, _), (actions, _), (mask, _), (old, _), primals = _head_case(x)
    adv = jnp.asarray(rng.standard_normal(3), jnp.float32)

    def metric(memory):
        def fn(h, w, bb):
            _, m = jk.linear_ppo_loss(
                h,
                w,
                actions,
                old,
                adv,
                mask,
                bias=bb,
                entropy_coef=0.1,
                weight_layout="dv",
                memory=memory,
            )
            return m["entropy"] + 2.0 * m["ratio_mean"]

        grad = jax.grad(fn, argnums=(0, 1, 2))
        # the lean op (the expected side) jitted: eager, each primitive compiles on its own
        return (grad if memory == "fast" else jax.jit(grad))(*primals)

    for got, want in zip(metric("fast"), metric("lean")):
        assert_close(got, np.asarray(want, np.float64), name="metric gradient")


def test_under_vmap_and_jit(rng):
    """vmap over independent problems (each its own B, T rows) equals a loop."""
    n_prob, b, t, vocab, d = 2, 2, 3, 17, 5
    h = jnp.asarray(rng.standard_normal((n_prob, b, t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((vocab, d)) / np.sqrt(d), jnp.float32)
    acts = jnp.asarray(rng.integers(0, vocab, (n_prob, b, t)), jnp.int32)
    old = jnp.asarray(-np.log(vocab) + 0.2 * rng.standard_normal((n_prob, b, t)), jnp.float32)
    mask = jnp.asarray(np.stack([random_mask(rng, b, t, empty_rows=()) for _ in range(n_prob)]))
    rewards = jnp.asarray(rng.standard_normal((n_prob, b)), jnp.float32)

    def one(h, w, a, o, m, r):
        return jk.linear_grpo_loss(h, w, a, o, r, m, group_size=2, memory="fast")[0]

    def batched(h, w):
        return jnp.sum(jax.vmap(one, in_axes=(0, None, 0, 0, 0, 0))(h, w, acts, old, mask, rewards))

    def looped(h, w):
        return sum(one(h[i], w, acts[i], old[i], mask[i], rewards[i]) for i in range(n_prob))

    got = jax.jit(jax.grad(batched, argnums=(0, 1)))(h, w)
    want = jax.jit(jax.grad(looped, argnums=(0, 1)))(h, w)
    for a, b_ in zip(got, want):
        assert_close(a, np.asarray(b_, np.float64), name="vmap gradient")


def test_all_masked_rows_get_no_gradient(rng):
    x = make_head(rng, 2, 3, 9, 4, jnp.bfloat16, "vd", with_bias=True)
    h, w, bb = x["hidden"][0], x["weight"][0], x["bias"][0]

    def f(h, w, bb):
        return jk.linear_grpo_loss(
            h,
            w,
            x["actions"][0],
            x["old_logp"][0],
            jnp.ones(2),
            jnp.zeros((2, 3)),
            bias=bb,
            group_size=2,
            memory="fast",
        )[0]

    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, bb)
    assert float(loss) == 0.0
    for g in grads:
        assert_zero(g)


def test_explain_says_the_gradient_is_taken_in_the_forward(rng):
    x = make_head(rng, 2, 3, 11, 4, jnp.float32, "vd", with_bias=False)
    args = (
        x["hidden"][0],
        x["weight"][0],
        x["actions"][0],
        x["old_logp"][0],
        jnp.ones(2),
        x["mask"][0],
    )
    text = jk.explain("linear_grpo_loss", *args, group_size=2, memory="fast")
    assert "the loss's gradient taken in the forward" in text, text
    lean = jk.explain("linear_grpo_loss", *args, group_size=2)
    assert "gradient taken in the forward" not in lean, lean


# -- on a GPU: one [N, V] buffer in the head's dtype, and bf16 accuracy -------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_fused_loss_holds_one_buffer_and_matches_float64(layout):
    """bfloat16, the shape of a small model: XLA's temp memory holds one [N, V] bf16 buffer
    (the logits, then their gradient), a row block and, the masked rows skipped where XLA's
    GEMMs run the backward, their copy of the kept rows' gradient ([S, V], S the row count of
    the branch that holds them; none where ffi's ``kept_gemms`` reads the rows in place:
    docs/api.md), less than linear_logprobs' fast mode (the logits and their gradient at
    once); gradients within the fast mode's rule. The old log-probs are the policy's own, so
    every ratio stays inside the clip range (no flips from rounding)."""
    rng = np.random.default_rng(11)
    b, t, vocab, d = 8, 256, 32000, 256  # V a multiple of 8: XLA pads others for its GEMMs
    x = make_head(rng, b, t, vocab, d, jnp.bfloat16, layout, with_bias=False)
    (h, h64), (w, w64), _, (actions, acts), (mask, m64), _, primals = _head_case(x)
    old64 = x["lp_now"]
    old = jnp.asarray(old64, jnp.float32)
    rewards, r64 = as_jnp(rng.standard_normal(b), jnp.float32)

    def loss(h, w, memory):
        return jk.linear_grpo_loss(
            h, w, actions, old, rewards, mask, group_size=4, weight_layout=layout, memory=memory
        )[0]

    def temp(fn):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(h, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    kept = b * t * vocab * 2
    fused = temp(lambda h, w: loss(h, w, "fast"))
    saved = temp(
        lambda h, w: jnp.sum(jk.linear_logprobs(h, w, actions, weight_layout=layout, memory="fast"))
    )
    kept_rows = int(np.sum(np.asarray(mask) != 0))
    branch_rows = min(s for s in row_skip.bucket_sizes(b * t) if s >= kept_rows)
    in_place = "kept_gemms: ffi" in jk.explain(
        "linear_grpo_loss",
        h,
        w,
        actions,
        old,
        rewards,
        mask,
        group_size=4,
        weight_layout=layout,
        memory="fast",
    )
    copy = branch_rows * vocab * 2 if branch_rows < b * t and not in_place else 0
    # one [N, V] buffer, the branch's copy of its rows, at most one row block's float32 work
    assert kept <= fused <= kept + copy + fused_loss.ROW_BLOCK_BYTES, (fused, kept, copy)
    assert fused < saved, (fused, saved)
    grads = jax.jit(jax.grad(lambda h, w: loss(h, w, "fast"), argnums=(0, 1)))(h, w)
    outs, w_vjp, _ = oracle.linear_grpo_loss(
        h64, w64, acts, old64, r64, m64, group_size=4, weight_layout=layout
    )
    d_lp = _grpo_logp_cotangent(h64, w64, acts, old64, r64, m64, layout)
    _, want_fast = fast_formula(
        h64,
        w64,
        None,
        acts,
        d_lp,
        np.zeros_like(d_lp),
        layout=layout,
        temperature=1.0,
        ignore=-1,
        dtype=jnp.bfloat16,
    )
    _grads_check(grads, primals, w_vjp(1.0, 0.0, 0.0), want_fast, jnp.bfloat16)


def _grpo_logp_cotangent(h64, w64, acts, old64, r64, m64, layout):
    """∂ loss / ∂ logp of the GPU test's GRPO loss in float64 (ratios inside the clip range:
    −A·ratio / count per token, token-mean aggregation)."""
    lp, _ = oracle.linear_logprobs(h64, w64, acts, weight_layout=layout)
    adv = oracle.group_advantages(r64, group_size=4)
    ratio = np.exp(lp - old64)
    return -adv[:, None] * ratio * oracle.aggregate_weights(m64, "token_mean")
