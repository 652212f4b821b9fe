"""The tunix integration inside tunix's own training loops: GRPOLearner and PPOLearner.

Each test trains the same tiny float32 Qwen3 (one layer, lm_head [D, V], every parameter off
its init: tunix zero-initialises the MLP) twice through tunix's RLCluster: with tunix's own
policy loss and log-probs, and with "jaxrl_grpo" / "jaxrl_ppo" plus
:func:`use_kernel_logprobs` (the reference model's and the rollout policy's log-probs from
jaxrl_kernels too). Actor, reference (and PPO's critic) live on an fsdp=2 mesh of host devices;
the vanilla rollout samples with a fixed seed; two global steps of 2 prompts, mini-batch 2 in
micro-batches of 1 (gradient accumulation; one PPO test: one global step of 4 prompts in
micro-batches of 2), num_iterations 2, beta 0.04 (a reference pass),
AdamW (tests/support/tunix_support.py ``run_learner``); PPO with a critic, an entropy bonus, the
KL in the reward and dual clip. Every metric tunix logs and every final parameter must agree (1e-5
of scale), jaxrl_kernels must have served the reference and rollout log-probs, every actor
parameter must end with exactly the sharding (mesh and PartitionSpec) that tunix's own loss
gives it, and the train step and the sampler, which jit-cache on those shardings, must compile
as many times as in tunix's run. tunix splits a micro-batch's rows over "fsdp" only when their
number divides it: GRPO's micro-batches of 2 rows and PPO's of 2 prompts keep every declared
sharding under tunix's loss; PPO's micro-batches of 1 row leave the three RMSNorm scales
sharded over "fsdp" (ours once kept them replicated), and the tests assert both, so that
the comparison is not vacuous.

CI (CPU time) runs the GRPO learner and the PPO learner of micro-batches of 1 row (the one
where the RMSNorm scales' sharding moves) against tunix's own; the other PPO learner and the
sampler-matched runs are marked ``slow`` (JAXRL_TEST_SLOW=1), tests/integrations/test_tunix.py
holding "jaxrl_ppo" to tunix's "ppo" in CI. Sequence packing (tunix's ``max_seq_token_per_tpu``)
is one more GRPO test, marked ``slow`` too. On this CPU Qwen3
(no flash attention) tunix 0.1.7 packs without any attention mask (``process_ids`` gives
``attention_mask=None`` for packed rows), so packed training there is not causal; both losses
see the same model, so they must still agree.
"""

from __future__ import annotations

import inspect
import types

import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("tunix", reason="the tunix extra is not installed (pip install -e .[tunix])")

from tunix.rl import function_registry  # noqa: E402

from jaxrl_kernels.integrations import tunix as jaxrl_tunix  # noqa: E402
from tests.support import tunix_support as ts  # noqa: E402

# the RMSNorm scales of the one-layer learner model, declared P() (replicated)
NORM_SCALES = (
    "['final_norm']['w'].value",
    "['layers'][0]['input_layernorm']['w'].value",
    "['layers'][0]['post_attention_layernorm']['w'].value",
)


def check_pair(algo, packed=False, global_steps=2, per_step=2, micro_batch=1):
    sizes = dict(global_steps=global_steps, per_step=per_step, micro_batch=micro_batch)
    want = ts.run_learner(algo, algo, kernel_logprobs=False, packed=packed, **sizes)
    got = ts.run_learner(algo, f"jaxrl_{algo}", kernel_logprobs=True, packed=packed, **sizes)
    ts.assert_same_run(got, want)
    handle = got.kernel_logprobs
    assert handle.patched == ["reference", "rollout"] and not handle.active
    # a reference and an old-policy pass per micro-batch of each global step
    passes = global_steps * per_step // micro_batch
    assert handle.calls == {"reference": passes, "rollout": passes}, handle
    # not vacuous: the clipped branch of the surrogate is taken
    assert max(got.metrics["actor/train/pg_clipfrac"]) > 0
    return got, want


def test_grpo_learner_matches_tunix():
    """Micro-batches of 2 rows (1 prompt x 2 generations), split over "fsdp": tunix's loss
    keeps every parameter's sharding, so ours does, and nothing compiles twice."""
    got, want = check_pair("grpo")
    assert len(got.metrics["actor/train/loss"]) == 4  # 2 global steps x 2 iterations
    assert max(abs(x) for x in got.metrics["actor/train/kl"]) > 1e-3
    assert ts.moved_shardings(want) == {}
    assert set(got.compiles.values()) == {1}, got.compiles


def test_ppo_learner_matches_tunix():
    """PPOLearner hands the registered function itself to its trainer (no wrapping lambda).

    Micro-batches of 1 row, which tunix does not split over "fsdp": its own loss leaves the
    three RMSNorm scales sharded over "fsdp" (the train step and the sampler compile twice),
    and ours must leave them the same (ours once kept them P())."""
    got, want = check_pair("ppo")
    assert "actor/train/loss/entropy" in got.metrics and "critic/train/loss" in got.metrics
    assert "actor/train/pg_clipfrac_lower" in got.metrics
    assert ts.moved_shardings(want) == {name: (P(), P("fsdp")) for name in NORM_SCALES}
    assert set(got.compiles.values()) == {2}, got.compiles


@pytest.mark.slow  # ~40 s of CPU
def test_ppo_learner_split_micro_batch_matches_tunix():
    """Mini-batch 4 prompts in micro-batches of 2, split over "fsdp": tunix's own loss keeps
    every parameter's sharding here, and ours must too (one global step)."""
    got, want = check_pair("ppo", global_steps=1, per_step=4, micro_batch=2)
    assert len(got.metrics["actor/train/loss"]) == 2  # 1 global step x 2 iterations
    assert ts.moved_shardings(want) == {}
    assert set(got.compiles.values()) == {1}, got.compiles


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_sampler_matched_learner(algo):  # grpo ~35 s of CPU, ppo ~65 s
    """Sampler matching in tunix's own loop: a rollout with top_k 8 (of 64) and top_p 0.9 at
    temperature 0.9, ``use_kernel_logprobs(..., sampler_matched=True, algo_config=config)``
    (both passes and the loss's variant) against the oracle (tunix's logits, then
    jk.token_logprobs with the same top_k / top_p, for both passes and inside the loss;
    tests/support/tunix_support.py): every logged metric and final parameter, the shardings and the
    compile counts agree. One global step of 2 prompts in micro-batches of 1 (GRPO: 2
    generations each)."""
    sizes = dict(
        global_steps=1, per_step=2, micro_batch=1, top_k=8, top_p=0.9, sampler_matched=True
    )
    want = ts.run_learner(algo, f"jaxrl_{algo}", kernel_logprobs=False, **sizes)
    got = ts.run_learner(algo, f"jaxrl_{algo}", kernel_logprobs=True, **sizes)
    ts.assert_same_run(got, want)
    handle = got.kernel_logprobs
    assert handle.sampler == jaxrl_tunix.SamplerSettings(0.9, top_k=8, top_p=0.9)
    assert handle.loss == f"jaxrl_{algo}[temperature=0.9,top_k=8,top_p=0.9]"
    assert handle.patched == ["reference", "rollout"] and not handle.active
    assert handle.calls == {"reference": 2, "rollout": 2}, handle
    # not vacuous: the truncation raised every pass's log-probs (lse - lse(kept set) > 0)
    gains = want.kernel_logprobs.gains
    assert len(gains["reference"]) == len(gains["rollout"]) == 2
    assert min(gains["reference"] + gains["rollout"]) > 0.05, gains


def test_use_kernel_logprobs_sampler_matched_options():
    """sampler_matched needs the learner's config (one of our losses, no learner built on the
    plain loss yet); it sets the config's loss to the variant, and restore() sets it back."""
    from tunix.rl.rollout import base_rollout

    from jaxrl_kernels.integrations.tunix import losses

    rollout_config = base_rollout.RolloutConfig(temperature=0.8, top_k=0, top_p=0.95)
    cluster = types.SimpleNamespace(
        inference_worker=types.SimpleNamespace(_models={}),
        rollout=object(),
        get_rollout_config=lambda mode: rollout_config,
        actor_trainer=types.SimpleNamespace(loss_fn=None),
    )
    with pytest.raises(ValueError, match="algo_config="):
        jaxrl_tunix.use_kernel_logprobs(cluster, sampler_matched=True)
    config = ts.ppo_config(policy_loss_fn="ppo")
    with pytest.raises(ValueError, match="'ppo'"):
        jaxrl_tunix.use_kernel_logprobs(cluster, sampler_matched=True, algo_config=config)
    config.policy_loss_fn = "jaxrl_ppo"
    cluster.actor_trainer.loss_fn = losses.ppo_policy_loss  # as PPOLearner binds it
    with pytest.raises(ValueError, match="before building the learner"):
        jaxrl_tunix.use_kernel_logprobs(cluster, sampler_matched=True, algo_config=config)
    policy_loss_fn = losses.grpo_policy_loss  # as GRPOLearner binds it: a lambda calling it
    cluster.actor_trainer.loss_fn = lambda model, example, algo_config: policy_loss_fn(
        model, example, algo_config, 0, 1
    )
    with pytest.raises(ValueError, match="before building the learner"):
        jaxrl_tunix.use_kernel_logprobs(cluster, sampler_matched=True, algo_config=config)
    assert config.policy_loss_fn == "jaxrl_ppo"
    cluster.actor_trainer.loss_fn = None
    with jaxrl_tunix.use_kernel_logprobs(
        cluster, sampler_matched=True, algo_config=config
    ) as handle:
        assert handle.sampler == jaxrl_tunix.SamplerSettings(0.8, top_p=0.95)
        assert config.policy_loss_fn == handle.loss == "jaxrl_ppo[temperature=0.8,top_p=0.95]"
        variant = function_registry.get_policy_loss_fn(handle.loss)
        assert variant.sampler == handle.sampler and variant.base is losses.ppo_policy_loss
        assert handle.active and handle.patched == []
    assert config.policy_loss_fn == "jaxrl_ppo" and not handle.active
    # off (the default): the config is not read or touched
    handle = jaxrl_tunix.use_kernel_logprobs(cluster, algo_config=config)
    assert handle.sampler is None and handle.loss is None and not handle.active


@pytest.mark.slow  # ~80 s of CPU
def test_grpo_learner_packed_matches_tunix():
    got, _ = check_pair("grpo", packed=True)
    assert len(got.metrics["actor/train/loss"]) >= 1


def test_losses_have_tunix_signature():
    sampler = jaxrl_tunix.SamplerSettings(1.0, top_k=4)
    for ours, theirs in (
        ("jaxrl_grpo", "grpo"),
        ("jaxrl_ppo", "ppo"),
        (jaxrl_tunix.sampler_matched_loss("jaxrl_grpo", sampler), "grpo"),
        (jaxrl_tunix.sampler_matched_loss("jaxrl_ppo", sampler), "ppo"),
    ):
        got = inspect.signature(function_registry.get_policy_loss_fn(ours)).parameters
        want = inspect.signature(function_registry.get_policy_loss_fn(theirs)).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in want.values()
        ]


def test_use_kernel_logprobs_refuses_unsupported_models():
    """A reference model without hidden states: NotImplementedError, nothing patched."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    config = llama3.ModelConfig(
        num_layers=1,
        vocab_size=ts.LEARNER_VOCAB,
        embed_dim=16,
        hidden_dim=24,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
    )
    worker = types.SimpleNamespace(_models={"reference": llama3.Llama3(config, rngs=nnx.Rngs(0))})
    cluster = types.SimpleNamespace(inference_worker=worker, rollout=object())
    with pytest.raises(NotImplementedError, match="Llama3.*output_hidden_states"):
        jaxrl_tunix.use_kernel_logprobs(cluster)
    assert "get_ref_per_token_logps" not in vars(worker)
    handle = jaxrl_tunix.use_kernel_logprobs(cluster, reference=False)
    assert handle.patched == [] and "rollout" in handle.skipped
    assert not handle.active
