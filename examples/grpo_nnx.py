"""GRPO with jaxrl_kernels inside a Flax NNX + Optax train step, on a small decoder.

    python examples/grpo_nnx.py                 # both head layouts, 40 steps each
    python examples/grpo_nnx.py --layout dv --steps 100
    JAXRL_KERNELS_CHECKS=1 python examples/grpo_nnx.py   # also check the data inside jit

What the train step needs from the model, and where each piece comes from:

* hidden states: the decoder's output after its final norm, [B, T, D]. The model never
  applies its LM head; jaxrl_kernels does, without building the [B, T, V] logits.
* the head weight and its layout: a tied embedding table is [V, D] (``weight_layout="vd"``);
  an ``nnx.Linear(D, V)`` kernel is [D, V] (``"dv"``). ``lm_head(model)`` returns either.
* the one-token shift: the hidden state at position t predicts token t + 1, so the model
  reads ``tokens[:, :-1]`` and the actions are ``tokens[:, 1:]``.
* the mask, [B, T] like the actions: 1 where the action is a response token (sampled by the
  policy, up to and including its end-of-sequence token), 0 on the prompt and after the end.
* old log-probs: the log-probs of the actions under the policy that sampled them, without
  gradient. With one update per rollout (as here) that is the current policy under
  ``jax.lax.stop_gradient``; with several updates, compute them once right after sampling.
* rewards: one per sequence, [B]; consecutive groups of ``GROUP`` answers to the same prompt
  are compared (``groups=jk.Groups(size=GROUP)``).

The toy task: after a random prompt, answer with even tokens; the reward is the fraction of
even tokens among the answer's ``RESPONSE`` slots. The mean reward rises over the steps.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxrl_kernels as jk

VOCAB, DIM, PROMPT, RESPONSE = 32, 32, 4, 6
PROMPTS, GROUP = 4, 8  # B = PROMPTS * GROUP sequences per step
EOS = 1


class Decoder(nnx.Module):
    """Token embedding, one pre-norm causal attention + MLP block, a final norm."""

    def __init__(self, tied: bool, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)  # table [V, D]
        self.norm1, self.norm2 = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, DIM, decode=False, rngs=rngs)
        self.up, self.down = (
            nnx.Linear(DIM, 4 * DIM, rngs=rngs),
            nnx.Linear(4 * DIM, DIM, rngs=rngs),
        )
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = None if tied else nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)  # [D, V]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> hidden states [B, T, D]."""
        x = self.embed(tokens) + 0.1 * jnp.sin(
            jnp.arange(tokens.shape[1])[:, None] + jnp.arange(DIM)
        )
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(tokens))
        x = x + self.down(nnx.gelu(self.up(self.norm2(x))))
        return self.norm(x)


# [train-step]
def lm_head(model):
    if model.head is None:  # tied: the embedding table, [V, D]
        return model.embed.embedding[...], "vd"
    return model.head.kernel[...], "dv"  # the nnx.Linear(D, V) kernel, [D, V]


def loss_fn(model, tokens, mask, rewards):
    hidden = model(tokens[:, :-1])  # [B, T, D]; position t predicts token t + 1
    actions = tokens[:, 1:]  # [B, T]: the one-token shift
    weight, layout = lm_head(model)
    # One update per rollout: the sampling policy is the current one, without gradient.
    old_logp = jax.lax.stop_gradient(
        jk.linear_logprobs(hidden, weight, actions, weight_layout=layout)
    )
    loss, pg_loss, kl = jk.linear_grpo_loss(
        hidden,
        weight,
        actions,
        old_logp,
        rewards,
        mask,  # mask [B, T]: 1 on response tokens
        weight_layout=layout,
        groups=jk.Groups(size=GROUP),
        config=jk.PolicyLoss(clip_low=0.2, clip_high=0.28),
    )
    return loss


@nnx.jit
def train_step(model, optimizer, tokens, mask, rewards):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, mask, rewards)
    optimizer.update(model, grads)
    return loss


# [/train-step]


@nnx.jit
def rollout(model, prompts, key):
    """Sample GROUP answers per prompt; return (tokens [B, P + R], mask [B, P + R - 1], rewards)."""
    prompts = jnp.repeat(prompts, GROUP, axis=0)
    tokens = jnp.concatenate([prompts, jnp.zeros((prompts.shape[0], RESPONSE), prompts.dtype)], 1)
    weight, layout = lm_head(model)

    def sample_next(i, tokens):  # the sampler builds logits for one position at a time
        hidden = model(tokens)[:, PROMPT + i - 1]  # causal: later slots do not matter
        logits = hidden @ (weight.T if layout == "vd" else weight)
        return tokens.at[:, PROMPT + i].set(
            jax.random.categorical(jax.random.fold_in(key, i), logits)
        )

    tokens = jax.lax.fori_loop(0, RESPONSE, sample_next, tokens)
    answer = tokens[:, PROMPT:]
    after_eos = (jnp.cumsum(answer == EOS, axis=1) - (answer == EOS)) > 0
    answer_mask = (~after_eos).astype(jnp.float32)  # up to and including the first EOS
    rewards = jnp.sum(answer_mask * (answer % 2 == 0), axis=1) / RESPONSE
    # Aligned with actions = tokens[:, 1:]: action t is token t + 1, so the answer's first
    # token is action PROMPT - 1.
    mask = jnp.concatenate([jnp.zeros((tokens.shape[0], PROMPT - 1)), answer_mask], axis=1)
    return tokens, mask, rewards


def train(layout: str, steps: int, seed: int = 0) -> tuple[float, float]:
    """GRPO for ``steps`` steps; returns the mean reward of the first and the last 5 steps."""
    model = Decoder(tied=layout == "vd", rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    key = jax.random.key(seed)
    history = []
    for step in range(steps):
        key, prompt_key, sample_key = jax.random.split(key, 3)
        prompts = jax.random.randint(prompt_key, (PROMPTS, PROMPT), 2, VOCAB)
        tokens, mask, rewards = rollout(model, prompts, sample_key)
        if step == 0:  # which backend serves the loss on this machine, and why (shapes suffice)
            weight, layout_ = lm_head(model)
            hidden = jax.eval_shape(model, tokens[:, :-1])
            old_logp = jax.ShapeDtypeStruct(mask.shape, jnp.float32)
            print(
                jk.explain(
                    "linear_grpo_loss",
                    hidden,
                    weight,
                    tokens[:, 1:],
                    old_logp,
                    rewards,
                    mask,
                    weight_layout=layout_,
                    groups=jk.Groups(size=GROUP),
                )
            )
        loss = train_step(model, optimizer, tokens, mask, rewards)
        history.append(float(jnp.mean(rewards)))
        if step % 10 == 0 or step == steps - 1:
            print(
                f"[{layout}] step {step:3d}  loss {float(loss):+.4f}  mean reward {history[-1]:.3f}"
            )
    first, last = history[:5], history[-5:]
    return sum(first) / len(first), sum(last) / len(last)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--layout",
        choices=("vd", "dv", "both"),
        default="both",
        help="vd: tied embedding head [V, D]; dv: nnx.Linear head [D, V]",
    )
    args = parser.parse_args(argv)
    for layout in ("vd", "dv") if args.layout == "both" else (args.layout,):
        first, last = train(layout, args.steps)
        print(f"[{layout}] mean reward, first 5 steps {first:.3f} -> last 5 steps {last:.3f}")


if __name__ == "__main__":
    main()
