"""The tunix integration: "jaxrl_grpo" / "jaxrl_ppo" against tunix's own "grpo" / "ppo".

On tiny random float32 tunix models (Qwen3 with an lm_head [D, V], Qwen3 with tied
embeddings, Gemma3), the same TrainExample through both losses gives the same loss, the same
value of every aux key and the same gradient of every parameter (1e-5 of scale), over the
options tunix's losses read, on one device and on a (fsdp=2, tp=4) mesh; the compiled programs
of our loss and of our log-prob pass hold no [B, T, V] buffer; unsupported models and options
raise one clear error. tests/integrations/test_tunix_learners.py runs them inside tunix's own
learners.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("tunix", reason="the tunix extra is not installed (pip install -e .[tunix])")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxrl_kernels as jk  # noqa: E402
from jaxrl_kernels.integrations import tunix as jt  # noqa: E402
from tests.support import tunix_support as ts  # noqa: E402

VOCAB = 61  # odd, so a [D, V] weight and a [V, D] table are told apart by shape


@pytest.fixture(scope="module")
def models():
    return {
        family: ts.make_model(family, VOCAB, seed=i)
        for i, family in enumerate(("qwen3", "qwen3_tied", "gemma3"))
    }


def compare(model, example, config, tunix_name, ours_name, **ours_kwargs):
    want = ts.loss_and_grads(tunix_name, model, example, config)
    got = ts.loss_and_grads(ours_name, model, example, config, **ours_kwargs)
    ts.assert_same(got, want)
    return got


# Each GRPO case sets one aggregation mode and spreads the other options over the cases:
# loss_algo, epsilon / epsilon_high, dual clip, beta (0, > 0, None), every KL mode and a clamp,
# temperature (1, 0 = "none" in tunix, others), sampler IS weights, old log-probs None,
# advantages [B] and [B, T], packed sequences. Every example has an empty completion row.
GRPO_CASES = {
    "token-mean": (dict(loss_algo="grpo", beta=0.04, kl_loss_mode="kl"), 1.0, ts.ExampleSpec()),
    "sequence-mean-token-mean": (
        dict(loss_algo="gspo-token", beta=0.0, epsilon_high=0.28, kl_loss_mode="low_var_kl"),
        0.7,
        ts.ExampleSpec(old=False, sampler_is=True),
    ),
    "sequence-mean-token-scale": (
        dict(
            loss_algo="grpo", beta=0.04, epsilon_c=3.0, kl_loss_mode="mse_kl", kl_clamp_value=0.05
        ),
        0.0,
        ts.ExampleSpec(sampler_is=True, token_advantages=True),
    ),
    "seq-mean-token-sum": (
        dict(loss_algo="gspo-token", beta=None, epsilon=0.1, epsilon_high=0.3, epsilon_c=2.0),
        1.3,
        ts.ExampleSpec(ref=False),
    ),
    "sequence-mean-token-sum-norm": (
        dict(loss_algo="grpo", beta=0.1, kl_loss_mode="low_var_kl", kl_clamp_value=0.2),
        1.0,
        ts.ExampleSpec(old=False, sampler_is=True),
    ),
}


@pytest.mark.parametrize("mode", list(GRPO_CASES))
def test_grpo_options_match_tunix(models, mode):
    options, temperature, spec = GRPO_CASES[mode]
    model = models["qwen3"]
    config = ts.grpo_config(temperature, loss_agg_mode=mode, **options)
    example = ts.make_example(model, VOCAB, spec, seed=len(mode), temperature=temperature)
    _, aux, _ = compare(model, example, config, "grpo", "jaxrl_grpo")
    if spec.old:  # old log-probs away from the policy's: both surrogate branches are taken
        assert float(aux["pg_clipfrac"]) > 0
    else:  # old = stop_gradient(logp): every ratio is 1
        assert float(aux["is_ratio/max"]) == float(aux["is_ratio/min"]) == 1.0


def test_grpo_packed_sequences_match_tunix(models):
    model = models["qwen3"]
    config = ts.grpo_config(1.0, loss_agg_mode="token-mean", beta=0.04)
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(packed=True, completion_len=9))
    compare(model, example, config, "grpo", "jaxrl_grpo")


PPO_CASES = {
    "plain": dict(),
    "entropy_dual_clip": dict(entropy_coef=0.01, epsilon_c=3.0, epsilon_low=0.1, epsilon_high=0.3),
}


@pytest.mark.parametrize("case", list(PPO_CASES))
def test_ppo_options_match_tunix(models, case):
    model = models["qwen3"]
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=3, ppo=True)
    _, aux, _ = compare(model, example, ts.ppo_config(**PPO_CASES[case]), "ppo", "jaxrl_ppo")
    assert ("loss/entropy" in aux) == (case == "entropy_dual_clip")


class KLConfig:
    """A PPO config with the optional attributes tunix's PPO loss reads with getattr."""

    def __init__(self):
        self.epsilon_low, self.epsilon_high, self.epsilon_c = 0.2, 0.2, None
        self.entropy_coef, self.kl_coef, self.kl_clamp_value = None, 0.1, 0.3


def test_ppo_kl_coef_matches_tunix(models):
    model = models["qwen3"]
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=4, ppo=True)
    _, aux, _ = compare(model, example, KLConfig(), "ppo", "jaxrl_ppo")
    assert "kl" in aux


@pytest.mark.parametrize("family,lean", [("qwen3_tied", "reference"), ("gemma3", "chunked")])
def test_model_families_match_tunix(models, family, lean):
    """Tied-embedding heads ([V, D]), one family per CPU backend: GRPO, and PPO with entropy."""
    model = models[family]
    grpo = ts.grpo_config(
        0.7,
        loss_agg_mode="sequence-mean-token-mean",
        beta=0.04,
        kl_loss_mode="low_var_kl",
        epsilon_c=3.0,
    )
    example = ts.make_example(
        model, VOCAB, ts.ExampleSpec(sampler_is=True), seed=5, temperature=0.7
    )
    compare(model, example, grpo, "grpo", "jaxrl_grpo", backend=lean)
    ppo_example = ts.make_example(
        model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=6, ppo=True
    )
    compare(model, ppo_example, ts.ppo_config(entropy_coef=0.05), "ppo", "jaxrl_ppo", backend=lean)


@pytest.mark.parametrize("case", ["grpo-gspo", "grpo-packed", "ppo-entropy"])
def test_fast_memory_matches_tunix(models, case):
    """memory="fast" (the loss's gradient taken in the forward, jaxrl_kernels.engine.fused_loss):
    loss, every aux value and every parameter's gradient equal tunix's own loss."""
    model = models["qwen3"]
    if case == "grpo-gspo":
        options, temperature, spec = GRPO_CASES["sequence-mean-token-mean"]
        config = ts.grpo_config(temperature, loss_agg_mode="sequence-mean-token-mean", **options)
        example = ts.make_example(model, VOCAB, spec, seed=8, temperature=temperature)
        compare(model, example, config, "grpo", "jaxrl_grpo", memory="fast")
    elif case == "grpo-packed":
        config = ts.grpo_config(1.0, loss_agg_mode="token-mean", beta=0.04)
        example = ts.make_example(model, VOCAB, ts.ExampleSpec(packed=True, completion_len=9))
        compare(model, example, config, "grpo", "jaxrl_grpo", memory="fast")
    else:
        example = ts.make_example(
            model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=9, ppo=True
        )
        _, aux, _ = compare(
            model,
            example,
            ts.ppo_config(**PPO_CASES["entropy_dual_clip"]),
            "ppo",
            "jaxrl_ppo",
            memory="fast",
        )
        assert "loss/entropy" in aux


def test_untied_head_on_chunked_backend(models):
    model = models["qwen3"]
    config = ts.grpo_config(1.0, loss_agg_mode="token-mean", beta=0.04, kl_loss_mode="kl")
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(sampler_is=True), seed=7)
    compare(model, example, config, "grpo", "jaxrl_grpo", backend="chunked")


@pytest.mark.gpu
def test_gpu_automatic_backend_matches_tunix():
    """On a GPU the automatic backend (pallas; ffi declines float32) against tunix's loss, both
    with float32 matmuls at full precision."""
    model = ts.make_model("qwen3_tied", 1031)
    config = ts.grpo_config(
        0.7, loss_agg_mode="sequence-mean-token-mean", beta=0.04, kl_loss_mode="low_var_kl"
    )
    with jax.default_matmul_precision("highest"):
        example = ts.make_example(
            model, 1031, ts.ExampleSpec(batch=8, completion_len=64), temperature=0.7
        )
        compare(model, example, config, "grpo", "jaxrl_grpo")


def test_heads_found():
    untied, tied = ts.make_model("qwen3", VOCAB), ts.make_model("qwen3_tied", VOCAB)
    head = jt.find_head(untied)
    assert (head.layout, head.weight.shape) == ("dv", (16, VOCAB))
    head = jt.find_head(tied)
    assert (head.layout, head.weight.shape) == ("vd", (VOCAB, 16))
    assert jt.find_head(ts.make_model("gemma3", VOCAB)).layout == "vd"


def test_other_families_qualify():
    """Qwen2 (lm_head) and Gemma without a soft-cap (tied) expose what the losses need."""
    from tunix.models.gemma import model as gemma
    from tunix.models.qwen2 import model as qwen2

    config = qwen2.ModelConfig(
        num_layers=1,
        vocab_size=VOCAB,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
    )
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(0))
    jt.check_model(model)
    assert jt.find_head(model).layout == "dv"
    config = dataclasses.replace(
        gemma.ModelConfig.gemma_2b(),
        num_layers=1,
        num_embed=VOCAB,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        attention_types=(gemma.AttentionType.GLOBAL,),
    )
    model = gemma.Gemma(config, rngs=nnx.Rngs(0))
    jt.check_model(model)
    assert jt.find_head(model).layout == "vd"


# -- sampler matching -------------------------------------------------------------------------

SAMPLER = jt.SamplerSettings(0.7, top_k=5, top_p=0.8)  # of V = 61


@pytest.mark.parametrize("case", ["grpo", "grpo-fast", "ppo"])
def test_sampler_matched_losses(models, case):
    """The sampler-matched variant (``sampler_matched_loss``, what tunix's learners call):
    loss, every aux value and every gradient equal the oracle's (tunix's logits,
    jk.token_logprobs with the sampler's top_k / top_p at its temperature, the same loss
    formula; tests/support/tunix_support.py), ``outside_kept_set`` counting the completion tokens
    outside their kept set; and they differ from the untruncated loss's (the option off:
    tunix's, which the tests above check)."""
    model = models["qwen3"]
    algo = case.split("-")[0]
    if algo == "grpo":
        config = ts.grpo_config(
            SAMPLER.temperature, loss_agg_mode="token-mean", beta=0.04, kl_loss_mode="low_var_kl"
        )
        example = ts.make_example(
            model, VOCAB, ts.ExampleSpec(sampler_is=True), seed=11, temperature=SAMPLER.temperature
        )
    else:  # tunix's PPO loss takes temperature 1; sampler-matched, the sampler's
        config = ts.ppo_config(entropy_coef=0.05, epsilon_c=3.0)
        example = ts.make_example(
            model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=12, ppo=True
        )
    name = jt.sampler_matched_loss(f"jaxrl_{algo}", SAMPLER)
    assert name == f"jaxrl_{algo}[temperature=0.7,top_k=5,top_p=0.8]"
    kwargs = dict(memory="fast") if case == "grpo-fast" else {}
    got = ts.loss_and_grads(name, model, example, config, **kwargs)
    ts.assert_same(got, ts.processed_loss_and_grads(model, example, config, SAMPLER))
    outside = float(got[1]["outside_kept_set"])
    assert 0 < outside < float(np.sum(example.completion_mask))
    if case != "grpo-fast":
        off = ts.loss_and_grads(f"jaxrl_{algo}", model, example, config)
        assert abs(float(got[0]) - float(off[0])) > 1e-3 * max(abs(float(off[0])), 1.0)
        entropy = "entropy" if algo == "grpo" else "loss/entropy"
        assert float(got[1][entropy]) < float(off[1][entropy])  # the kept set's, smaller


def test_sampler_matched_logprob_pass(models):
    """compute_per_token_logps(sampler=jk.Sampler(...)): the oracle's processed log-probs, not the
    untruncated ones."""
    model = models["qwen3_tied"]
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(), seed=13)
    graphdef, state = nnx.split(model)
    args = (graphdef, state, example.prompt_ids, example.completion_ids)
    got = np.asarray(
        jt.compute_per_token_logps(
            *args, ts.PAD_ID, ts.EOS_ID, temperature=SAMPLER.temperature, sampler=SAMPLER.sampler
        )
    )
    logits = ts.tunix_logits(*args)
    want = np.asarray(ts.processed_logprobs(logits, example.completion_ids, SAMPLER))
    np.testing.assert_allclose(got, want, atol=ts.RTOL * float(np.max(np.abs(want))))
    full = np.asarray(
        jk.token_logprobs(logits, example.completion_ids, temperature=SAMPLER.temperature)
    )
    assert np.min(got - full) > -1e-5 and np.mean(got - full) > 0.05  # lse - lse(kept) >= 0


def test_sampler_settings(models):
    """tunix's rollout conventions mapped to ours; what is refused."""
    import types

    from tunix.rl.rollout import base_rollout, vanilla_rollout

    def settings(**options):
        return jt.SamplerSettings.from_rollout_config(base_rollout.RolloutConfig(**options))

    assert settings() == jt.SamplerSettings(0.9)  # tunix's defaults: top_p 1.0, top_k None
    assert settings(temperature=1.0, top_k=50, top_p=0.95) == jt.SamplerSettings(
        1.0, top_k=50, top_p=0.95
    )
    for off in (None, 0, -1):
        assert settings(top_k=off).top_k is None
    assert settings(top_p=None).top_p is None and settings(top_p=1.0).truncation is None
    assert jt.SamplerSettings(0.5, top_p=1.0, min_p=0.0) == jt.SamplerSettings(0.5)
    with pytest.raises(ValueError, match="temperature is 0"):
        settings(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        settings(top_p=0.0)
    for bad in (
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=0),
        dict(temperature=1.0, top_p=1.5),
        dict(temperature=1.0, min_p=-0.1),
    ):
        with pytest.raises(ValueError):
            jt.SamplerSettings(**bad)
    # the vanilla engine samples greedily when top_p is None: refused there, not elsewhere
    config = base_rollout.RolloutConfig(top_p=None, top_k=8)
    cluster = types.SimpleNamespace(
        get_rollout_config=lambda mode: config,
        rollout=object.__new__(vanilla_rollout.VanillaRollout),
    )
    with pytest.raises(ValueError, match="greedily"):
        jt.sampler_settings(cluster)
    cluster.rollout = object()
    assert jt.sampler_settings(cluster) == jt.SamplerSettings(0.9, top_k=8)
    # the GRPO loss refuses a sampler whose temperature is not the config's (the rollout's)
    example = ts.make_example(models["qwen3"], VOCAB, ts.ExampleSpec(), seed=1)
    grpo = ts.grpo_config(1.0, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="one temperature"):
        jt.grpo_policy_loss(models["qwen3"], example, grpo, ts.PAD_ID, ts.EOS_ID, sampler=SAMPLER)
    with pytest.raises(TypeError, match="SamplerSettings"):
        jt.grpo_policy_loss(
            models["qwen3"], example, grpo, ts.PAD_ID, ts.EOS_ID, sampler=dict(top_k=5)
        )
    with pytest.raises(ValueError, match="'grpo'"):
        jt.sampler_matched_loss("grpo", SAMPLER)


# -- no [B, T, V] buffer ----------------------------------------------------------------------

SHAPE = re.compile(r"\b(?:f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([0-9,]*)\]")


def largest_buffer(loss_name, model, example, config):
    """Element count of the largest array in the compiled value_and_grad program."""
    from tunix.rl import function_registry

    loss_fn = function_registry.get_policy_loss_fn(loss_name)
    graphdef, state = nnx.split(model)

    def objective(state, example):
        return loss_fn(nnx.merge(graphdef, state), example, config, ts.PAD_ID, ts.EOS_ID)

    text = (
        jax.jit(jax.value_and_grad(objective, has_aux=True))
        .lower(state, example)
        .compile()
        .as_text()
    )
    return buffer_elements(text)


def buffer_elements(hlo_text):
    """Element count of the largest array in a compiled program's text."""
    return max(
        int(np.prod([int(d) for d in dims.split(",") if d])) for dims in SHAPE.findall(hlo_text)
    )


# V = 8209 and 256 completion tokens: the chunked backend's tiles are [256, 4096], so its
# largest buffers (the tiles, the [D, V] weight and its gradient) are all smaller than the
# [B, T, V] completion logits that tunix's programs hold.
NO_LOGITS_VOCAB = 8209
NO_LOGITS_SPEC = ts.ExampleSpec(batch=4, prompt_len=3, completion_len=64, ref=True)


def no_logits_case(family):
    model = ts.make_model(family, NO_LOGITS_VOCAB)
    example = ts.make_example(model, NO_LOGITS_VOCAB, NO_LOGITS_SPEC)
    completion_logits = NO_LOGITS_SPEC.batch * NO_LOGITS_SPEC.completion_len * NO_LOGITS_VOCAB
    bound = max(16 * NO_LOGITS_VOCAB, NO_LOGITS_SPEC.batch * NO_LOGITS_SPEC.completion_len * 4096)
    return model, example, completion_logits, bound


def test_compiled_loss_holds_no_logits():
    """The value_and_grad program of tunix's loss holds [B, L, V] logits; ours, on the chunked
    backend, nothing as large as the completion's [B, T, V]."""
    model, example, completion_logits, bound = no_logits_case("qwen3")
    config = ts.grpo_config(1.0, loss_agg_mode="token-mean", beta=0.04)
    # The probe sees tunix's logits:
    assert largest_buffer("grpo", model, example, config) >= completion_logits
    with jk.use_backend("chunked"):
        ours = largest_buffer("jaxrl_grpo", model, example, config)
    assert ours < completion_logits
    assert ours <= bound


def test_compiled_logprob_pass_holds_no_logits():
    """The reference / old-policy pass: tunix's compute_per_token_logps program holds the logits,
    jaxrl_kernels' (same arguments) does not, and returns the same log-probs."""
    from tunix.rl import common

    model, example, completion_logits, bound = no_logits_case("qwen3_tied")
    graphdef, state = nnx.split(model)
    args = (graphdef, state, example.prompt_ids, example.completion_ids)
    kwargs = dict(pad_id=ts.PAD_ID, eos_id=ts.EOS_ID, temperature=0.7)
    theirs = common.compute_per_token_logps.lower(*args, **kwargs).compile()
    ours = jt.compute_per_token_logps.lower(*args, backend="chunked", **kwargs).compile()
    assert buffer_elements(theirs.as_text()) >= completion_logits
    assert buffer_elements(ours.as_text()) <= bound < completion_logits
    want = np.asarray(theirs(*args))
    np.testing.assert_allclose(
        np.asarray(ours(*args)), want, atol=ts.RTOL * float(np.max(np.abs(want)))
    )


# -- errors ----------------------------------------------------------------------------------


def test_model_without_hidden_states_is_refused():
    from tunix.models.llama3 import model as llama3

    config = llama3.ModelConfig(
        num_layers=1,
        vocab_size=VOCAB,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
    )
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="Llama3.*output_hidden_states"):
        jt.check_model(model)


def test_softcapped_logits_are_refused():
    from tunix.models.gemma import model as gemma

    config = dataclasses.replace(
        gemma.ModelConfig.gemma2_2b(),
        num_layers=1,
        num_embed=VOCAB,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        sliding_window_size=4,
        attention_types=(gemma.AttentionType.GLOBAL,),
    )
    model = gemma.Gemma(config, rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="final_logits_softcap = 30.0"):
        jt.check_model(model)


def test_bad_options_raise(models):
    model = models["qwen3"]
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(), seed=1)
    config = ts.grpo_config(1.0, loss_agg_mode="token-mean")
    config.loss_agg_mode = "token-sum"
    with pytest.raises(ValueError, match="loss_agg_mode.*'token-sum'.*token-mean"):
        jt.grpo_policy_loss(model, example, config, ts.PAD_ID, ts.EOS_ID)
    config = ts.grpo_config(1.0, loss_agg_mode="token-mean", kl_loss_mode="k3")
    with pytest.raises(ValueError, match="kl_loss_mode.*'k3'.*low_var_kl"):
        jt.grpo_policy_loss(model, example, config, ts.PAD_ID, ts.EOS_ID)
    ppo_example = ts.make_example(model, VOCAB, ts.ExampleSpec(old=False), ppo=True)
    with pytest.raises(ValueError, match="old_per_token_logps"):
        jt.ppo_policy_loss(model, ppo_example, ts.ppo_config(), ts.PAD_ID, ts.EOS_ID)


def test_registered_names():
    from tunix.rl import function_registry

    assert function_registry.get_policy_loss_fn("jaxrl_grpo") is jt.grpo_policy_loss
    assert function_registry.get_policy_loss_fn("jaxrl_ppo") is jt.ppo_policy_loss


def test_refuses_logits():
    model = ts.make_model("qwen3", VOCAB)
    graphdef, state = nnx.split(model)
    tokens = jnp.ones((2, 3), jnp.int32)
    with pytest.raises(NotImplementedError, match="return_logits=True"):
        jt.compute_per_token_logps(
            graphdef, state, tokens, tokens, ts.PAD_ID, ts.EOS_ID, return_logits=True
        )


# -- many devices ----------------------------------------------------------------------------


# ~60 s of CPU; tests/integrations/test_tunix_learners.py runs the learners on fsdp=2 in CI
@pytest.mark.slow
@pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py forces 8 host devices)"
)
def test_sharded_fsdp2_tp4_matches_tunix():
    """tests/support/tunix_sharded.py: a (fsdp=2, tp=4) mesh, the models' own shardings (vocabulary
    over "tp"), against tunix's losses on the same sharded inputs."""
    from tests.support import tunix_sharded

    tunix_sharded.check_all()
