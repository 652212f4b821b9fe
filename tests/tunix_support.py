"""Tiny random tunix models, train examples and comparisons for the tunix integration tests.

Shared by tests/test_tunix.py and the 8-device script tests/tunix_sharded.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.gemma3 import model as gemma3
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common, function_registry
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

import jaxrl_kernels.integrations.tunix  # noqa: F401  (registers jaxrl_grpo / jaxrl_ppo)

PAD_ID, EOS_ID = 0, 1
RTOL = 1e-5  # float32: |got - want| <= RTOL * scale (docs/api.md "Numerics")


def model_config(family: str, vocab: int, dim: int = 16, heads: int = 2, kv_heads: int = 1):
    """A float32 tunix config of the family: "qwen3" (lm_head [D, V]), "qwen3_tied", "gemma3"."""
    if family in ("qwen3", "qwen3_tied"):
        return qwen3.ModelConfig(
            num_layers=1, vocab_size=vocab, embed_dim=dim, hidden_dim=24, num_heads=heads,
            head_dim=8, num_kv_heads=kv_heads, rope_theta=10_000, norm_eps=1e-6,
            use_tied_embedding=family == "qwen3_tied")
    if family == "gemma3":
        return gemma3.ModelConfig(
            num_layers=1, num_embed=vocab, embed_dim=dim, hidden_dim=24, num_heads=heads,
            head_dim=8, num_kv_heads=kv_heads, sliding_window_size=4, param_dtype=jnp.float32)
    raise ValueError(f"unknown family {family!r}")


MODEL_CLASSES = {"qwen3": qwen3.Qwen3, "qwen3_tied": qwen3.Qwen3, "gemma3": gemma3.Gemma3}


def make_model(family: str, vocab: int, seed: int = 0, **dims):
    """A tunix model with every parameter moved off its init (zero-init weights included)."""
    model = MODEL_CLASSES[family](model_config(family, vocab, **dims), rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed + 1)
    state = jax.tree.map(
        lambda x: x + jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), state)
    return nnx.merge(graphdef, state)


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    batch: int = 4
    prompt_len: int = 5
    completion_len: int = 7
    old: bool = True            # old_per_token_logps given (else None)
    ref: bool = True            # ref_per_token_logps given
    sampler_is: bool = False    # sampler_is_weights given
    token_advantages: bool = False  # advantages [B, T] (PPO's GAE) instead of [B]
    packed: bool = False        # sequence packing: segment_ids / segment_positions, empty prompt


def current_logprobs(model, prompt, completion, temperature=1.0, segment_ids=None,
                     segment_positions=None):
    """tunix's own per-token log-probs of the completion under ``model`` (no gradient)."""
    graphdef, state = nnx.split(model)
    return common.compute_per_token_logps(
        graphdef, state, prompt, completion, PAD_ID, EOS_ID, segment_ids=segment_ids,
        segment_positions=segment_positions, temperature=temperature)


def make_example(model, vocab: int, spec: ExampleSpec, seed: int = 0, temperature: float = 1.0,
                 ppo: bool = False):
    """A TrainExample: left-padded prompts, completions of random length (row 1 empty) padded
    with PAD_ID, old/ref log-probs near the current policy's, random sampler IS weights."""
    rng = np.random.default_rng(seed)
    b, p, c = spec.batch, spec.prompt_len, spec.completion_len
    lengths = rng.integers(1, c + 1, size=b)
    lengths[1] = 0
    lengths[-1] = c
    mask = (np.arange(c)[None, :] < lengths[:, None]).astype(np.int32)
    completion = np.where(mask == 1, rng.integers(2, vocab, size=(b, c)), PAD_ID)
    if spec.packed:
        prompt = np.zeros((b, 0), np.int32)
        completion = rng.integers(2, vocab, size=(b, c))
        half = c // 2
        segment_ids = np.where(np.arange(c) < half, 1, 2)[None, :].repeat(b, 0)
        segment_positions = np.where(np.arange(c) < half, np.arange(c), np.arange(c) - half)
        segment_positions = segment_positions[None, :].repeat(b, 0)
        mask = (rng.random((b, c)) < 0.8).astype(np.int32)
        mask[:, 0] = 0
        mask[1] = 0
        packing = dict(segment_ids=jnp.asarray(segment_ids, jnp.int32),
                       segment_positions=jnp.asarray(segment_positions, jnp.int32))
    else:
        prompt_lens = rng.integers(1, p + 1, size=b)
        prompt = np.where(np.arange(p)[None, :] >= p - prompt_lens[:, None],
                          rng.integers(2, vocab, size=(b, p)), PAD_ID)
        packing = {}
    prompt = jnp.asarray(prompt, jnp.int32)
    completion = jnp.asarray(completion, jnp.int32)
    now = np.asarray(current_logprobs(model, prompt, completion, temperature, **packing))
    shape = now.shape
    advantages = rng.standard_normal(shape if spec.token_advantages else (b,))
    fields = dict(
        prompt_ids=prompt, prompt_mask=(prompt != PAD_ID).astype(jnp.int32),
        completion_ids=completion, completion_mask=jnp.asarray(mask, jnp.int32),
        advantages=jnp.asarray(advantages, jnp.float32),
        old_per_token_logps=(jnp.asarray(now + 0.5 * rng.standard_normal(shape), jnp.float32)
                             if spec.old else None),
        ref_per_token_logps=(jnp.asarray(now + 0.5 * rng.standard_normal(shape), jnp.float32)
                             if spec.ref else None),
        sampler_is_weights=(jnp.asarray(rng.uniform(0.2, 1.5, shape), jnp.float32)
                            if spec.sampler_is else None),
        **packing)
    if ppo:
        return ppo_learner.TrainExample(**fields)
    return grpo_learner.TrainExample(**fields)


def grpo_config(temperature=1.0, **options):
    """A GRPOConfig with the attributes tunix's GRPO learner adds (temperature, epsilon_c...)."""
    extra = {k: options.pop(k) for k in ("epsilon_high", "epsilon_c") if k in options}
    config = grpo_learner.GRPOConfig(num_generations=2, **options)
    config.temperature = temperature  # GRPOLearner copies the rollout temperature here
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def ppo_config(**options):
    return ppo_learner.PPOConfig(**options)


def loss_and_grads(loss_name: str, model, example, algo_config, **loss_kwargs):
    """(loss, aux, grads) of a registered policy loss: jitted value_and_grad over the params."""
    loss_fn = function_registry.get_policy_loss_fn(loss_name)
    graphdef, state = nnx.split(model)

    def objective(state, example):
        return loss_fn(nnx.merge(graphdef, state), example, algo_config, PAD_ID, EOS_ID,
                       **loss_kwargs)

    (loss, aux), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state, example)
    return loss, aux, grads


def _close(name, got, want, scale):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), f"{name}: {got} vs {want}"
    assert np.array_equal(got[~finite], want[~finite]), f"{name}: {got} vs {want}"
    err = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    assert err <= RTOL * scale, f"{name}: |got - want| = {err:.3g} > {RTOL} * {scale:.3g}"


def assert_same(got, want):
    """Loss, every aux key and every parameter's gradient of ``got`` equal ``want``'s.

    Scalars are held to 1e-5 of max(|want|, 1); each gradient tensor to 1e-5 of its largest
    magnitude.
    """
    (loss, aux, grads), (want_loss, want_aux, want_grads) = got, want
    _close("loss", loss, want_loss, max(abs(float(want_loss)), 1.0))
    assert sorted(aux) == sorted(want_aux)
    for key, value in want_aux.items():
        finite = np.isfinite(float(value))
        _close(f"aux[{key!r}]", aux[key], value, max(abs(float(value)) if finite else 0.0, 1.0))
    paths = jax.tree_util.tree_leaves_with_path(want_grads)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for (path, want_g), g in zip(paths, jax.tree.leaves(grads)):
        scale = float(np.max(np.abs(np.asarray(want_g))))
        assert scale > 0, f"grad{jax.tree_util.keystr(path)} is all zero: a vacuous comparison"
        _close(f"grad{jax.tree_util.keystr(path)}", g, want_g, scale)
