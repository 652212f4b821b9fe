"""The GRPO step on packed rollouts (``--pack``), and its timing against the padded layout.

A step samples and scores exactly as the padded step (:func:`rl_step.rollout`, same keys),
packs the completions on the host (:func:`packing.pack`: rows of ``pack_len`` tokens,
several completions each) and runs one jitted update on the packed rows:

    hidden = model(tokens[:, :-1], segment_ids)       # segment-aware attention and positions
    loss   = linear_grpo_loss(hidden, W / temperature, tokens[:, 1:], old_logp, rewards[S],
                              mask, segment_ids=segment_ids, num_segments=S, groups=size G)

with ``S = B`` rollouts, segment ``i`` = rollout ``i``, so ``rewards`` and the groups are the
padded batch's. Each sequence sees only itself (attention and positions restart at its
start), its mask is its answer tokens' (0 on the prompt and on its last position), and the
library's per-segment sums replace the per-row ones: the loss and its gradient are the padded
step's up to float32 summation order (``tests/demo/test_demo.py`` checks it).
``seq_mean_token_sum_norm`` divides by the padded layout's answer length ``max_new``, given
as ``max_len`` (the packed row length is no sequence's length).

The host packing makes the number of rows ``R`` data dependent: the update compiles once per
``R`` that occurs (a few over a run, since the total length of a step's completions varies
little), and the sampler and the update are two jitted calls instead of one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxrl_kernels as jk
from jaxrl_kernels.demo import algos, packing, rl_losses, rl_step
from jaxrl_kernels.demo import model as model_lib
from jaxrl_kernels.demo.task import AdditionTask

PACKED_KEYS = ("tokens", "segment_ids", "mask", "rollout_logp")
"""The packed arrays the jitted update takes (with the rollouts' ``rewards`` [S])."""


def packed_logprobs(lm, params, data, *, temperature=1.0, backend=None):
    """Log-probs [R, C - 1] of each packed row's next tokens under ``params``."""
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)
    hidden = lm.apply(params, data["tokens"][:, :-1], data["segment_ids"])
    return jk.linear_logprobs(
        hidden,
        weight,
        data["tokens"][:, 1:],
        weight_layout=layout,
        temperature=temperature,
        backend=backend,
    )


def packed_grpo_loss(lm, cfg, params, data, ref_logp, *, max_len: int):
    """:func:`rl_losses.grpo_loss` on packed rows: ``(loss, {"policy_loss", "kl"})``."""
    weight, layout = model_lib.head_weight(params, lm.tie_embeddings)
    weight = weight / cfg.temperature
    tokens, ids = data["tokens"], data["segment_ids"]
    hidden = lm.apply(params, tokens[:, :-1], ids)
    actions = tokens[:, 1:]
    sg = jax.lax.stop_gradient
    old_logp = sg(
        jk.linear_logprobs(
            sg(hidden), sg(weight), actions, weight_layout=layout, backend=cfg.backend
        )
    )
    config = cfg.loss_config()
    if config.loss_agg_mode == "seq_mean_token_sum_norm":
        config = dataclasses.replace(config, max_len=max_len)
    loss, policy_loss, kl = jk.linear_grpo_loss(
        hidden,
        weight,
        actions,
        old_logp,
        data["rewards"],
        data["mask"],
        segment_ids=ids,
        num_segments=data["rewards"].shape[0],
        weight_layout=layout,
        ref_logp=ref_logp,
        rollout_logp=None if cfg.rollout_correction == "none" else data["rollout_logp"],
        groups=jk.Groups(size=cfg.group_size),
        config=config,
        backend=cfg.backend,
    )
    return loss, {"policy_loss": policy_loss, "kl": kl}


def loss_fns(lm, cfg: algos.RLConfig, max_len: int) -> tuple[Callable, Callable]:
    """``(padded, packed)``: ``fn(params, ref_params, data) -> (loss, extra)`` of each layout;
    ``padded`` is the padded step's loss exactly (:func:`rl_losses.grpo_loss`)."""

    def padded(params, ref_params, batch):
        ref_logp = rl_step.reference_logp(lm, ref_params, batch, cfg)
        return rl_losses.grpo_loss(lm, cfg, params, batch, ref_logp)

    def packed(params, ref_params, data):
        ref_logp = None
        if cfg.kl_coef != 0.0:
            ref_logp = jax.lax.stop_gradient(
                packed_logprobs(
                    lm, ref_params, data, temperature=cfg.temperature, backend=cfg.backend
                )
            )
        return packed_grpo_loss(lm, cfg, params, data, ref_logp, max_len=max_len)

    return padded, packed


def _update_program(loss_fn, optimizer) -> Callable:
    """Jitted ``(state, data) -> (state, loss, extra)``: one optimizer update by ``loss_fn``."""

    @jax.jit
    def update(state, data):
        (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["ref_params"], data
        )
        params, opt_state = rl_step.apply_updates(
            optimizer, state["params"], state["opt_state"], grads
        )
        return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), loss, extra

    return update


class PackedStep:
    """The ``--pack`` RL step ``(state, prompts[n, P], sums[n], key) -> (state, metrics)``.

    Its metrics are the padded step's plus ``rows`` (R), ``pad_padded`` and ``pad_packed``
    (the padding fraction of each layout, :func:`packing.padding_fraction`).
    """

    def __init__(self, lm, task: AdditionTask, optimizer, cfg: algos.RLConfig, pack_len: int):
        if cfg.algo != "grpo":
            raise ValueError(f"pack: only --algo grpo packs its rollouts, got {cfg.algo!r}")
        self.task, self.pack_len = task, pack_len
        self.rollout = jax.jit(
            lambda params, prompts, sums, key: rl_step.rollout(
                lm, task, cfg, params, prompts, sums, key
            )[:2]
        )
        padded, packed = loss_fns(lm, cfg, task.max_new)
        self.padded_update = _update_program(padded, optimizer)
        self.packed_update = _update_program(packed, optimizer)

    def layouts(self, batch) -> tuple[dict, dict, dict[str, float]]:
        """``(padded, packed, stats)``: the rollout batch as each update takes it, and the
        packing's ``rows``, ``pad_padded``, ``pad_packed``."""
        host = jax.device_get({k: batch[k] for k in ("prompts", "actions", "mask", "rollout_logp")})
        p = packing.pack(
            host["prompts"], host["actions"], host["mask"], host["rollout_logp"], self.pack_len
        )
        data = {k: jnp.asarray(p[k]) for k in PACKED_KEYS}
        data["rewards"] = batch["rewards"]
        rows = p["tokens"].shape[0]
        stats = {
            "rows": float(rows),
            "pad_padded": packing.padding_fraction(
                p["lengths"], len(p["lengths"]), self.task.seq_len
            ),
            "pad_packed": packing.padding_fraction(p["lengths"], rows, self.pack_len),
        }
        return batch, data, stats

    def __call__(self, state: algos.State, prompts, sums, key):
        batch, scores = self.rollout(state["params"], prompts, sums, key)
        _, data, stats = self.layouts(batch)
        state, loss, extra = self.packed_update(state, data)
        metrics = {
            "reward": jnp.mean(scores["reward"]),
            "accuracy": jnp.mean(scores["correct"]),
            "well_formed": jnp.mean(scores["well_formed"]),
            "tokens": jnp.sum(batch["mask"]),
            "loss": loss,
            **extra,
            **stats,
        }
        return state, metrics

    def time_updates(self, state, prompts, sums, key, runs: int) -> dict[str, float]:
        """Median ms of the update on one rollout in each layout: both compiled and run once,
        then ``runs`` calls of each, interleaved, each ended by ``block_until_ready``."""
        batch, _ = self.rollout(state["params"], prompts, sums, key)
        padded, packed, stats = self.layouts(batch)
        calls = {"padded": (self.padded_update, padded), "packed": (self.packed_update, packed)}
        for fn, data in calls.values():
            jax.block_until_ready(fn(state, data))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(runs):
            for name, (fn, data) in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(state, data))
                times[name].append(1e3 * (time.perf_counter() - t0))
        return {
            "update_ms_padded": statistics.median(times["padded"]),
            "update_ms_packed": statistics.median(times["packed"]),
            "timing_rows_padded": float(batch["mask"].shape[0]),
            "timing_rows_packed": stats["rows"],
        }
