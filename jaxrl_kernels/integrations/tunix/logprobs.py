"""Per-token log-probs and entropies of a tunix causal LM, from its final hidden states.

tunix's policy losses get them from ``common.compute_per_token_logps(..., return_logits=True)``:
the model returns float32 [B, L, V] logits, which are cut to the completion, divided by the
temperature and log-softmaxed (the entropy is taken from the same logits). Here the same model
runs with ``output_hidden_states=True``; its final hidden states h [B, L, D] (after the final
norm) and its LM head W go to :func:`jaxrl_kernels.linear_logprobs`, which returns
log softmax(h·W / T)[target] and the entropy of softmax(h·W / T) in one pass, forward and
backward, without the [B, L, V] logits. The logits the model's forward still computes are never
read, so XLA removes them from the compiled program (``tests/integrations/test_tunix.py`` checks
this).

A model qualifies when its ``__call__`` takes ``output_hidden_states`` (tunix sows the final
hidden states as ``nnx.Intermediate`` "all_hidden_states") and its logits are a plain product
with either ``lm_head`` (an ``Einsum`` 'BTD,DV->BTV', weight [D, V], layout "dv") or the tied
embedding ``embedder.input_embedding`` ([V, D], layout "vd"): tunix's Qwen2, Qwen3, Gemma3 and
Gemma without a final soft-cap. Anything else raises ``NotImplementedError`` naming what is
missing; there is no fallback to the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.interpreters import pxla
from jax.sharding import PartitionSpec
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
        "Its log-probs need the model's [B, T, V] logits; use tunix's own loss for it."
    )


def _tied_flag(model):
    config = getattr(model, "config", None)
    for name in ("use_tied_embedding", "weight_tying"):
        if hasattr(config, name):
            return bool(getattr(config, name))
    return None


def _no_lora(model, module, where: str) -> None:
    if len(nnx.state(module, nnx.LoRAParam)):
        raise _unsupported(
            model,
            f"{where} carries LoRA parameters, so its logits are not one "
            "product with a single weight",
        )


def find_head(model) -> Head:
    """The LM head of a tunix model, or ``NotImplementedError`` saying why there is none."""
    softcap = getattr(model, "final_logits_softcap", None)
    if softcap is not None:
        raise _unsupported(
            model,
            f"final_logits_softcap = {softcap} maps its logits through tanh, "
            "and jaxrl_kernels' ops take log-softmax of a linear head",
        )
    tied = _tied_flag(model)
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and tied is not True:
        einsum = getattr(lm_head, "einsum_str", None)
        weight = getattr(lm_head, "w", None)
        if einsum != LM_HEAD_EINSUM or weight is None:
            raise _unsupported(
                model,
                f"its lm_head is not an Einsum {LM_HEAD_EINSUM!r} with "
                f"weight `w` (einsum_str={einsum!r})",
            )
        _no_lora(model, lm_head, "lm_head")
        return Head(_value(weight), "dv", getattr(lm_head, "dtype", None))
    embedder = getattr(model, "embedder", None)
    table = getattr(embedder, "input_embedding", None)
    if table is None:
        raise _unsupported(
            model,
            "it has neither an `lm_head` Einsum [D, V] nor a tied "
            "`embedder.input_embedding` [V, D]",
        )
    return Head(_value(table), "vd", getattr(embedder, "dtype", None))


def _call_parameters(model):
    try:
        return inspect.signature(type(model).__call__).parameters
    except (TypeError, ValueError):
        return {}


def check_model(model) -> None:
    """Raise ``NotImplementedError`` unless ``model`` exposes final hidden states and a head."""
    if "output_hidden_states" not in _call_parameters(model):
        raise _unsupported(
            model,
            "its __call__ takes no `output_hidden_states`, so its final "
            "hidden states cannot be read",
        )
    find_head(model)


def _model_kwargs(model, positions, attn_mask, pad_segments, segment_ids):
    """The keyword arguments tunix's compute_per_token_logps gives the model."""
    params = _call_parameters(model)
    kwargs = {
        "positions": positions,
        "cache": None,
        "attention_mask": attn_mask,
        "output_hidden_states": True,
    }
    takes_segments = "segment_ids" in params or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    if takes_segments:
        if segment_ids is not None:
            kwargs["segment_ids"] = segment_ids
        elif pad_segments is not None:
            kwargs["segment_ids"] = pad_segments
    return kwargs


def _context_mesh():
    """The mesh of the enclosing ``with mesh:`` (tunix's RLCluster) or ``jax.set_mesh``, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    mesh = pxla.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def _is_explicit_or_manual(mesh) -> bool:
    """Whether shardings are part of the types here: Explicit mesh axes, or inside shard_map."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return any(t == explicit for t in getattr(mesh, "axis_types", ())) or bool(
        getattr(mesh, "manual_axes", ())
    )


def head_layout(hidden):
    """``hidden`` [..., D] with D whole on every device and every other dimension left to
    XLA's sharding propagation; the constraint's transpose does the same to the cotangent.

    tunix's losses apply the LM head to these hidden states as an einsum, and the largest
    arrays of their step, the float32 [B, L, V] logits, are split by rows like the input
    tokens: where tunix splits a micro-batch's rows over a mesh axis, XLA keeps the model's
    activations split by rows and gathers the FSDP weights over D, and the RMSNorm scales'
    gradients stay as declared; where it does not (a micro-batch that does not divide the
    axis is replicated), XLA splits the activations over D like the weights, and those
    gradients, AdamW's update and the scales end sharded over the FSDP axis. Our losses never
    build the logits, and without this constraint XLA took the D split of the weights for the
    hidden states in both cases (every device then ran the whole micro-batch), so parameters
    ended laid out otherwise than under tunix's loss. With D whole at the head, which gathers a
    split D anyway, the layouts are tunix's (tests/integrations/test_tunix_learners.py compares
    every parameter's final sharding). Does nothing outside a mesh, under Explicit axes and inside
    ``shard_map``, where shardings are part of the types.
    """
    mesh = _context_mesh()
    if mesh is None or _is_explicit_or_manual(mesh):
        return hidden
    spec = PartitionSpec(*([PartitionSpec.UNCONSTRAINED] * (hidden.ndim - 1)), None)
    return jax.lax.with_sharding_constraint(hidden, spec)


def final_hidden_states(model, input_tokens, kwargs):
    """(hidden [B, L, D], head) of a copy of ``model`` run on ``input_tokens``, the hidden
    states laid out for the head (:func:`head_layout`).

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
    return head_layout(_value(sown[HIDDEN_STATES])[-1]), head


def tunix_temperature(temperature) -> float:
    """tunix divides the logits by the temperature unless it is 0 or 1."""
    return 1.0 if temperature in (0.0, 1.0) else float(temperature)


@dataclasses.dataclass(frozen=True)
class HeadRows:
    """What the policy's log-probs are taken from: the final hidden states of the positions
    that predict the completion (or, packed, every next token), the LM head, the targets."""

    hidden: jax.Array  # [B, K, D] in the head's dtype
    weight: jax.Array  # [V, D] ("vd") or [D, V] ("dv")
    layout: str
    targets: jax.Array  # [B, K]
    packed: bool  # K = L - 1: the outputs get position 0 back (logp 0, entropy log V)

    def pad(self, logp, entropy):
        """tunix's layout of (logp, entropy | None): packed, position 0 holds logp = 0 and the
        entropy of all-zero logits, log V."""
        if not self.packed:
            return logp, entropy
        vocab = self.weight.shape[0 if self.layout == "vd" else 1]
        logp = jnp.pad(logp, ((0, 0), (1, 0)))
        if entropy is not None:
            entropy = jnp.pad(
                entropy, ((0, 0), (1, 0)), constant_values=jnp.log(jnp.float32(vocab))
            )
        return logp, entropy

    def pad_kept(self, kept):
        """``kept`` (target inside its row's kept set) in tunix's layout: packed, position 0
        (no target) counts as kept."""
        return jnp.pad(kept, ((0, 0), (1, 0)), constant_values=True) if self.packed else kept


def policy_head_rows(
    model,
    prompt_tokens,
    completion_tokens,
    *,
    pad_id,
    eos_id,
    segment_ids=None,
    segment_positions=None,
) -> HeadRows:
    """The model's forward up to its final hidden states, and what the head's log-probs of the
    completion (or of a packed sequence's next tokens) need (:class:`HeadRows`)."""
    check_model(model)
    input_tokens, positions, attn_mask, pad_segments = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions
    )
    kwargs = _model_kwargs(model, positions, attn_mask, pad_segments, segment_ids)
    hidden, head = final_hidden_states(model, input_tokens, kwargs)
    packed = segment_ids is not None
    keep = input_tokens.shape[1] - 1 if packed else completion_tokens.shape[1]
    dtype = head.dtype if head.dtype is not None else jnp.result_type(hidden, head.weight)
    return HeadRows(
        hidden[:, -keep - 1 : -1].astype(dtype),
        head.weight.astype(dtype),
        head.layout,
        input_tokens[:, -keep:],
        packed,
    )


def policy_logprobs(
    model,
    prompt_tokens,
    completion_tokens,
    *,
    pad_id,
    eos_id,
    segment_ids=None,
    segment_positions=None,
    temperature=1.0,
    return_entropy=False,
    backend=None,
    memory=None,
    sampler=None,
):
    """tunix's ``compute_per_token_logps(..., return_logits=True)`` without the logits.

    Returns (logp, entropy or None), float32 [B, C] for completions of length C, or [B, L]
    for packed sequences (``segment_ids`` given), where position 0 holds logp = 0 and the
    entropy of all-zero logits, log V, as tunix pads them.
    ``memory``: ``linear_logprobs``' memory mode (``"fast"`` keeps the logits for the backward;
    ``None``: ``jk.memory_mode``'s, else ``JAXRL_KERNELS_MEMORY``'s, else ``"auto"``).
    ``sampler``: a ``jk.Sampler``, the sampler's truncation, as in ``jk.linear_logprobs``
    (None, the default: tunix's log-probs of the whole vocabulary); the log-probs and entropy
    are then those of the truncated, renormalised distribution (sampler matching,
    :mod:`.sampler`).
    """
    rows = policy_head_rows(
        model,
        prompt_tokens,
        completion_tokens,
        pad_id=pad_id,
        eos_id=eos_id,
        segment_ids=segment_ids,
        segment_positions=segment_positions,
    )
    out = jk.linear_logprobs(
        rows.hidden,
        rows.weight,
        rows.targets,
        weight_layout=rows.layout,
        temperature=tunix_temperature(temperature),
        return_entropy=return_entropy,
        backend=backend,
        memory=memory,
        sampler=sampler,
    )
    return rows.pad(*(out if return_entropy else (out, None)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "pad_id",
        "eos_id",
        "stop_gradient",
        "return_logits",
        "temperature",
        "backend",
        "sampler",
    ),
)
def compute_per_token_logps(
    graphdef,
    state,
    prompt_tokens,
    completion_tokens,
    pad_id,
    eos_id,
    images=None,
    stop_gradient=True,
    return_logits=False,
    segment_ids=None,
    segment_positions=None,
    temperature=1.0,
    backend=None,
    sampler=None,
):
    """tunix's ``common.compute_per_token_logps`` (same arguments, same result) without logits.

    The per-token log-probs of the completion under ``nnx.merge(graphdef, state)``, float32
    [B, C] ([B, L] for packed sequences), from the final hidden states and the LM head by
    :func:`jaxrl_kernels.linear_logprobs`: the compiled program holds no [B, T, V] logits (the
    model's own logits are computed by nothing that is read, and XLA drops them). This is
    what tunix's reference-model and rollout-policy passes call once
    :func:`jaxrl_kernels.integrations.tunix.use_kernel_logprobs` is enabled on an RLCluster.

    ``return_logits=True`` and ``images`` are refused (NotImplementedError): both need the
    logits. ``backend``: jaxrl_kernels' backend (None: automatic). ``sampler`` (not tunix's;
    None by default): a ``jk.Sampler``, the log-probs of the sampler's truncated,
    renormalised distribution instead (:func:`policy_logprobs`; sampler matching).
    """
    if return_logits:
        raise NotImplementedError(
            "compute_per_token_logps(return_logits=True): the logits are what this function "
            "never builds; use tunix.rl.common.compute_per_token_logps"
        )
    if images is not None:
        raise NotImplementedError(
            "compute_per_token_logps(images=...): multimodal inputs are not supported; use "
            "tunix.rl.common.compute_per_token_logps"
        )
    model = nnx.merge(graphdef, state)
    logp, _ = policy_logprobs(
        model,
        prompt_tokens,
        completion_tokens,
        pad_id=pad_id,
        eos_id=eos_id,
        segment_ids=segment_ids,
        segment_positions=segment_positions,
        temperature=temperature,
        backend=backend,
        sampler=sampler,
    )
    return jax.lax.stop_gradient(logp) if stop_gradient else logp
