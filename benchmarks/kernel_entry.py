"""One backend's kernels alone, forward and backward, under a given tuning: the log-prob ops
built straight from a backend's ``logprob_core.Parts``, past dispatch (the public ops choose
their backward through it). For the tests and benchmarks of the kernels.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.backends.pallas import linear as pallas_linear
from jaxrl_kernels.backends.pallas import logits as pallas_logits
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.engine import linear_head, logprob_core


def _call(weight_layout, temperature, return_entropy):
    return linear_head.HeadCall(
        weight_layout=weight_layout,
        temperature=float(temperature),
        return_entropy=bool(return_entropy),
    )


def ffi_linear_logprobs(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    return_entropy,
    config=None,
):
    """(logp [N], entropy [N] | None) of [N, D] hidden states through the SM90 kernels alone,
    forward and backward, under ``config`` (an ``ffi.linear.Config``)."""
    config = config or ffi_linear.DEFAULT_CONFIG
    parts = Parts(
        functools.partial(ffi_linear.linear_stats, config=config),
        functools.partial(ffi_linear.linear_backward, config=config),
    )
    return linear_head.linear_from_parts(
        parts,
        hidden,
        weight,
        bias,
        targets.astype(jnp.int32),
        row_valid,
        _call(weight_layout, temperature, return_entropy),
    )


def pallas_linear_logprobs(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    return_entropy,
    config=None,
):
    """(logp [N], entropy [N] | None) of [N, D] hidden states through the Pallas linear-head
    kernels under ``config`` (a ``pallas.linear.Config``)."""
    return linear_head.linear_from_parts(
        pallas_linear.kernel_parts(config),
        hidden,
        weight,
        bias,
        targets.astype(jnp.int32),
        row_valid,
        _call(weight_layout, temperature, return_entropy),
    )


def pallas_token_logprobs(
    logits,
    targets,
    row_valid,
    *,
    temperature=1.0,
    return_entropy=False,
    plan: pallas_logits.LogitsLaunch | None = None,
):
    """The Pallas logits kernels' ``token_logprobs`` on [N, V] logits under ``plan``:
    ``(logp [N], entropy [N] | None)``."""
    return logprob_core.token_from_parts(
        pallas_logits.kernel_parts(plan),
        logits,
        targets.astype(jnp.int32),
        row_valid.astype(jnp.bool_),
        temperature=float(temperature),
        return_entropy=bool(return_entropy),
    )


def pallas_paired_logprobs(
    policy_logits,
    ref_logits,
    targets,
    row_valid,
    *,
    temperature=1.0,
    plan: pallas_logits.LogitsLaunch | None = None,
):
    """The Pallas logits kernels' ``paired_logprobs`` under ``plan``: ``(logp [N], ref_logp
    [N])``, gradient to the policy only."""
    return logprob_core.paired_from_parts(
        pallas_logits.kernel_parts(plan, paired=True),
        policy_logits,
        ref_logits,
        targets.astype(jnp.int32),
        row_valid.astype(jnp.bool_),
        temperature=float(temperature),
    )
