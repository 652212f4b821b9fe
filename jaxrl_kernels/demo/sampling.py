"""An autoregressive sampler written as one ``lax.scan`` (jittable, fixed shapes).

Given prompts ``x[B, P]`` it draws ``max_new`` tokens, step ``i`` from
``softmax(logits_i / temperature)`` (or the argmax in the rows where ``greedy``),
and
returns the tokens, the sampler's own log-probabilities
``log softmax(logits_i / temperature)[token]`` (the ``rollout_logp`` of
truncated importance sampling) and a mask that is 1 up to and including the
first ``EOS``. After ``EOS`` the tokens are ``PAD`` with log-prob 0.

The buffer ``[B, P + max_new]`` has a fixed shape and every step re-runs the
(causal) model over it and reads the position that predicts the next token:
for answers of a few tokens and a model this small that costs less than the
bookkeeping of a key/value cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.demo import model as model_lib
from jaxrl_kernels.demo.task import EOS, PAD


def generate(
    lm: model_lib.CausalLM,
    params,
    prompts: jax.Array,
    key: jax.Array,
    *,
    max_new: int,
    temperature: float = 1.0,
    greedy: bool | jax.Array = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample answers; returns ``(tokens[B, max_new], logp[B, max_new], mask[B, max_new])``.

    ``greedy`` is a bool or a bool [B] choosing argmax decoding per row (greedy rows
    report the temperature-1 log-prob of their token).
    """
    batch, plen = prompts.shape
    greedy = jnp.broadcast_to(jnp.asarray(greedy, bool), (batch,))
    temp = jnp.where(greedy, 1.0, temperature)[:, None]
    total = plen + max_new
    buf = jnp.concatenate([prompts, jnp.full((batch, max_new), PAD, prompts.dtype)], axis=1)
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)

    def step(carry, i):
        buf, done = carry
        hidden = lm.apply(params, buf[:, : total - 1])
        h = jax.lax.dynamic_index_in_dim(hidden, plen - 1 + i, axis=1, keepdims=False)
        z = model_lib.logits(h, weight, layout) / temp
        drawn = jax.random.categorical(jax.random.fold_in(key, i), z, axis=-1)
        tok = jnp.where(greedy, jnp.argmax(z, axis=-1), drawn)
        logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tok[:, None], axis=-1)[:, 0]
        tok = jnp.where(done, PAD, tok).astype(prompts.dtype)
        logp = jnp.where(done, 0.0, logp)
        valid = ~done
        buf = jax.lax.dynamic_update_index_in_dim(buf, tok, plen + i, axis=1)
        return (buf, done | (tok == EOS)), (tok, logp, valid)

    init = (buf, jnp.zeros((batch,), bool))
    _, (tokens, logp, valid) = jax.lax.scan(step, init, jnp.arange(max_new))
    return tokens.T, logp.T, valid.T.astype(jnp.float32)
