"""A tiny Flax (linen) causal LM trained with optax.adam in a jitted step: once with
linear_ppo_loss on its hidden states and LM head, once with grpo_loss on its logits. The loss
decreases over 20 steps, and the gradients equal the reference backend's."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxrl_kernels as jk

VOCAB, DIM, B, T = 32, 16, 8, 10
GROUP = 4
STEPS = 20


class TinyLM(nn.Module):
    """Embedding, one causal self-attention block and an MLP block, and a Dense LM head."""

    def setup(self):
        self.embed = nn.Embed(VOCAB, DIM)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(), nn.LayerNorm(), nn.LayerNorm()
        self.attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=DIM)
        self.up, self.down = nn.Dense(2 * DIM), nn.Dense(DIM)
        self.head = nn.Dense(VOCAB)  # kernel [D, V]: weight_layout="dv"

    def hidden(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x), mask=nn.make_causal_mask(tokens))
        x = x + self.down(nn.gelu(self.up(self.ln2(x))))
        return self.ln3(x)

    def __call__(self, tokens):
        return self.head(self.hidden(tokens))


MODEL = TinyLM()


@functools.lru_cache(maxsize=1)
def _setup():
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (B, T + 1)), jnp.int32)
    params = jax.jit(MODEL.init)(jax.random.PRNGKey(0), tokens[:, :-1])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert 1000 < n_params < 10000, n_params
    inputs, actions = tokens[:, :-1], tokens[:, 1:]
    mask = np.ones((B, T), np.float32)
    mask[1, T // 2 :] = 0  # a shorter sequence
    mask[5, :] = 0  # an empty one
    logits0 = jax.jit(MODEL.apply)(params, inputs)
    old_logp = jax.jit(lambda l: jk.token_logprobs(l, actions, backend="reference"))(logits0)
    # reward: how often the sequence picks an even token
    even = np.mean(np.asarray(actions) % 2 == 0, axis=1)
    rewards = jnp.asarray(even + 0.1 * rng.standard_normal(B), jnp.float32)
    return params, inputs, actions, jnp.asarray(mask), old_logp, rewards, logits0


def _ppo_loss_fn(backend, inputs, actions, mask, old_logp, rewards):
    adv = jk.group_advantages(rewards, group_size=GROUP)

    def loss_fn(params):
        hidden = MODEL.apply(params, inputs, method=TinyLM.hidden)
        head = params["params"]["head"]
        loss, metrics = jk.linear_ppo_loss(
            hidden,
            head["kernel"],
            actions,
            old_logp,
            adv,
            mask,
            bias=head["bias"],
            weight_layout="dv",
            entropy_coef=0.01,
            backend=backend,
        )
        return loss, metrics

    return loss_fn


def _grpo_loss_fn(backend, inputs, actions, mask, old_logp, rewards, ref_logits):
    def loss_fn(params):
        logits = MODEL.apply(params, inputs)
        loss, policy_loss, kl = jk.grpo_loss(
            logits,
            ref_logits,
            actions,
            old_logp,
            rewards,
            mask,
            group_size=GROUP,
            beta=0.04,
            backend=backend,
        )
        return loss, (policy_loss, kl)

    return loss_fn


@functools.cache
def _train(kind, backend):
    """20 jitted adam steps from the same start; returns the losses and the first gradient."""
    params, inputs, actions, mask, old_logp, rewards, logits0 = _setup()
    if kind == "ppo":
        loss_fn = _ppo_loss_fn(backend, inputs, actions, mask, old_logp, rewards)
    else:
        loss_fn = _grpo_loss_fn(backend, inputs, actions, mask, old_logp, rewards, logits0)
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    losses, first_grads = [], None
    for _ in range(STEPS):
        params, state, loss, grads = step(params, state)
        first_grads = grads if first_grads is None else first_grads
        losses.append(float(loss))
    return np.asarray(losses), first_grads


def _grads_match_reference(kind, backend):
    """The gradient of the loss w.r.t. every parameter equals the reference backend's."""
    g = _train(kind, backend)[1]
    g_ref = _train(kind, "reference")[1]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_ref))
    assert scale > 0 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_ref)):
        err = float(jnp.max(jnp.abs(a - b)))
        # both within 1e-5 (docs/api.md, f32) of the exact gradient: they differ by at most ~2e-5
        assert err <= 2e-5 * scale, f"{jax.tree_util.keystr(path)}: |g - g_ref| = {err:.3e}"


def _assert_decreases(losses):
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < losses[0] - 1e-3, f"loss did not decrease: {losses}"
    assert losses[-5:].mean() < losses[:5].mean(), f"loss did not decrease: {losses}"


def test_linear_ppo_loss_train_step(backend):
    _assert_decreases(_train("ppo", backend)[0])
    _grads_match_reference("ppo", backend)


def test_grpo_loss_train_step(backend):
    _assert_decreases(_train("grpo", backend)[0])
    _grads_match_reference("grpo", backend)
