"""A small pre-LayerNorm causal transformer (Flax linen) that returns hidden states.

``CausalLM.apply(params, tokens[B, T]) -> hidden[B, T, D]`` after the final
LayerNorm. The language-model head is *not* applied by the model: its weight
(:func:`head_weight`) is handed to the ``jaxrl_kernels.linear_*`` ops, which
compute log-probabilities without materialising the [B, T, V] logits. With
``tie_embeddings`` the head is the token embedding, ``[V, D]`` (layout
``"vd"``); otherwise it is a separate ``[D, V]`` matrix (layout ``"dv"``, the
layout of an ``nn.Dense`` kernel).

Packed rows: ``CausalLM.apply(params, tokens, segment_ids)`` with ``segment_ids[B, T]``
(each sequence one contiguous run of equal ids; ``-1`` on padding) runs every sequence of a
row as if it were alone: position ``q`` attends to position ``k`` iff ``k <= q`` and
``segment_ids[k] == segment_ids[q]``, and the position id of ``t`` is ``t - start(t)``, the
offset from the start of its run (:func:`segment_positions`). Without ``segment_ids`` the
model is the plain causal one, unchanged.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def check_dims(d_model: int, layers: int, heads: int) -> None:
    """ValueError naming the field unless the sizes make a model: positive, heads divide d_model."""
    for name, value in (("d_model", d_model), ("layers", layers), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if d_model % heads:
        raise ValueError(
            f"d_model: expected a multiple of heads={heads} (each head gets "
            f"d_model / heads features), got {d_model}"
        )


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position ids ``t - start(t)`` [B, T], ``start(t)`` the first index of ``t``'s run of equal
    ids: ``start(t) = max{u <= t : u = 0 or ids[u] != ids[u - 1]}`` (a running max)."""
    t = jnp.arange(segment_ids.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]],
        axis=-1,
    )
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=segment_ids.ndim - 1)


class Block(nn.Module):
    d_model: int
    heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, qkv_features=self.d_model, deterministic=True
        )(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.mlp_ratio * self.d_model)(h)
        h = nn.Dense(self.d_model)(nn.gelu(h))
        return x + h


class CausalLM(nn.Module):
    vocab: int
    max_len: int
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    tie_embeddings: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        check_dims(self.d_model, self.layers, self.heads)
        t = tokens.shape[-1]
        x = nn.Embed(self.vocab, self.d_model, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d_model))
        if segment_ids is None:
            x = x + pos[:t]
            mask = nn.make_causal_mask(tokens)
        else:
            # A packed sequence's last token is read as an input (its prediction is masked), at
            # position max_len when the sequence is full length: clipped, since nothing of its
            # own or another sequence attends to it.
            x = x + pos[jnp.minimum(segment_positions(segment_ids), self.max_len - 1)]
            # Padding (-1) attends to padding only, so no row of the softmax is empty.
            same = nn.make_attention_mask(segment_ids, segment_ids, pairwise_fn=jnp.equal)
            mask = nn.combine_masks(nn.make_causal_mask(tokens), same)
        for i in range(self.layers):
            x = Block(self.d_model, self.heads, name=f"block{i}")(x, mask)
        if not self.tie_embeddings:
            self.param(
                "lm_head", nn.initializers.normal(self.d_model**-0.5), (self.d_model, self.vocab)
            )
        return nn.LayerNorm(name="final_norm")(x)


def head_weight(params, tie_embeddings: bool) -> tuple[jax.Array, str]:
    """The LM head weight and its layout for the ``linear_*`` ops."""
    p = params["params"]
    if tie_embeddings:
        return p["embed"]["embedding"], "vd"
    return p["lm_head"], "dv"


def logits(hidden: jax.Array, weight: jax.Array, layout: str) -> jax.Array:
    """Full logits ``hidden @ W^T`` (used only by the sampler, one position at a time)."""
    h = hidden.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    return h @ w.T if layout == "vd" else h @ w
