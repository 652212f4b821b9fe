"""The tunix integration inside tunix's own training loops: GRPOLearner and PPOLearner.

Each test trains the same tiny float32 Qwen3 (one layer, lm_head [D, V], every parameter off
its init: tunix zero-initialises the MLP) twice through tunix's RLCluster: with tunix's own
policy loss and log-probs, and with "jaxrl_grpo" / "jaxrl_ppo" plus
:func:`use_kernel_logprobs` (the reference model's and the rollout policy's log-probs from
jaxrl_kernels too). Actor, reference (and PPO's critic) live on an fsdp=2 mesh of host devices;
the vanilla rollout samples with a fixed seed; two global steps of 2 prompts, mini-batch 2 in
micro-batches of 1 (gradient accumulation), num_iterations 2, beta 0.04 (a reference pass),
AdamW (tests/tunix_support.py ``run_learner``). Every metric tunix logs and every final
parameter must agree (1e-5 of scale), jaxrl_kernels must have served the reference and rollout
log-probs, and every actor parameter must keep the sharding tunix gave it, so that the train
step and the sampler compile once (tunix's own PPO loss and its packed GRPO runs do not keep
it: the final norm's scale ends sharded over "fsdp").

Sequence packing (tunix's ``max_seq_token_per_tpu``) is the third test, marked ``slow`` and
run only with JAXRL_TEST_SLOW=1 (CI's time budget). On this CPU Qwen3
(no flash attention) tunix 0.1.7 packs without any attention mask (``process_ids`` gives
``attention_mask=None`` for packed rows), so packed training there is not causal; both losses
see the same model, so they must still agree.
"""

from __future__ import annotations

import inspect
import types

import pytest

pytest.importorskip("tunix", reason="the tunix extra is not installed (pip install -e .[tunix])")

import tunix_support as ts  # noqa: E402
from jaxrl_kernels.integrations import tunix as jaxrl_tunix  # noqa: E402


def check_pair(algo, packed=False):
    want = ts.run_learner(algo, algo, kernel_logprobs=False, packed=packed)
    got = ts.run_learner(algo, f"jaxrl_{algo}", kernel_logprobs=True, packed=packed)
    ts.assert_same_run(got, want)
    ts.assert_shardings_kept(got)
    # parameters kept their shardings, so nothing compiled twice
    assert set(got.compiles.values()) == {1}, got.compiles
    handle = got.kernel_logprobs
    assert handle.patched == ["reference", "rollout"] and not handle.active
    # a reference and an old-policy pass per micro-batch of each global step
    assert handle.calls == {"reference": 4, "rollout": 4}, handle
    # not vacuous: the clipped branch of the surrogate is taken
    assert max(got.metrics["actor/train/pg_clipfrac"]) > 0
    return got, want


def test_grpo_learner_matches_tunix():
    got, want = check_pair("grpo")
    assert len(got.metrics["actor/train/loss"]) == 4  # 2 global steps x 2 iterations
    assert max(abs(x) for x in got.metrics["actor/train/kl"]) > 1e-3


def test_ppo_learner_matches_tunix():
    """PPOLearner hands the registered function itself to its trainer (no wrapping lambda)."""
    got, _ = check_pair("ppo")
    assert "actor/train/loss/entropy" in got.metrics and "critic/train/loss" in got.metrics


@pytest.mark.slow  # ~80 s of CPU
def test_grpo_learner_packed_matches_tunix():
    got, _ = check_pair("grpo", packed=True)
    assert len(got.metrics["actor/train/loss"]) >= 1


def test_losses_have_tunix_signature():
    from tunix.rl import function_registry

    for ours, theirs in (("jaxrl_grpo", "grpo"), ("jaxrl_ppo", "ppo")):
        got = inspect.signature(function_registry.get_policy_loss_fn(ours)).parameters
        want = inspect.signature(function_registry.get_policy_loss_fn(theirs)).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == \
               [(p.name, p.kind, p.default) for p in want.values()]


def test_use_kernel_logprobs_refuses_unsupported_models():
    """A reference model without hidden states: NotImplementedError, nothing patched."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    config = llama3.ModelConfig(num_layers=1, vocab_size=ts.LEARNER_VOCAB, embed_dim=16,
                                hidden_dim=24, num_heads=2, head_dim=8, num_kv_heads=1,
                                rope_theta=10_000, norm_eps=1e-6)
    worker = types.SimpleNamespace(_models={"reference": llama3.Llama3(config,
                                                                        rngs=nnx.Rngs(0))})
    cluster = types.SimpleNamespace(inference_worker=worker, rollout=object())
    with pytest.raises(NotImplementedError, match="Llama3.*output_hidden_states"):
        jaxrl_tunix.use_kernel_logprobs(cluster)
    assert "get_ref_per_token_logps" not in vars(worker)
    handle = jaxrl_tunix.use_kernel_logprobs(cluster, reference=False)
    assert handle.patched == [] and "rollout" in handle.skipped
    assert not handle.active
