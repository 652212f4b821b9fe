"""tunix's GRPO actor step with jaxrl_kernels' "jaxrl_grpo" policy loss, on a toy Qwen3.

    pip install -e ".[tunix]" && python examples/tunix_grpo.py

In a real run, two lines change a tunix GRPO setup (docs/tunix.md)::

    import jaxrl_kernels.integrations.tunix          # registers "jaxrl_grpo" and "jaxrl_ppo"
    config = GRPOConfig(..., policy_loss_fn="jaxrl_grpo")

and ``GRPOLearner`` then trains with a loss that runs the model only up to its final hidden
states and takes the log-probs from its LM head without building [B, T, V] logits. This
script runs the same actor train step ``GRPOLearner`` drives (tunix's ``rl_trainer.Trainer``
with the loss ``GRPOConfig.policy_loss_fn`` names, advantages from tunix's GRPO estimator),
without a sampler or tokenizer: a random-init Qwen3 of 1 layer, random prompts and
completions, a made-up reward. It takes a few steps with tunix's own "grpo" loss and with
"jaxrl_grpo" from the same start, and prints both: the same losses and the same parameters.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import function_registry
from tunix.rl import trainer as rl_trainer
from tunix.rl.grpo import grpo_learner
from tunix.sft import peft_trainer

import jaxrl_kernels.integrations.tunix  # noqa: F401  (registers "jaxrl_grpo" / "jaxrl_ppo")

PAD, EOS = 0, 1
VOCAB, GROUP, PROMPTS, PROMPT_LEN, COMPLETION_LEN = 101, 4, 2, 5, 8


def toy_model(seed: int = 0) -> qwen3.Qwen3:
    config = qwen3.ModelConfig(
        num_layers=1,
        vocab_size=VOCAB,
        embed_dim=32,
        hidden_dim=64,
        num_heads=2,
        head_dim=16,
        num_kv_heads=1,
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
    )
    return qwen3.Qwen3(config, rngs=nnx.Rngs(seed))


def toy_rollout(config: grpo_learner.GRPOConfig, seed: int = 0) -> grpo_learner.TrainExample:
    """What GRPOLearner hands its actor step: GROUP completions per prompt, their mask, and
    group advantages from the rewards (here: the fraction of even tokens in a completion)."""
    rng = np.random.default_rng(seed)
    batch = PROMPTS * GROUP
    prompts = np.repeat(rng.integers(2, VOCAB, (PROMPTS, PROMPT_LEN)), GROUP, axis=0)
    completions = rng.integers(2, VOCAB, (batch, COMPLETION_LEN))
    lengths = rng.integers(2, COMPLETION_LEN + 1, batch)
    mask = np.arange(COMPLETION_LEN)[None, :] < lengths[:, None]
    completions = np.where(mask, completions, PAD)
    rewards = np.sum(mask & (completions % 2 == 0), axis=1) / lengths
    estimator = function_registry.get_advantage_estimator(config.advantage_estimator)
    advantages = estimator(rewards=rewards, num_generations=config.num_generations)
    return grpo_learner.TrainExample(
        prompt_ids=jnp.asarray(prompts, jnp.int32),
        prompt_mask=jnp.ones(prompts.shape, jnp.int32),
        completion_ids=jnp.asarray(completions, jnp.int32),
        completion_mask=jnp.asarray(mask, jnp.int32),
        advantages=jnp.asarray(advantages, jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=None,
    )


def actor_trainer(model, config: grpo_learner.GRPOConfig, steps: int) -> rl_trainer.Trainer:
    """tunix's actor Trainer wired the way GRPOLearner wires it."""
    policy_loss_fn = function_registry.get_policy_loss_fn(config.policy_loss_fn)
    trainer = rl_trainer.Trainer(
        model,
        optax.adamw(1e-2),
        peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps),
        custom_checkpoint_metadata_fn=dict,
    )
    trainer.with_loss_fn(
        lambda model, train_example, algo_config: policy_loss_fn(
            model, train_example, algo_config=algo_config, pad_id=PAD, eos_id=EOS
        ),
        has_aux=True,
    )
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": config})
    return trainer


def run(policy_loss_fn: str, steps: int) -> tuple[list[tuple[float, float]], nnx.State]:
    config = grpo_learner.GRPOConfig(
        num_generations=GROUP,
        beta=0.0,
        epsilon=0.2,
        loss_algo="grpo",
        loss_agg_mode="token-mean",
        policy_loss_fn=policy_loss_fn,
    )
    config.temperature = 1.0  # GRPOLearner copies the rollout temperature here
    model = toy_model()
    train_step, _ = actor_trainer(model, config, steps).jit_train_and_eval_step()
    losses = []
    for step in range(steps):
        loss, aux, grad_norm = train_step(toy_rollout(config, seed=step))
        losses.append((float(loss), float(grad_norm)))
    return losses, nnx.state(model, nnx.Param)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    theirs, their_params = run("grpo", args.steps)
    ours, our_params = run("jaxrl_grpo", args.steps)
    for step, ((a, a_norm), (b, b_norm)) in enumerate(zip(theirs, ours)):
        print(
            f"step {step}: loss {a:+.6f} / {b:+.6f}, gradient norm {a_norm:.6f} / {b_norm:.6f}"
            "  (tunix 'grpo' / 'jaxrl_grpo')"
        )
    gap = max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(their_params), jax.tree.leaves(our_params))
    )
    print(f"largest parameter difference after {args.steps} steps: {gap:.2e}")


if __name__ == "__main__":
    main()
