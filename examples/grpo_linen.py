"""GRPO with jaxrl_kernels inside a Flax linen + Optax train step, on a small decoder.

    python examples/grpo_linen.py               # both head layouts, 40 steps each
    python examples/grpo_linen.py --layout dv --steps 100

The same task and train step as examples/grpo_nnx.py (read its docstring for where hidden
states, head weight, the one-token shift, the mask and the old log-probs come from), with a
linen model: ``model.apply(params, tokens)`` returns the hidden states, and the head weight
is read from ``params``: the tied ``nn.Embed`` table ``["embed"]["embedding"]`` is [V, D]
(``weight_layout="vd"``), an ``nn.Dense(V)`` kernel ``["head"]["kernel"]`` is [D, V] (``"dv"``).
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxrl_kernels as jk

VOCAB, DIM, PROMPT, RESPONSE = 32, 32, 4, 6
PROMPTS, GROUP = 4, 8  # B = PROMPTS * GROUP sequences per step
EOS = 1


class Decoder(nn.Module):
    """Token embedding, one pre-norm causal attention + MLP block, a final norm. With
    ``tied=False`` it also owns an LM-head kernel, which ``__call__`` does not apply."""

    tied: bool

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> hidden states [B, T, D]."""
        x = nn.Embed(VOCAB, DIM, name="embed")(tokens)  # table [V, D]
        x = x + 0.1 * jnp.sin(jnp.arange(tokens.shape[1])[:, None] + jnp.arange(DIM))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(2)(h, h, mask=nn.make_causal_mask(tokens))
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))
        if not self.tied:
            nn.Dense(VOCAB, use_bias=False, name="head")(x[:, :0])  # creates kernel [D, V]
        return nn.LayerNorm()(x)


def lm_head(params) -> tuple[jax.Array, str]:
    """The LM-head weight in ``params`` and its layout for jaxrl_kernels' linear ops."""
    p = params["params"]
    if "head" in p:
        return p["head"]["kernel"], "dv"  # nn.Dense kernel [D, V]
    return p["embed"]["embedding"], "vd"  # tied embedding table [V, D]


def make_train_step(model, optimizer):
    def loss_fn(params, tokens, mask, rewards):
        hidden = model.apply(params, tokens[:, :-1])  # [B, T, D]; position t predicts t + 1
        actions = tokens[:, 1:]  # [B, T]: the one-token shift
        weight, layout = lm_head(params)
        old_logp = jax.lax.stop_gradient(  # one update per rollout
            jk.linear_logprobs(hidden, weight, actions, weight_layout=layout)
        )
        loss, pg_loss, kl = jk.linear_grpo_loss(
            hidden,
            weight,
            actions,
            old_logp,
            rewards,
            mask,
            weight_layout=layout,
            groups=jk.Groups(size=GROUP),
            config=jk.PolicyLoss(clip_low=0.2, clip_high=0.28),
        )
        return loss

    @jax.jit
    def train_step(params, opt_state, tokens, mask, rewards):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, rewards)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_rollout(model):
    @jax.jit
    def rollout(params, prompts, key):
        """GROUP answers per prompt: (tokens [B, P + R], mask [B, P + R - 1], rewards [B])."""
        prompts = jnp.repeat(prompts, GROUP, axis=0)
        tokens = jnp.concatenate(
            [prompts, jnp.zeros((prompts.shape[0], RESPONSE), prompts.dtype)], 1
        )
        weight, layout = lm_head(params)

        def sample_next(i, tokens):
            hidden = model.apply(params, tokens)[:, PROMPT + i - 1]
            logits = hidden @ (weight.T if layout == "vd" else weight)
            token = jax.random.categorical(jax.random.fold_in(key, i), logits)
            return tokens.at[:, PROMPT + i].set(token)

        tokens = jax.lax.fori_loop(0, RESPONSE, sample_next, tokens)
        answer = tokens[:, PROMPT:]
        after_eos = (jnp.cumsum(answer == EOS, axis=1) - (answer == EOS)) > 0
        answer_mask = (~after_eos).astype(jnp.float32)
        rewards = jnp.sum(answer_mask * (answer % 2 == 0), axis=1) / RESPONSE
        mask = jnp.concatenate([jnp.zeros((tokens.shape[0], PROMPT - 1)), answer_mask], axis=1)
        return tokens, mask, rewards

    return rollout


def train(layout: str, steps: int, seed: int = 0) -> tuple[float, float]:
    """GRPO for ``steps`` steps; returns the mean reward of the first and the last 5 steps."""
    model = Decoder(tied=layout == "vd")
    key = jax.random.key(seed)
    params = model.init(key, jnp.zeros((1, PROMPT + RESPONSE), jnp.int32))
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)
    train_step, rollout = make_train_step(model, optimizer), make_rollout(model)
    history = []
    for step in range(steps):
        key, prompt_key, sample_key = jax.random.split(key, 3)
        prompts = jax.random.randint(prompt_key, (PROMPTS, PROMPT), 2, VOCAB)
        tokens, mask, rewards = rollout(params, prompts, sample_key)
        params, opt_state, loss = train_step(params, opt_state, tokens, mask, rewards)
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
        help="vd: tied embedding head [V, D]; dv: nn.Dense head [D, V]",
    )
    args = parser.parse_args(argv)
    for layout in ("vd", "dv") if args.layout == "both" else (args.layout,):
        first, last = train(layout, args.steps)
        print(f"[{layout}] mean reward, first 5 steps {first:.3f} -> last 5 steps {last:.3f}")


if __name__ == "__main__":
    main()
