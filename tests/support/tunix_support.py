"""Tiny random tunix models, train examples and comparisons for the tunix integration tests.

Shared by tests/integrations/test_tunix.py and the 8-device script tests/support/tunix_sharded.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.gemma3 import model as gemma3
from tunix.models.qwen3 import model as qwen3
from tunix.rl import common, function_registry
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

import jaxrl_kernels as jk
import jaxrl_kernels.integrations.tunix  # noqa: F401  (registers jaxrl_grpo / jaxrl_ppo)
from jaxrl_kernels.integrations.tunix import losses as tunix_losses

PAD_ID, EOS_ID = 0, 1
RTOL = 1e-5  # float32: |got - want| <= RTOL * scale (docs/api.md "Numerics")


def model_config(
    family: str, vocab: int, dim: int = 16, heads: int = 2, kv_heads: int = 1, **options
):
    """A float32 tunix config of the family: "qwen3" (lm_head [D, V]), "qwen3_tied", "gemma3".
    ``options``: further Qwen3 ModelConfig fields (shd_config...)."""
    if family in ("qwen3", "qwen3_tied"):
        return qwen3.ModelConfig(
            num_layers=1,
            vocab_size=vocab,
            embed_dim=dim,
            hidden_dim=24,
            num_heads=heads,
            head_dim=8,
            num_kv_heads=kv_heads,
            rope_theta=10_000,
            norm_eps=1e-6,
            use_tied_embedding=family == "qwen3_tied",
            **options,
        )
    if family == "gemma3":
        return gemma3.ModelConfig(
            num_layers=1,
            num_embed=vocab,
            embed_dim=dim,
            hidden_dim=24,
            num_heads=heads,
            head_dim=8,
            num_kv_heads=kv_heads,
            sliding_window_size=4,
            param_dtype=jnp.float32,
        )
    raise ValueError(f"unknown family {family!r}")


MODEL_CLASSES = {"qwen3": qwen3.Qwen3, "qwen3_tied": qwen3.Qwen3, "gemma3": gemma3.Gemma3}


def make_model(family: str, vocab: int, seed: int = 0, **dims):
    """A tunix model with every parameter moved off its init (zero-init weights included)."""
    model = MODEL_CLASSES[family](model_config(family, vocab, **dims), rngs=nnx.Rngs(seed))
    return _perturbed(model, seed)


def _perturbed(model, seed):
    """Every parameter + 0.2 N(0, 1): tunix's Qwen3 initialises its MLP weights to zero."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed + 1)
    state = jax.tree.map(
        lambda x: x + jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), state
    )
    return nnx.merge(graphdef, state)


@dataclasses.dataclass(frozen=True)
class ExampleSpec:
    batch: int = 4
    prompt_len: int = 5
    completion_len: int = 7
    old: bool = True  # old_per_token_logps given (else None)
    ref: bool = True  # ref_per_token_logps given
    sampler_is: bool = False  # sampler_is_weights given
    token_advantages: bool = False  # advantages [B, T] (PPO's GAE) instead of [B]
    packed: bool = False  # sequence packing: segment_ids / segment_positions, empty prompt


def current_logprobs(
    model, prompt, completion, temperature=1.0, segment_ids=None, segment_positions=None
):
    """tunix's own per-token log-probs of the completion under ``model`` (no gradient)."""
    graphdef, state = nnx.split(model)
    return common.compute_per_token_logps(
        graphdef,
        state,
        prompt,
        completion,
        PAD_ID,
        EOS_ID,
        segment_ids=segment_ids,
        segment_positions=segment_positions,
        temperature=temperature,
    )


def make_example(
    model, vocab: int, spec: ExampleSpec, seed: int = 0, temperature: float = 1.0, ppo: bool = False
):
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
        packing = dict(
            segment_ids=jnp.asarray(segment_ids, jnp.int32),
            segment_positions=jnp.asarray(segment_positions, jnp.int32),
        )
    else:
        prompt_lens = rng.integers(1, p + 1, size=b)
        prompt = np.where(
            np.arange(p)[None, :] >= p - prompt_lens[:, None],
            rng.integers(2, vocab, size=(b, p)),
            PAD_ID,
        )
        packing = {}
    prompt = jnp.asarray(prompt, jnp.int32)
    completion = jnp.asarray(completion, jnp.int32)
    now = np.asarray(current_logprobs(model, prompt, completion, temperature, **packing))
    shape = now.shape
    advantages = rng.standard_normal(shape if spec.token_advantages else (b,))
    fields = dict(
        prompt_ids=prompt,
        prompt_mask=(prompt != PAD_ID).astype(jnp.int32),
        completion_ids=completion,
        completion_mask=jnp.asarray(mask, jnp.int32),
        advantages=jnp.asarray(advantages, jnp.float32),
        old_per_token_logps=(
            jnp.asarray(now + 0.5 * rng.standard_normal(shape), jnp.float32) if spec.old else None
        ),
        ref_per_token_logps=(
            jnp.asarray(now + 0.5 * rng.standard_normal(shape), jnp.float32) if spec.ref else None
        ),
        sampler_is_weights=(
            jnp.asarray(rng.uniform(0.2, 1.5, shape), jnp.float32) if spec.sampler_is else None
        ),
        **packing,
    )
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
        return loss_fn(
            nnx.merge(graphdef, state), example, algo_config, PAD_ID, EOS_ID, **loss_kwargs
        )

    (loss, aux), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(state, example)
    return loss, aux, grads


# -- sampler matching: an oracle from tunix's own logits ----------------------------------------
#
# The processed log-probs computed the long way: tunix's compute_per_token_logps returns the
# completion's [B, C, V] logits (temperature 1: the raw logits), and jk.token_logprobs on the
# "reference" backend (the logits in memory, checked against NumPy by the op tests) takes the
# log-probs (and entropy) of softmax(z / T) truncated by the settings' top-k / top-p. The loss
# on them is the registered loss's own formula (LossTerms.loss_of_logprobs, which
# tests/integrations/test_tunix.py holds to tunix's loss): what the oracle checks is the route of
# the log-probs (hidden states, head, targets, temperature, truncation, gradients), not the formula.


def tunix_logits(graphdef, state, prompt, completion, stop_gradient=True):
    """tunix's own float32 [B, C, V] logits of the completion positions (unpacked)."""
    _, logits = common.compute_per_token_logps(
        graphdef,
        state,
        prompt,
        completion,
        PAD_ID,
        EOS_ID,
        stop_gradient=stop_gradient,
        return_logits=True,
        temperature=1.0,
    )
    return logits


def processed_logprobs(logits, targets, sampler, **options):
    """jk.token_logprobs of the sampler's truncated distribution ("reference" backend)."""
    return jk.token_logprobs(
        logits,
        targets,
        temperature=sampler.temperature,
        backend="reference",
        sampler=sampler.sampler,
        **options,
    )


def processed_oracle_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """The registered loss (GRPO or PPO by the config's type) on the oracle's processed
    log-probs of ``kwargs["sampler"]``, with the same ``aux`` (``outside_kept_set`` too)."""
    assert getattr(train_example, "segment_ids", None) is None, "unpacked examples only"
    sampler = kwargs["sampler"]
    terms_of = (
        tunix_losses.ppo_loss_terms
        if isinstance(algo_config, ppo_learner.PPOConfig)
        else tunix_losses.grpo_loss_terms
    )
    terms = terms_of(train_example, algo_config, sampler)
    graphdef, state = nnx.split(model)
    logits = tunix_logits(
        graphdef, state, train_example.prompt_ids, train_example.completion_ids, stop_gradient=False
    )
    logp, entropy, kept = processed_logprobs(
        logits, train_example.completion_ids, sampler, return_entropy=True, return_kept=True
    )
    loss, aux = terms.loss_of_logprobs(logp, entropy if terms.with_entropy else None, terms.inputs)
    if sampler.truncation is not None:
        outside = (train_example.completion_mask != 0) & ~kept
        aux = {
            **aux,
            "outside_kept_set": jax.lax.stop_gradient(jnp.sum(outside.astype(jnp.float32))),
        }
    return loss, aux


def processed_oracle_name(sampler):
    """A registered policy loss: :func:`processed_oracle_loss` with ``sampler`` (tunix's
    learners pass their loss no keywords)."""
    name = f"test_processed_oracle[{sampler}]"

    def loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
        return processed_oracle_loss(
            model, train_example, algo_config, pad_id, eos_id, sampler=sampler
        )

    function_registry.register_policy_loss_fn(name)(loss)
    return name


def processed_loss_and_grads(model, example, algo_config, sampler):
    """(loss, aux, grads) of :func:`processed_oracle_loss`, as :func:`loss_and_grads`."""
    return loss_and_grads(processed_oracle_name(sampler), model, example, algo_config)


class OracleLogprobs:
    """The processed reference and old-policy passes of an RLCluster, the long way (tunix's
    logits, then :func:`processed_logprobs`), patched onto the cluster as
    ``use_kernel_logprobs`` patches its own. ``gains`` records, per pass, the mean over the
    completion's tokens of processed − untruncated log-prob (lse − lse of the kept set: >= 0,
    > 0 where the truncation removed mass)."""

    def __init__(self, cluster, sampler):
        self.sampler = sampler
        self.gains = {"reference": [], "rollout": []}
        worker, rollout = cluster.inference_worker, cluster.rollout

        def reference(prompt, completion, pad_id, eos_id, temperature=1.0):
            assert temperature == sampler.temperature  # the cluster passes the rollout's
            return self._pass("reference", *worker._model_states["reference"], prompt, completion)

        def old_policy(prompt, completion):
            return self._pass(
                "rollout", *rollout._sampler.model_def_and_state(), prompt, completion
            )

        worker.get_ref_per_token_logps = reference
        rollout.get_per_token_logps = old_policy

    def _pass(self, role, graphdef, state, prompt, completion):
        logits = tunix_logits(graphdef, state, prompt, completion)
        logp = processed_logprobs(logits, completion, self.sampler)
        full = jk.token_logprobs(
            logits, completion, temperature=self.sampler.temperature, backend="reference"
        )
        tokens = np.asarray(completion) != PAD_ID
        self.gains[role].append(float(np.mean(np.asarray(logp - full)[tokens])))
        return logp


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


# -- tunix's own learners: an RLCluster on a 2-device FSDP mesh --------------------------------

LEARNER_VOCAB = 64
LEARNER_BOS_ID = 2
LEARNER_LR = 3e-3
# An AdamW step moves a parameter by lr * m / (sqrt(v) + eps), so gradients that differ by d
# move it by up to lr * d / eps. The two runs' float32 gradients differ by rounding, ~2e-7 at
# most here (their summation order follows the sharding layout); with optax's eps = 1e-8 that
# can move a near-zero entry's parameter by a visible fraction of lr (it did: 3e-5 on one
# lm_head entry), with 1e-3 by at most 4 steps * lr * 2e-7 / 1e-3 ~ 2.4e-6, inside the 1e-5
# comparison of the final parameters.
LEARNER_ADAM_EPS = 1e-3


class WordTokenizer:
    """Token i is the word "w<i>": the least a tunix TokenizerAdapter needs."""

    def encode(self, text, **kwargs):
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(f"w{int(i)}" for i in ids)

    def bos_id(self):
        return LEARNER_BOS_ID

    def eos_id(self):
        return EOS_ID

    def pad_id(self):
        return PAD_ID


def word_reward(prompts, completions, **kwargs):
    """A deterministic reward that varies between completions: distinct words minus length / 4
    plus 2 per "w7"."""
    return [
        len(set(c.split())) - len(c.split()) / 4 + 2.0 * c.split().count("w7") for c in completions
    ]


PROMPTS = [
    "w5 w9 w11",
    "w12 w8",
    "w4 w4 w30",
    "w13 w20 w21 w3",
    "w40 w41",
    "w50 w9 w6",
    "w33",
    "w17 w18 w19",
]


def learner_mesh():
    """(fsdp=2, tp=1) over two host devices, Auto axes as tunix builds its meshes."""
    return jax.make_mesh(
        (2, 1),
        ("fsdp", "tp"),
        devices=jax.devices()[:2],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def fsdp_sharding_config():
    """Qwen3's default ShardingConfig with the parameter specs written as XLA writes them back
    on the (fsdp=2, tp=1) mesh: the size-1 "tp" axis and trailing Nones dropped. With tunix's
    default specs (P('tp') for a norm scale...) the first train step returns the parameters
    (and AdamW's moments) under equivalent but differently written specs, and the next step
    and the sampler, which jit-cache on the spec, compile a second time, whatever the loss.
    Written this way, an unchanged sharding means one compiled train step and one sampler."""
    default = qwen3.ShardingConfig.get_default_sharding()

    def tidy(spec):
        spec = [None if entry == "tp" else entry for entry in spec]
        while spec and spec[-1] is None:
            spec.pop()
        return tuple(spec)

    weights = (
        "emb_vd",
        "emb_dv",
        "q_weight_dnh",
        "kv_weight_dnh",
        "o_weight_nhd",
        "ffw_weight_df",
        "ffw_weight_fd",
        "rms_norm_weight",
        "exp_weight_edf",
        "exp_weight_efd",
    )
    return dataclasses.replace(default, **{name: tidy(getattr(default, name)) for name in weights})


@functools.cache
def _learner_template(seed: int):
    model = MODEL_CLASSES["qwen3"](
        model_config("qwen3", LEARNER_VOCAB, shd_config=fsdp_sharding_config()), rngs=nnx.Rngs(seed)
    )
    graphdef, state = nnx.split(_perturbed(model, seed))
    return graphdef, jax.tree.map(np.asarray, state)


def learner_model(seed: int = 0):
    """A fresh float32 one-layer Qwen3 (lm_head [D, V]) with every parameter moved off its init
    (tunix zero-initialises the MLP, whose gradients would otherwise all be zero), sharded as
    :func:`fsdp_sharding_config` says once on the mesh. The same numbers for the same seed."""
    graphdef, state = _learner_template(seed)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))


def param_shardings(model):
    return {
        jax.tree_util.keystr(path): leaf.sharding
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }


@dataclasses.dataclass
class LearnerRun:
    metrics: dict  # "prefix/mode/name" -> list of logged values
    params: dict  # "path" -> final value (numpy)
    shardings_start: dict  # "path" -> sharding of the actor's parameter once tunix placed it
    shardings_end: dict  # ... after training
    compiles: dict  # jitted function -> number of compiled programs
    kernel_logprobs: Any = None


def _cache_size(fn):
    fn = getattr(fn, "func", fn)  # functools.partial of nnx.jit
    fn = getattr(fn, "jitted_fn", fn)
    return fn._cache_size() if hasattr(fn, "_cache_size") else None


def run_learner(
    algo: str,
    loss: str,
    *,
    kernel_logprobs: bool,
    packed: bool = False,
    global_steps: int = 2,
    per_step: int = 2,
    micro_batch: int = 1,
    backend: str | None = None,
    top_k: int | None = None,
    top_p: float = 1.0,
    sampler_matched: bool = False,
) -> LearnerRun:
    """tunix's GRPOLearner / PPOLearner trained for ``global_steps`` batches of ``per_step``
    prompts.

    Actor, reference (and PPO's critic) on the fsdp=2 mesh, vanilla rollout (seeded),
    mini-batch ``per_step`` prompts in micro-batches of ``micro_batch`` prompts (gradient
    accumulation ``per_step / micro_batch``; tunix splits a micro-batch's rows over "fsdp" only
    when their number divides it), num_iterations 2, beta 0.04 (so a reference pass; PPO puts
    the KL in the reward), AdamW (eps :data:`LEARNER_ADAM_EPS`); PPO with an entropy bonus
    (entropy_coef 0.01) and dual clip (epsilon_c 3). ``kernel_logprobs``: serve the reference
    and rollout log-probs with :func:`use_kernel_logprobs`. ``packed``: tunix's sequence packing
    (``max_seq_token_per_tpu``) of the training micro-batches. ``top_k`` / ``top_p``: the
    rollout config's (temperature 0.9). ``sampler_matched``: sampler-matched log-probs:
    with ``kernel_logprobs``, ``use_kernel_logprobs(..., sampler_matched=True,
    algo_config=config)`` (``loss`` one of ours); without, the oracle's
    (:class:`OracleLogprobs` for both passes, :func:`processed_oracle_loss` whatever
    ``loss`` says); ``LearnerRun.kernel_logprobs`` is then the :class:`OracleLogprobs`.
    """
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl import utils as rl_utils
    from tunix.rl.rollout import base_rollout

    from jaxrl_kernels.integrations import tunix as jaxrl_tunix

    mesh = learner_mesh()
    roles = [rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT]
    actor, reference = learner_model(seed=7), learner_model(seed=7)
    critic = None
    if algo == "ppo":
        roles.append(rl_cluster_lib.Role.CRITIC)
        critic = rl_utils.create_critic_model(learner_model(seed=7), seed=1)
    prompt_len, completion_len = 8, 6
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(LEARNER_LR, eps=LEARNER_ADAM_EPS),
        critic_optimizer=optax.adamw(LEARNER_LR, eps=LEARNER_ADAM_EPS),
        eval_every_n_steps=10**6,
        max_steps=4 * global_steps,
        mini_batch_size=per_step,
        train_micro_batch_size=micro_batch,
        max_seq_token_per_tpu=4 * (prompt_len + completion_len) if packed else None,
    )
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=completion_len,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + completion_len + 2,
        temperature=0.9,
        top_p=top_p,
        top_k=top_k,
        seed=0,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        critic=critic,
        tokenizer=WordTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in roles},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )
    start = param_shardings(cluster.actor_trainer.model)
    if algo == "grpo":
        config = grpo_learner.GRPOConfig(
            num_generations=2,
            num_iterations=2,
            beta=0.04,
            loss_agg_mode="sequence-mean-token-mean",
            epsilon=0.1,
            policy_loss_fn=loss,
        )
    else:
        config = ppo_learner.PPOConfig(
            num_iterations=2,
            beta=0.04,
            epsilon=0.1,
            entropy_coef=0.01,
            epsilon_c=3.0,
            policy_loss_fn=loss,
        )
    handle = None
    if kernel_logprobs:
        handle = jaxrl_tunix.use_kernel_logprobs(
            cluster,
            backend=backend,
            sampler_matched=sampler_matched,
            algo_config=config if sampler_matched else None,
        )
    elif sampler_matched:
        sampler = jaxrl_tunix.sampler_settings(cluster)
        config.policy_loss_fn = processed_oracle_name(sampler)
        handle = OracleLogprobs(cluster, sampler)
    if algo == "grpo":
        learner = grpo_learner.GRPOLearner(cluster, config, reward_fns=[word_reward])
    else:
        learner = ppo_learner.PPOLearner(cluster, config, reward_fns=[word_reward])
    batches = [{"prompts": PROMPTS[per_step * i : per_step * (i + 1)]} for i in range(global_steps)]
    learner.train(batches)
    model = cluster.actor_trainer.model
    sampler = cluster.rollout._sampler
    compiles = {
        "actor train step": _cache_size(cluster.actor_trainer._jitted_train_step_fn),
        "sampler prefill": _cache_size(sampler._compiled_prefill_fn),
        "sampler decode": _cache_size(sampler._compiled_decode_fn),
    }
    metrics = {
        f"{prefix}/{mode}/{name}": list(values)
        for prefix, modes in cluster._rl_metrics_logger._metrics.items()
        for mode, names in modes.items()
        for name, values in names.items()
    }
    params = {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    if kernel_logprobs:
        handle.restore()
        assert config.policy_loss_fn == loss  # restore() set it back
    return LearnerRun(metrics, params, start, param_shardings(model), compiles, handle)


def assert_same_run(got: LearnerRun, want: LearnerRun):
    """Every metric tunix logged (each logged value to 1e-5 of max(|want|, 1)) and every final
    parameter (1e-5 of the tensor's largest magnitude) equal; every actor parameter placed as
    tunix's run placed it, at the start and after training; as many compiled programs of the
    train step and the sampler (which jit-cache on the parameters' shardings) as tunix's run."""
    assert sorted(got.metrics) == sorted(want.metrics)
    for name, values in want.metrics.items():
        assert len(got.metrics[name]) == len(values), name
        for i, (g, w) in enumerate(zip(got.metrics[name], values)):
            w = np.asarray(w, np.float64)
            _close(f"{name}[{i}]", g, w, max(float(np.max(np.abs(w), initial=0.0)), 1.0))
    assert sorted(got.params) == sorted(want.params)
    for name, w in want.params.items():
        _close(f"param {name}", got.params[name], w, float(np.max(np.abs(w))))
    assert_same_shardings(got, want)
    assert got.compiles == want.compiles, (got.compiles, want.compiles)


def assert_same_shardings(got: LearnerRun, want: LearnerRun):
    """Parameter by parameter, the actor's sharding (mesh and PartitionSpec) equals that of
    ``want``'s, as tunix placed it and after training."""
    for when, got_shardings, want_shardings in (
        ("start", got.shardings_start, want.shardings_start),
        ("end", got.shardings_end, want.shardings_end),
    ):
        assert sorted(got_shardings) == sorted(want_shardings)
        for name, want_sharding in want_shardings.items():
            assert got_shardings[name] == want_sharding, (
                f"{name} at the {when}: {got_shardings[name].spec} where tunix's loss gives "
                f"{want_sharding.spec}"
            )


def moved_shardings(run: LearnerRun) -> dict:
    """{parameter: (spec as placed, spec after training)} for every actor parameter whose final
    sharding is not equivalent to the one tunix placed it with (a mesh axis of size 1 may be
    dropped from a spec, as XLA writes it)."""
    return {
        name: (start.spec, run.shardings_end[name].spec)
        for name, start in run.shardings_start.items()
        if not run.shardings_end[name].is_equivalent_to(start, run.params[name].ndim)
    }
