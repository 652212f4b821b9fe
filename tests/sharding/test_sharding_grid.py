"""The many-device grid (docs/api.md "Many devices"), generated: every op × option × backend ×
entry × layout on 8 host devices (mesh data=2 × model=4).

Each case runs an op on sharded inputs and checks, against the unsharded call of the same
backend (conftest's tolerance rules, ``assert_close``):

* values, and the gradients of a random linear functional of every output, are the unsharded
  ones (NaN at the same places);
* every gradient comes back sharded like its primal;
* the compiled program all-gathers none of the hidden states, logits or weight (nor a device's
  share of them), except the gathers the layout itself asks for: the hidden states' D shards
  within a row block (``tp``: D over a tensor-parallel axis) and an FSDP weight's D shards
  within a vocabulary slice (``fsdp``);
* an FSDP weight's gradient is reduce-scattered over the axis that splits D, not all-reduced
  (everywhere but the reference backend under Auto axes, where XLA's partitioner places plain
  jnp: it all-reduces d_weight, then keeps this device's slice).

Entries (``mode``): ``Auto`` and ``Explicit`` mesh axes under ``jax.jit``, and ``shard_map``: a
user's ``jax.shard_map`` (``check_vma=True``, the default) whose body calls the op on its
device's arrays, with ``vocab_axis="model"`` where the op takes it; there the reference is the
unsharded op applied to each row block. The mesh is set (``jax.set_mesh``) while tracing, as a
user does; test_sharding.py calls without it.

Layouts (``LAYOUTS``): ``rows`` (B over data), ``vocab`` (V over model), ``both``; per-token
ops: ``rows``, ``time`` (T over model), ``both``; hidden-state ops also ``tp`` (hidden
[B, T, D] as P("data", None, "model"), the weight's V over "model"), ``fsdp`` (the weight's D
over "data" and V over "model", as tunix / MaxText train an LM head) and ``tp_fsdp`` (both).
FSDP over the rows' own axis (``SAME_AXIS_FSDP``, under jax.jit): the rows over "data" and the
head over "data" too, on its V (``fsdp_v``, the bias with it) or on its D (``fsdp_d``), nothing
over "model"; the head is all-gathered whole and its gradient reduce-scattered back
(``FSDP_SAMPLE`` every op, backend, entry, layout and weight layout; the rest in the full run).

The grid (``FULL``) is built with ``itertools.product``; normal runs take the deterministic
``SAMPLE`` of it (every op × option once, every backend × entry × layout value, and the
configurations users reported crashing); ``JAXRL_TEST_GRID=full`` runs the rest (marker ``grid_full``;
``JAXRL_TEST_GRID_SHARD=i/n`` keeps every n-th case of it, for n processes:
tests/support/run_full_grid.sh).
Backends: conftest's ``CPU_BACKENDS`` (pallas in interpret mode with JAXRL_TEST_PALLAS=1), less
those that decline an op (``DECLINED``: pallas has no top-k, and its distillation kernels take
16-bit heads, which the grid's float32 cases are not, and run off a GPU emulated in a host
callback that crashes under Auto axes; tests/ops/test_distill.py runs them).

The distillation ops (``DISTILL_OPS``): ``linear_distill_loss`` takes a teacher head too
(``teacher_hidden`` [B, T, D_t] sharded like ``hidden``, D_t over the tensor-parallel axis in
``tp`` layouts; ``teacher_weight`` like ``weight``, in its own ``teacher_weight_layout``;
``teacher_bias`` like ``bias``); the teacher's gradients are checked too: zeros, sharded like
the teacher's arrays (but under Auto axes, see ``check``). ``linear_topk_logprobs``' int ``ids``
are compared exactly and left out of the linear functional whose gradients are checked.
``linear_logprobs`` at K ids per position (options ``k_ids*``: ``[B, T, K]`` targets with
padding) and ``linear_topk_distill_loss`` (a served teacher's ids and log-probs ``[B, T, K]``,
sharded like the per-token inputs) run on every backend.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels.backends.chunked import logprobs as chunked
from tests.conftest import CPU_BACKENDS, assert_close, random_mask
from tests.conftest import call as call_op
from tests.support.sharding_support import collective_sizes, full_spec

B, T, D, V = 4, 8, 16, 1024
DATA, MODEL = 2, 4
AXES = ("data", "model")
MODES = ("Auto", "Explicit", "shard_map")
ALL_BACKENDS = ("reference", "chunked", "pallas")


# -- options -----------------------------------------------------------------------------------
# Keyword arguments per named option; keys starting with "_" ask the builder for an input
# (an array) instead: "_bias", "_ref" (reference logits / ref_logp), "_rollout",
# "_advantages", "_boundaries", "_entropy" (ppo_loss's entropy input).

LOGPROB_OPTIONS = {
    "plain": {},
    "entropy": dict(return_entropy=True),
    "temperature": dict(temperature=1.3),
    "ignore_index": dict(ignore_index=-100),
    "all": dict(return_entropy=True, temperature=0.7, ignore_index=-100),
}
SAMPLER_OPTIONS = {  # the sampler's processed distribution (docs/api.md, sampler-matched)
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.9, temperature=0.8),
    "sampler_all": dict(top_k=40, top_p=0.9, min_p=0.05),
}
LOGPROB_OPTIONS = {
    **LOGPROB_OPTIONS,
    **SAMPLER_OPTIONS,
    "sampler_kept": dict(
        SAMPLER_OPTIONS["sampler_all"], return_entropy=True, return_kept=True, ignore_index=-100
    ),
}
LINEAR_LOGPROB_OPTIONS = {
    **LOGPROB_OPTIONS,
    "bias": dict(_bias=True),
    "all": dict(LOGPROB_OPTIONS["all"], _bias=True),
    # "_k_ids": K ids per position ([B, T, K] targets, some padding)
    "k_ids": dict(_k_ids=7),
    "k_ids_all": dict(LOGPROB_OPTIONS["all"], _bias=True, _k_ids=5),
}

AGGREGATIONS = {  # besides "token_mean", the default
    "agg_seq_mean_token_mean": dict(loss_agg_mode="seq_mean_token_mean"),
    "agg_seq_mean_token_sum": dict(loss_agg_mode="seq_mean_token_sum"),
    "agg_seq_mean_token_sum_norm": dict(loss_agg_mode="seq_mean_token_sum_norm"),
}
WITH_MAX_LEN = {
    **AGGREGATIONS,
    "agg_seq_mean_token_sum_norm_max_len": dict(
        loss_agg_mode="seq_mean_token_sum_norm", max_len=12
    ),
}  # ops that take max_len
POLICY_OPTIONS = {  # every PPO-style loss
    "plain": {},
    "dual_clip": dict(dual_clip=3.0),
    "clip_range": dict(clip_low=0.1, clip_high=0.3),
    **AGGREGATIONS,
    "ratio_sequence": dict(ratio_level="sequence"),
    "cispo": dict(policy_loss="cispo"),
    "tis_token": dict(_rollout=True, tis_cap=1.5),
    "tis_sequence_mask": dict(_rollout=True, tis_cap=1.5, tis_level="sequence", tis_mode="mask"),
}
PPO_OPTIONS = {
    **POLICY_OPTIONS,
    **WITH_MAX_LEN,
    "reference": dict(_ref=True, kl_coef=0.1, kl_estimator="k2"),
    "entropy": dict(entropy_coef=0.01),
    "dual_clip_reference": dict(dual_clip=3.0, _ref=True, kl_coef=0.1),
    "all": dict(
        dual_clip=3.0,
        _ref=True,
        kl_coef=0.1,
        entropy_coef=0.01,
        loss_agg_mode="seq_mean_token_mean",
        _rollout=True,
        tis_cap=1.5,
    ),
}
GRPO_OPTIONS = {
    **POLICY_OPTIONS,
    "reference": dict(_ref=True, beta=0.05),
    "reference_k1": dict(_ref=True, beta=0.05, kl_estimator="k1"),
    "dual_clip_reference": dict(dual_clip=3.0, _ref=True, beta=0.05),
    "advantages": dict(_advantages=True),
    "boundaries": dict(_boundaries=True),
    "no_std": dict(normalize_std=False),
    "all": dict(
        _ref=True,
        beta=0.05,
        dual_clip=3.0,
        loss_agg_mode="seq_mean_token_sum",
        ratio_level="sequence",
        _rollout=True,
        tis_cap=1.5,
        tis_level="sequence",
    ),
}
DISTILL_OPTIONS = {  # "_teacher_bias": a teacher bias; "_teacher_layout": the teacher head in
    # the other weight layout than the student's (else the same); "_teacher_dim": its D_t (else D)
    "plain": {},  # divergence="reverse_kl"
    "forward_kl": dict(divergence="forward_kl"),
    "jsd": dict(divergence="jsd", jsd_beta=0.3),
    "temperature": dict(temperature=1.3),
    "bias": dict(_bias=True, _teacher_bias=True),
    "teacher_layout": dict(_teacher_layout=True),
    "teacher_dim": dict(_teacher_dim=2 * D),
    **WITH_MAX_LEN,
    "all": dict(
        divergence="jsd",
        jsd_beta=0.7,
        temperature=0.8,
        _bias=True,
        _teacher_bias=True,
        _teacher_layout=True,
        _teacher_dim=D // 2,
        loss_agg_mode="seq_mean_token_mean",
    ),
}
TOPK_DISTILL_OPTIONS = {  # a served teacher's K = 6 ids ("_k_ids" for another K)
    "plain": {},  # tail="drop"
    "bucket": dict(tail="bucket"),
    "temperature": dict(temperature=0.8, _bias=True),
    **WITH_MAX_LEN,
    "all": dict(
        tail="bucket", temperature=1.3, _bias=True, _k_ids=3, loss_agg_mode="seq_mean_token_mean"
    ),
}
TOPK_OPTIONS = {  # k: 5 unless given; k_large: more than a vocabulary slice (V / MODEL) holds
    "plain": {},
    "bias": dict(_bias=True),
    "temperature": dict(temperature=0.7),
    "k1": dict(k=1),
    "k_large": dict(k=300, _bias=True),
}
OPTIONS: dict[str, dict[str, dict]] = {
    "token_logprobs": LOGPROB_OPTIONS,
    "linear_logprobs": LINEAR_LOGPROB_OPTIONS,
    "ratio_kl": {
        "plain": {},
        "k1": dict(kl_estimator="k1"),
        "k2": dict(kl_estimator="k2"),
        "abs": dict(kl_estimator="abs"),
        "temperature": dict(temperature=0.8),
    },
    "grpo_loss": {**GRPO_OPTIONS, "temperature": dict(temperature=1.3, _ref=True, beta=0.05)},
    "linear_ppo_loss": {
        **PPO_OPTIONS,
        "temperature": dict(temperature=0.8),
        "bias": dict(_bias=True, entropy_coef=0.01),
        **SAMPLER_OPTIONS,
        "sampler_entropy": dict(SAMPLER_OPTIONS["sampler_all"], _bias=True, entropy_coef=0.01),
    },
    "linear_grpo_loss": {
        **GRPO_OPTIONS,
        "temperature": dict(temperature=0.8),
        "bias": dict(_bias=True),
        **SAMPLER_OPTIONS,
    },
    "ppo_loss": {
        **PPO_OPTIONS,
        "entropy": dict(_entropy=True, entropy_coef=0.01),
        "all": dict(PPO_OPTIONS["all"], _entropy=True),
    },
    "policy_gradient_loss": {"token_mean": {}, **WITH_MAX_LEN},
    "group_advantages": {
        "plain": {},
        "no_std": dict(normalize_std=False),
        "ddof": dict(std_ddof=1),
        "boundaries": dict(_boundaries=True),
    },
    "aggregate": {
        "token_mean": {},
        **{
            k: dict(
                mode=v["loss_agg_mode"], **({"max_len": v["max_len"]} if "max_len" in v else {})
            )
            for k, v in WITH_MAX_LEN.items()
        },
    },
    "kl_penalty": {e: dict(estimator=e) for e in ("k1", "abs", "k2", "k3")},
    "linear_distill_loss": DISTILL_OPTIONS,
    "linear_topk_logprobs": TOPK_OPTIONS,
    "linear_topk_distill_loss": TOPK_DISTILL_OPTIONS,
}

LOGITS_OPS = ("token_logprobs", "ratio_kl", "grpo_loss")
DISTILL_OPS = ("linear_distill_loss", "linear_topk_logprobs")
LINEAR_OPS = (
    "linear_logprobs",
    "linear_ppo_loss",
    "linear_grpo_loss",
    "linear_topk_distill_loss",
) + DISTILL_OPS
TOKEN_OPS = ("ppo_loss", "policy_gradient_loss", "group_advantages", "aggregate", "kl_penalty")
VOCAB_AXIS_OPS = LOGITS_OPS + LINEAR_OPS

LAYOUTS = {
    "logits": ("rows", "vocab", "both"),
    "linear": ("rows", "vocab", "both", "tp", "fsdp", "tp_fsdp"),
    "token": ("rows", "time", "both"),
}
SHARD_MAP_LAYOUTS = {"logits": ("vocab", "both"), "linear": ("vocab", "both"), "token": ("rows",)}
SAME_AXIS_FSDP = ("fsdp_v", "fsdp_d")  # the head over the rows' axis "data": on V, on D
DECLINED = {op: ("pallas",) for op in DISTILL_OPS}  # backends left out of an op's grid
NO_SMALL_INPUTS = ("linear_topk_logprobs",)  # no per-token inputs: no "whole" variant


def family(op: str) -> str:
    return "logits" if op in LOGITS_OPS else "linear" if op in LINEAR_OPS else "token"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    option: str
    backend: str
    mode: str
    layout: str
    weight_layout: str = "vd"
    small: str = "split"  # "whole": per-token / per-sequence inputs replicated

    def __str__(self) -> str:
        wl = f"-{self.weight_layout}" if family(self.op) == "linear" else ""
        small = "-whole" if self.small == "whole" else ""
        return f"{self.op}-{self.option}-{self.backend}-{self.mode}-{self.layout}{wl}{small}"


def _cases_of(op: str, backends) -> list[Case]:
    fam = family(op)
    backends = [b for b in backends if b not in DECLINED.get(op, ())]
    out = []
    for option, backend, mode, wl in itertools.product(
        OPTIONS[op], backends, MODES, ("vd", "dv") if fam == "linear" else ("vd",)
    ):
        if mode == "shard_map" and option == "boundaries":
            continue  # boundaries of the whole batch do not fit a device's row block
        layouts = SHARD_MAP_LAYOUTS[fam] if mode == "shard_map" else LAYOUTS[fam]
        for layout in layouts:
            out.append(Case(op, option, backend, mode, layout, wl))
            if (
                mode != "shard_map"
                and layout != "vocab"  # small inputs there: whole anyway
                and op not in NO_SMALL_INPUTS
            ):
                out.append(Case(op, option, backend, mode, layout, wl, "whole"))
    return out


def full_grid(backends=ALL_BACKENDS) -> list[Case]:
    return [c for op in OPTIONS for c in _cases_of(op, backends)]


REGRESSIONS = [  # the configurations users reported crashing, on every kernel backend
    Case("grpo_loss", "reference", "chunked", "Explicit", "both", small="whole"),
    Case("grpo_loss", "reference", "pallas", "Explicit", "rows", small="whole"),
    Case("linear_ppo_loss", "dual_clip_reference", "chunked", "Explicit", "rows", small="whole"),
    Case("linear_ppo_loss", "dual_clip_reference", "reference", "Explicit", "both", small="whole"),
    Case("linear_logprobs", "plain", "chunked", "Explicit", "tp_fsdp", "dv"),
    Case("linear_logprobs", "entropy", "pallas", "Explicit", "tp_fsdp", "dv"),
    Case("linear_ppo_loss", "entropy", "chunked", "Auto", "tp_fsdp", "dv"),
    Case("linear_logprobs", "entropy", "pallas", "shard_map", "both"),
    Case("grpo_loss", "reference", "pallas", "shard_map", "both"),
    Case("linear_grpo_loss", "reference", "pallas", "shard_map", "both", "dv"),
    # lax.top_k left to XLA's partitioner all-gathered the logits, the rows split or not
    Case("linear_topk_logprobs", "plain", "reference", "Auto", "rows", "dv"),
]


FIELDS = ("op", "option", "backend", "mode", "layout", "weight_layout", "small")


def sample(cases: list[Case], backends) -> list[Case]:
    """A deterministic sample: the regression cases; then every option name once, on one of
    the ops that take it in turn, on a backend × entry × layout not yet covered where one is
    left (taken in turn from a fixed shuffle), off pallas where another backend can carry
    the option (interpret mode is the slow one; test_sharding.py and the regressions run the
    pallas kernels sharded); then a case for any op, backend, entry, layout or weight layout
    still missing, and for any backend × entry pair (the cheapest: a logits op's plain option,
    on a layout that backend has not run)."""
    order = lambda c: zlib.crc32(str(c).encode())
    chosen = [c for c in REGRESSIONS if c.backend in backends]
    place = lambda c: (c.backend, c.mode, c.layout)
    for k, name in enumerate(sorted({c.option for c in cases})):
        ops = sorted({c.op for c in cases if c.option == name})
        op = ops[k % len(ops)]
        group = sorted((c for c in cases if c.op == op and c.option == name), key=order)
        group = [c for c in group if c.backend != "pallas"] or group
        covered = {place(c) for c in chosen}
        group = [c for c in group if place(c) not in covered] or group
        pick = group[(7 * k) % len(group)]
        if pick not in chosen:
            chosen.append(pick)
    for field in FIELDS:
        for value in sorted({getattr(c, field) for c in cases}):
            if not any(getattr(c, field) == value for c in chosen):
                chosen.append(min((c for c in cases if getattr(c, field) == value), key=order))
    cost = {"logits": 0, "token": 1, "linear": 2}
    for pair in sorted({(c.backend, c.mode) for c in cases}):
        if not any((c.backend, c.mode) == pair for c in chosen):
            ran = {(c.backend, c.layout) for c in chosen}
            chosen.append(
                min(
                    (c for c in cases if (c.backend, c.mode) == pair),
                    key=lambda c: (
                        cost[family(c.op)],
                        c.option != "plain",
                        (c.backend, c.layout) in ran,
                        order(c),
                    ),
                )
            )
    return chosen


FULL = full_grid(tuple(CPU_BACKENDS))
SAMPLE = sample(FULL, tuple(CPU_BACKENDS))
REST = [c for c in FULL if c not in SAMPLE]


def _grid_shard(cases: list[Case]) -> list[Case]:
    """``JAXRL_TEST_GRID_SHARD=i/n``: every n-th case of the full run from the i-th, so that n
    processes share it (tests/support/run_full_grid.sh)."""
    value = os.environ.get("JAXRL_TEST_GRID_SHARD")
    if not value:
        return cases
    index, count = (int(part) for part in value.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"JAXRL_TEST_GRID_SHARD: expected i/n with 0 <= i < n, got {value!r}")
    return cases[index::count]


# -- inputs and the call -------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    call: Callable  # (arrays by name, vocab_axis) -> outputs
    names: list[str]
    arrays: list
    kinds: list[str]  # per array: how a layout shards it (see ``spec``)
    diff: tuple[int, ...]  # arrays to differentiate
    big: tuple[int, ...] = ()  # arrays no all-gather may rebuild (beyond what the layout asks)

    def fn(self, *arrays, vocab_axis=None):
        return self.call(dict(zip(self.names, arrays)), vocab_axis)


def _split(kwargs: dict) -> tuple[dict, dict]:
    return (
        {k: v for k, v in kwargs.items() if not k.startswith("_")},
        {k[1:]: v for k, v in kwargs.items() if k.startswith("_")},
    )


def build(case: Case) -> Built:
    """The case's op as a function of its array inputs, and those inputs."""
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    # linear_topk_logprobs: inputs on a grid of 1/8, so that every logit is exact in float32
    # whatever the order of its sum (D split over devices, chunks): the ids then compare
    # exactly, and the many equal logits check that ties go to the lower id across slices.
    step = 8.0 if case.op == "linear_topk_logprobs" else None
    normal = lambda shape, scale=1.0, loc=0.0: jnp.asarray(
        _on_grid(loc + scale * rng.standard_normal(shape), step).astype(np.float32)
    )
    kw, need = _split(OPTIONS[case.op][case.option])
    kw = dict(kw)
    fam = family(case.op)
    inputs: dict[str, tuple] = {}  # name -> (array, kind), in the order of the call's arrays

    def take(name, array, kind):
        inputs[name] = (array, kind)

    acts = rng.integers(0, V, (B, T)).astype(np.int32)
    if kw.get("ignore_index") is not None:
        acts[1, 3] = acts[2, 0] = -100
    mask = jnp.asarray(random_mask(rng, B, T, empty_rows=(1,)))
    old = normal((B, T), 0.3, -np.log(V))
    if fam == "logits":
        take("logits", normal((B, T, V), 2.0), "logits")
        if case.op != "token_logprobs":
            take("ref_logits", normal((B, T, V), 2.0), "logits")
    elif fam == "linear":
        take("hidden", normal((B, T, D)), "hidden")
        take(
            "weight",
            normal((V, D) if case.weight_layout == "vd" else (D, V), 2.0 / np.sqrt(D)),
            "weight",
        )
        kw["weight_layout"] = case.weight_layout
        if need.get("bias"):
            take("bias", normal((V,), 0.3), "bias")
        if case.op == "linear_distill_loss":
            d_t = need.get("teacher_dim", D)
            take("teacher_hidden", normal((B, T, d_t)), "teacher_hidden")
            t_layout = teacher_layout(case)
            take(
                "teacher_weight",
                normal((V, d_t) if t_layout == "vd" else (d_t, V), 2.0 / np.sqrt(d_t)),
                "teacher_weight",
            )
            kw["teacher_weight_layout"] = t_layout
            if need.get("teacher_bias"):
                take("teacher_bias", normal((V,), 0.3), "bias")
            take("mask", mask, "tok")
        if case.op == "linear_topk_logprobs":
            kw.setdefault("k", 5)
        if case.op == "linear_topk_distill_loss":
            k = need.get("k_ids", 6)
            ids = np.argsort(rng.random((B, T, V)), axis=-1)[..., :k].astype(np.int32)
            ids[0, 2, k // 2 :] = -1
            t_logp = np.log(rng.dirichlet(np.ones(k + 1), (B, T))[..., :k])
            take("teacher_ids", jnp.asarray(ids), "tok")
            take("teacher_logp", jnp.asarray(t_logp.astype(np.float32)), "tok")
            take("mask", mask, "tok")
    if need.get("k_ids") and case.op == "linear_logprobs":
        ids = rng.integers(0, V, (B, T, need["k_ids"])).astype(np.int32)
        ids[0, 1, 1:] = -1
        ids[2, 5] = -1
        if kw.get("ignore_index") is not None:
            ids[1, 3, 0] = -100
        take("targets", jnp.asarray(ids), "tok")
    elif fam != "token" and case.op not in DISTILL_OPS + ("linear_topk_distill_loss",):
        take(
            "targets",
            jnp.asarray(
                acts if case.op in ("token_logprobs", "linear_logprobs") else np.maximum(acts, 0)
            ),
            "tok",
        )
        if case.op not in ("token_logprobs", "linear_logprobs"):
            take("old_logp", old, "tok")
            take("mask", mask, "tok")
            if case.op != "ratio_kl":
                take("rewards", normal((B,)), "seq")  # advantages [B] of linear_ppo_loss
            if need.get("ref") and fam == "linear":
                take("ref_logp", old + normal((B, T), 0.3), "tok")
    elif fam == "token":
        logp = normal((B, T), 0.3, -5.0)
        if case.op == "group_advantages":
            take("rewards", normal((B,)), "lead_seq")
        else:
            take("logp", logp, "lead_tok")
        if case.op == "ppo_loss":
            take("old_logp", old, "tok")
        if case.op in ("ppo_loss", "policy_gradient_loss"):
            take("advantages", normal((B,)), "seq")
        if case.op in ("ppo_loss", "policy_gradient_loss", "aggregate"):
            take("mask", mask, "tok")
        if case.op == "kl_penalty" or need.get("ref"):
            take("ref_logp", logp + normal((B, T), 0.3), "tok")
        if need.get("entropy"):
            take("entropy", normal((B, T), 1.0, 3.0), "tok")
    if need.get("rollout"):
        take("rollout_logp", old + normal((B, T), 0.3), "tok")
    if need.get("boundaries"):
        take("group_boundaries", jnp.asarray([0, 1, B], jnp.int32), "rep")
    if need.get("advantages"):
        take("advantages", normal((B,)), "seq")
    group = {} if need.get("boundaries") else dict(group_size=2)
    if case.op in ("grpo_loss", "linear_grpo_loss") and not need.get("ref"):
        kw.setdefault("beta", 0.0)

    def call(x, vocab_axis):
        x = dict(x)
        on_vocab = dict(vocab_axis=vocab_axis) if case.op in VOCAB_AXIS_OPS else {}
        fixed = {
            "token_logprobs": ("logits", "targets"),
            "linear_logprobs": ("hidden", "weight", "targets"),
            "ratio_kl": ("logits", "ref_logits", "targets", "old_logp", "mask"),
            "grpo_loss": ("logits", "ref_logits", "targets", "old_logp", "rewards", "mask"),
            "linear_ppo_loss": ("hidden", "weight", "targets", "old_logp", "rewards", "mask"),
            "linear_grpo_loss": ("hidden", "weight", "targets", "old_logp", "rewards", "mask"),
            "ppo_loss": ("logp", "old_logp", "advantages", "mask"),
            "policy_gradient_loss": ("logp", "advantages", "mask"),
            "group_advantages": ("rewards",),
            "aggregate": ("logp", "mask"),
            "kl_penalty": ("logp", "ref_logp"),
            "linear_distill_loss": ("hidden", "weight", "teacher_hidden", "teacher_weight", "mask"),
            "linear_topk_logprobs": ("hidden", "weight"),
            "linear_topk_distill_loss": ("hidden", "weight", "teacher_ids", "teacher_logp", "mask"),
        }[case.op]
        args = [x.pop(n) for n in fixed]
        if case.op in ("grpo_loss", "linear_grpo_loss", "group_advantages"):
            x.update(group)
        if case.backend == "fast":  # memory="fast": XLA's GEMMs, no backend to pick
            return getattr(jk, case.op)(*args, **x, **kw, **on_vocab, memory="fast")
        return call_op(getattr(jk, case.op), case.backend, *args, **x, **kw, **on_vocab)

    names = list(inputs)
    # the teacher's arguments too: their gradients are zeros, sharded like them
    diff_names = (
        {
            "logits",
            "hidden",
            "weight",
            "bias",
            "entropy",
            "teacher_hidden",
            "teacher_weight",
            "teacher_bias",
        }
        | ({"logp"} if fam == "token" else set())
        | ({"rewards"} if case.op == "group_advantages" else set())
    )
    return Built(
        call,
        names,
        [inputs[n][0] for n in names],
        [inputs[n][1] for n in names],
        tuple(i for i, n in enumerate(names) if n in diff_names),
        tuple(
            i
            for i, n in enumerate(names)
            if n in ("logits", "ref_logits", "hidden", "weight", "teacher_hidden", "teacher_weight")
        ),
    )


def _on_grid(x: np.ndarray, step: float | None) -> np.ndarray:
    return x if step is None else np.round(x * step) / step


def teacher_layout(case: Case) -> str:
    """linear_distill_loss: the teacher head's weight layout, the student's unless the option
    asks for the other one."""
    other = {"vd": "dv", "dv": "vd"}[case.weight_layout]
    _, need = _split(OPTIONS[case.op][case.option])
    return other if need.get("teacher_layout") else case.weight_layout


def spec(kind: str, case: Case) -> tuple:
    """The PartitionSpec entries of an input of this kind under the case's layout."""
    layout, fam = case.layout, family(case.op)
    rows = "data" if layout in ("rows", "both", "tp", "fsdp", "tp_fsdp") + SAME_AXIS_FSDP else None
    vocab = "model" if layout in ("vocab", "both", "tp", "fsdp", "tp_fsdp") else None
    time = "model" if fam == "token" and layout in ("time", "both") else None
    hidden_d = "model" if layout in ("tp", "tp_fsdp") else None
    head_v = "data" if layout == "fsdp_v" else vocab  # the head's V (and its bias)
    weight_d = "data" if layout in ("fsdp", "tp_fsdp", "fsdp_d") else None
    if fam == "token" and layout == "both":
        vocab = None
    small = case.small == "split"  # per-token and per-sequence inputs besides the lead one
    return {
        "logits": (rows, None, vocab),
        "lead_tok": (rows, time),
        "lead_seq": (rows,),
        "tok": (rows, time) if small else (None, None),
        "seq": (rows,) if small else (None,),
        "rep": (None,),
        "hidden": (rows, None, hidden_d),
        "teacher_hidden": (rows, None, hidden_d),
        "weight": (head_v, weight_d) if case.weight_layout == "vd" else (weight_d, head_v),
        "teacher_weight": (head_v, weight_d)
        if teacher_layout(case) == "vd"
        else (weight_d, head_v),
        "bias": (head_v,),
    }[kind]


def make_mesh(kind: str):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest forces 8 host devices on CPU)")
    kind = "Explicit" if kind == "shard_map" else kind
    return jax.make_mesh((DATA, MODEL), AXES, axis_types=(getattr(AxisType, kind),) * 2)


def _row_blocks(case: Case) -> int:
    """Row blocks a shard_map body sees (1: rows whole on each device)."""
    return DATA if spec("seq", case)[0] else 1


def shard_mapped(case: Case, built: Built, mesh):
    """(the op in a user's shard_map on global arrays, what it equals unsharded): outputs of
    each row block stacked on a new leading axis when rows are split."""
    blocks = _row_blocks(case)
    specs = [P(*spec(k, case)) for k in built.kinds]
    vocab_axis = "model" if case.op in VOCAB_AXIS_OPS else None
    leading = (lambda y: y[None]) if blocks > 1 else (lambda y: y)

    def body(*arrays):
        return jax.tree.map(leading, built.fn(*arrays, vocab_axis=vocab_axis))

    outs = jax.eval_shape(built.fn, *built.arrays)
    out_specs = jax.tree.map(lambda _: P("data") if blocks > 1 else P(), outs)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)

    def unsharded(*arrays):
        if blocks == 1:
            return built.fn(*arrays)
        parts = []
        for i in range(blocks):
            parts.append(
                built.fn(
                    *(
                        x
                        if k in ("weight", "teacher_weight", "bias", "rep")
                        else jnp.split(x, blocks, axis=0)[i]
                        for x, k in zip(arrays, built.kinds)
                    )
                )
            )
        return jax.tree.map(lambda *ys: jnp.stack(ys), *parts)

    return mapped, unsharded


# -- the checks --------------------------------------------------------------------------------


def check(case: Case):
    if case.backend not in CPU_BACKENDS + ["fast"]:
        pytest.skip(f"backend {case.backend} is not in this run's backends")
    built = build(case)
    mesh = make_mesh(case.mode)
    if case.mode == "shard_map":
        sharded, unsharded = shard_mapped(case, built, mesh)
    else:
        sharded = unsharded = built.fn
    rng = np.random.default_rng(1)
    # no weight on an integer output (linear_topk_logprobs' ids): compared, not differentiated
    weights = [
        jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
        if jnp.issubdtype(o.dtype, jnp.inexact)
        else None
        for o in jax.tree.leaves(jax.eval_shape(unsharded, *built.arrays))
    ]

    def with_grads(fn):
        def scalar(*a):
            return sum(
                jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * w)
                for o, w in zip(jax.tree.leaves(fn(*a)), weights)
                if w is not None
            )

        def both(*a):
            return fn(*a), jax.grad(scalar, argnums=built.diff)(*a)

        return both

    want = jax.jit(with_grads(unsharded))(*built.arrays)
    placed = [
        jax.device_put(x, NamedSharding(mesh, P(*spec(k, case))))
        for x, k in zip(built.arrays, built.kinds)
    ]
    with jax.set_mesh(mesh):  # as a user does (jax.sharding.use_mesh before jax 0.7)
        compiled = jax.jit(with_grads(sharded)).lower(*placed).compile()
    got = compiled(*placed)
    for name, g, w in zip(("output", "gradient"), got, want):
        for i, (gl, wl) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(w))):
            # A loss or metric (0-d; stacked per row block inside shard_map) aggregates
            # per-token terms of either sign, each O(1) here: its condition scale is 1.
            if not jnp.issubdtype(wl.dtype, jnp.inexact):  # topk's ids: equal
                np.testing.assert_array_equal(gl, wl, err_msg=f"{case}: {name} {i}")
                continue
            scale = (
                1.0
                if name == "output" and wl.ndim <= (1 if case.mode == "shard_map" else 0)
                else None
            )
            if scale is None and case.op == "linear_distill_loss":
                # Both are float32 sums over the vocabulary in different orders (chunks,
                # slices), each within 1e-5 S of the float64 result (test_distill.py's oracle
                # tests): between them 2e-5 S (a divergence and its gradient cancel terms).
                finite = np.asarray(wl, np.float64)[np.isfinite(wl)]
                scale = 2.0 * float(np.max(np.abs(finite), initial=0.0))
            assert_close(gl, np.asarray(wl, np.float64), scale=scale, name=f"{case}: {name} {i}")
    for g, i in zip(got[1], built.diff):
        if built.names[i].startswith("teacher_") and case.mode == "Auto":
            # linear_distill_loss's teacher: jax's symbolic zero cotangent (the op stops its
            # gradient), which jax.grad instantiates as a constant with no sharding of its own;
            # under Auto axes XLA's partitioner places it (replicated). Explicit axes and
            # shard_map type it like the primal, checked here; its value (zeros) above.
            continue
        assert full_spec(g) == full_spec(placed[i]), (
            f"{case}: gradient of argument {i} sharded {full_spec(g)}, the argument "
            f"{full_spec(placed[i])}"
        )
    if not built.big:
        return
    if (
        case.backend == "reference"
        and case.mode == "Auto"
        and any(k in OPTIONS[case.op][case.option] for k in ("top_k", "top_p", "min_p"))
    ):
        return  # the reference leaves its sort to XLA's partitioner, which gathers (api.md)
    xla_places_grads = case.backend == "reference" and case.mode == "Auto"
    if xla_places_grads and case.layout in SAME_AXIS_FSDP:
        # XLA's partitioner places the reference's plain jnp: with the head over the rows' axis
        # it may gather the (here smaller) hidden states and split the vocabulary (api.md)
        return
    hlo = compiled.as_text()
    allowed = set()
    dims = {
        built.arrays[i].shape[-1]
        for i, n in enumerate(built.names)
        if n in ("hidden", "teacher_hidden")
    }  # D, and a distillation teacher's D_t
    for dim in dims:
        if case.layout in ("tp", "tp_fsdp"):
            allowed.add(B * T * dim // DATA)  # hidden states: the D shards of a row block
        if case.layout in ("fsdp", "tp_fsdp"):
            allowed.add(V * dim // MODEL)  # the FSDP weight: the D shards of a vocabulary slice
        if case.layout in SAME_AXIS_FSDP:
            allowed.update({V * dim, V})  # the FSDP head (and bias): whole on every device
    if (case.backend, case.mode, case.layout) == ("fast", "Auto", "fsdp_v"):
        # A known cost (docs/api.md, "A head sharded over the rows' axis"): Shardy propagates
        # the head's V split onto the kept logits between the forward and the backward call,
        # against the rows' split of the same axis, and XLA gathers them to reshard them.
        allowed.add(B * T * V)
    limit = min(built.arrays[i].size for i in built.big) // (DATA * MODEL)
    gathers = [n for n in collective_sizes(hlo, "all-gather") if n >= limit]
    assert all(n in allowed for n in gathers), (
        f"{case}: all-gathers of {gathers} elements (limit {limit}, allowed {sorted(allowed)})"
    )
    fsdp = ("fsdp", "tp_fsdp") + SAME_AXIS_FSDP
    if case.layout in fsdp and case.mode != "shard_map" and not xla_places_grads:
        # d_weight of a vocabulary slice (the whole head where "model" does not split it), all
        # of D, summed over the rows' split
        share = V * D // (1 if case.layout in SAME_AXIS_FSDP else MODEL)
        assert share not in collective_sizes(hlo, "all-reduce"), (
            f"{case}: d_weight all-reduced over the FSDP axis"
        )
        assert share // DATA in collective_sizes(hlo, "reduce-scatter"), (
            f"{case}: d_weight not reduce-scattered over the FSDP axis"
        )


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 16 * 1024)  # 256 columns of 16 rows


FAST_CASES = [  # memory="fast" (the logits kept for the backward) in every entry and layout
    Case("linear_logprobs", "all", "fast", "Explicit", "tp_fsdp", "dv"),
    Case("linear_logprobs", "entropy", "fast", "Auto", "fsdp", "vd"),
    Case("linear_grpo_loss", "all", "fast", "Explicit", "both", "dv"),
    Case("linear_ppo_loss", "all", "fast", "Auto", "tp", "vd"),
    Case("linear_ppo_loss", "dual_clip_reference", "fast", "shard_map", "both", "vd"),
    Case("linear_grpo_loss", "reference", "fast", "shard_map", "vocab", "dv"),
    Case("linear_grpo_loss", "dual_clip_reference", "fast", "Explicit", "fsdp", "vd"),
]


@pytest.mark.parametrize("case", FAST_CASES, ids=str)
def test_grid_fast_memory(case):
    check(case)


def _distill_fast_grid() -> tuple[list[Case], list[Case]]:
    """``linear_distill_loss(memory="fast")`` (the divergence's gradient taken in the forward)
    over every option × entry × layout × weight layout: (the sample, the rest). The sample
    takes every entry × layout once, with the options and weight layouts in turn, so that
    each option runs at least once."""
    op, options = "linear_distill_loss", list(DISTILL_OPTIONS)
    places = [
        (mode, layout)
        for mode in MODES
        for layout in (SHARD_MAP_LAYOUTS if mode == "shard_map" else LAYOUTS)["linear"]
    ]
    full = [
        Case(op, option, "fast", mode, layout, wl)
        for option, (mode, layout), wl in itertools.product(options, places, ("vd", "dv"))
    ]
    count = max(len(places), len(options))
    sample = [
        Case(op, options[i % len(options)], "fast", *places[i % len(places)], ("vd", "dv")[i % 2])
        for i in range(count)
    ]
    return sample, [c for c in full if c not in sample]


DISTILL_FAST_SAMPLE, DISTILL_FAST_REST = _distill_fast_grid()


def _same_axis_fsdp_grid() -> tuple[list[Case], list[Case]]:
    """The head sharded over the rows' own axis (``SAME_AXIS_FSDP``): every head op (its
    "all" option where it has one: bias, entropy, ...) × backend (and ``memory="fast"``) ×
    Auto / Explicit × layout × weight layout: (the sample, the rest). The sample: one case
    per op from a fixed shuffle, then one for any backend, entry, layout or weight layout
    still missing."""
    full = [
        Case(op, "all" if "all" in OPTIONS[op] else "plain", backend, mode, layout, wl)
        for op, backend, mode, layout, wl in itertools.product(
            LINEAR_OPS,
            list(CPU_BACKENDS) + ["fast"],
            ("Auto", "Explicit"),
            SAME_AXIS_FSDP,
            ("vd", "dv"),
        )
        if backend not in DECLINED.get(op, ())
        and not (backend == "fast" and op == "linear_topk_logprobs")  # it has no fast mode
    ]
    order = lambda c: zlib.crc32(str(c).encode())
    chosen = [min((c for c in full if c.op == op), key=order) for op in LINEAR_OPS]
    for field in ("backend", "mode", "layout", "weight_layout"):
        for value in sorted({getattr(c, field) for c in full}):
            if not any(getattr(c, field) == value for c in chosen):
                chosen.append(min((c for c in full if getattr(c, field) == value), key=order))
    return chosen, [c for c in full if c not in chosen]


FSDP_SAMPLE, FSDP_REST = _same_axis_fsdp_grid()


@pytest.mark.parametrize("case", SAMPLE + DISTILL_FAST_SAMPLE + FSDP_SAMPLE, ids=str)
def test_grid_sample(case):
    check(case)


@pytest.mark.grid_full
@pytest.mark.parametrize("case", _grid_shard(REST + DISTILL_FAST_REST + FSDP_REST), ids=str)
def test_grid_full(case):
    check(case)


def test_grid_shape():
    """The sample holds every op, option, backend, entry, layout and weight layout, and every
    backend × entry pair."""
    for field in FIELDS:
        assert {getattr(c, field) for c in SAMPLE} == {getattr(c, field) for c in FULL}, field
    pairs = lambda cases: {(c.backend, c.mode) for c in cases}
    assert pairs(SAMPLE) == pairs(FULL)
    assert len(set(FULL)) == len(FULL) and not set(SAMPLE) - set(FULL)


def test_grid_builds():
    """Every op × option of the grid traces (abstractly: no compile), so that a full run meets
    no builder error the sample missed."""
    for op, options in OPTIONS.items():
        for option in options:
            case = Case(op, option, "reference", "Explicit", LAYOUTS[family(op)][0])
            built = build(case)
            jax.eval_shape(built.fn, *built.arrays)
            if op in VOCAB_AXIS_OPS or family(op) == "token":
                mapped, unsharded = shard_mapped(
                    dataclasses.replace(
                        case, mode="shard_map", layout=SHARD_MAP_LAYOUTS[family(op)][-1]
                    ),
                    built,
                    make_mesh("shard_map"),
                )
                jax.eval_shape(unsharded, *built.arrays)
