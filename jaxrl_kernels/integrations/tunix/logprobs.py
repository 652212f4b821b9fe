"""Per-token log-probs and entropies of a tunix causal LM, from its final hidden states.

tunix's policy losses get them from ``common.compute_per_token_logps(..., return_logits=True)``:
the model returns float32 [B, L, V] logits, which are cut to the completion, divided by the
temperature and log-softmaxed (the entropy is taken from the same logits). Here the same model
runs with ``output_hidden_states=True``; its final hidden states h [B, L, D] (after the final
norm) and its LM head W go to :func:`jaxrl_kernels.linear_logprobs`, which returns
log softmax(h·W / T)[target] and the entropy of softmax(h·W / T) in one pass, forward and
backward, without the [B, L, V] logits. The logits the model's forward still computes are never
read, so XLA removes them from the compiled program (``tests/test_tunix.py`` checks this).

A model qualifies when its ``__call__`` takes ``output_hidden_states`` (tunix sows the final
hidden states as ``nnx.Intermediate`` "all_hidden_states") and its logits are a plain product
with either ``lm_head`` (an ``Einsum`` 'BTD,DV->BTV', weight [D, V], layout "dv") or the tied
embedding ``embedder.input_embedding`` ([V, D], layout "vd"): tunix's Qwen2, Qwen3, Gemma3 and
Gemma without a final soft-cap. Anything else raises ``NotImplementedError`` naming what is
missing; there is no fallback to the logits.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax.numpy as jnp
from flax import nnx
from tunix.rl import common

import jaxrl_kernels as jk

HIDDEN_STATES = "all_hidden_states"
"""The name under which tunix models sow their final hidden states."""

LM_HEAD_EINSUM = "BTD,DV->BTV"


@dataclasses.dataclass(frozen=True)
class Head:
    """An LM head: logits = cast(h) · cast(W) (W^T for "vd"), cast to ``dtype`` when given."""

    weight: Any
    layout: str
    dtype: Any


def _value(variable):
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _unsupported(model, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"jaxrl_kernels.integrations.tunix: cannot serve {type(model).__name__}: {what}. "
        "Its log-probs need the model's [B, T, V] logits; use tunix's own loss for it.")


def _tied_flag(model):
    config = getattr(model, "config", None)
    for name in ("use_tied_embedding", "weight_tying"):
        if hasattr(config, name):
            return bool(getattr(config, name))
    return None


def _no_lora(model, module, where: str) -> None:
    if len(nnx.state(module, nnx.LoRAParam)):
        raise _unsupported(model, f"{where} carries LoRA parameters, so its logits are not one "
                                  "product with a single weight")


def find_head(model) -> Head:
    """The LM head of a tunix model, or ``NotImplementedError`` saying why there is none."""
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is not None:
        raise _unsupported(model, f"final_logits_softcap = {softcap} maps its logits through tanh, "
                                  "and jaxrl_kernels' ops take log-softmax of a linear head")
    tied = _tied_flag(model)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and tied is not True:
        einsum = getattr(lm_head, "einsum_str", None)
        weight = getattr(lm_head, "w", None)
        if einsum != LM_HEAD_EINSUM or weight is None:
            raise _unsupported(model, f"its lm_head is not an Einsum {LM_HEAD_EINSUM!r} with "
                                      f"weight `w` (einsum_str={einsum!r})")
        _no_lora(model, lm_head, "lm_head")
        return Head(_value(weight), "dv", getattr(lm_head, "dtype", None))
    embedder = getattr(model, "embedder", None)
    table = getattr(embedder, "input_embedding", None)
    if table is None:
        raise _unsupported(model, "it has neither an `lm_head` Einsum [D, V] nor a tied "
                                  "`embedder.input_embedding` [V, D]")
    return Head(_value(table), "vd", getattr(embedder, "dtype", None))


def _call_parameters(model):
    try:
        return inspect.signature(type(model).__call__).parameters
    except (TypeError, ValueError):
        return {}


def check_model(model) -> None:
    """Raise ``NotImplementedError`` unless ``model`` exposes final hidden states and a head."""
    if "output_hidden_states" not in _call_parameters(model):
        raise _unsupported(model, "its __call__ takes no `output_hidden_states`, so its final "
                                  "hidden states cannot be read")
    find_head(model)


def _model_kwargs(model, positions, attn_mask, pad_segments, segment_ids):
    """The keyword arguments tunix's compute_per_token_logps gives the model."""
    params = _call_parameters(model)
    kwargs = {"positions": positions, "cache": None, "attention_mask": attn_mask,
              "output_hidden_states": True}
    takes_segments = "segment_ids" in params or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_segments:
        if segment_ids is not None:
            kwargs["segment_ids"] = segment_ids
        elif pad_segments is not None:
            kwargs["segment_ids"] = pad_segments
    return kwargs


def final_hidden_states(model, input_tokens, kwargs):
    """(hidden [B, L, D], head) of a copy of ``model`` run on ``input_tokens``.

    The copy shares the model's arrays (gradients reach them) but not its Python objects, so
    the caller's module is left as it was.
    """
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    head = find_head(copy)
    if hasattr(nnx, "capture"):  # flax >= 0.12.x: sow() is meant to run inside capture()
        _, sown = nnx.capture(copy, nnx.Intermediate)(input_tokens, **kwargs)
    else:
        copy(input_tokens, **kwargs)
        sown = nnx.pop(copy, nnx.Intermediate)
    if HIDDEN_STATES not in sown:
        raise _unsupported(model, f"output_hidden_states=True sowed no {HIDDEN_STATES!r}")
    return _value(sown[HIDDEN_STATES])[-1], head


def tunix_temperature(temperature) -> float:
    """tunix divides the logits by the temperature unless it is 0 or 1."""
    return 1.0 if temperature in (0.0, 1.0) else float(temperature)


def policy_logprobs(model, prompt_tokens, completion_tokens, *, pad_id, eos_id,
                    segment_ids=None, segment_positions=None, temperature=1.0,
                    return_entropy=False, backend=None):
    """tunix's ``compute_per_token_logps(..., return_logits=True)`` without the logits.

    Returns (logp, entropy or None), float32 [B, C] for completions of length C, or [B, L]
    for packed sequences (``segment_ids`` given), where position 0 holds logp = 0 and the
    entropy of all-zero logits, log V, as tunix pads them.
    """
    check_model(model)
    input_tokens, positions, attn_mask, pad_segments = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions)
    kwargs = _model_kwargs(model, positions, attn_mask, pad_segments, segment_ids)
    hidden, head = final_hidden_states(model, input_tokens, kwargs)
    packed = segment_ids is not None
    keep = input_tokens.shape[1] - 1 if packed else completion_tokens.shape[1]
    hidden = hidden[:, -keep - 1:-1]
    targets = input_tokens[:, -keep:]
    dtype = head.dtype if head.dtype is not None else jnp.result_type(hidden, head.weight)
    out = jk.linear_logprobs(hidden.astype(dtype), head.weight.astype(dtype), targets,
                             weight_layout=head.layout, temperature=tunix_temperature(temperature),
                             return_entropy=return_entropy, backend=backend)
    logp, entropy = out if return_entropy else (out, None)
    if packed:
        vocab = head.weight.shape[0 if head.layout == "vd" else 1]
        logp = jnp.pad(logp, ((0, 0), (1, 0)))
        if entropy is not None:
            entropy = jnp.pad(entropy, ((0, 0), (1, 0)),
                              constant_values=jnp.log(jnp.float32(vocab)))
    return logp, entropy
