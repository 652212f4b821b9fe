"""One process of the two-process tests (test_multiprocess.py): jax.distributed over CPU (gloo).

Each process holds 4 of the 8 devices of a (data=2, model=4) mesh (CPU), so no process sees every
device. Rows are split over ``data`` (one row block per process), the vocabulary over
``model``. The sharded values and gradients must equal the unsharded ones, which each process
computes on its own first device; gradients must come back sharded like their primals.

Runs (``<Auto|Explicit>:<cases>``, each a mesh type and a comma-separated list of cases; each
process runs them all in order, one mesh per run; all cases but ``linear`` are traced with the
mesh set, ``jax.set_mesh``, as a user does):

``linear``
    linear_logprobs and linear_grpo_loss under jax.jit, the weight split over the vocabulary;
    the compiled program gathers no device's share of the hidden states.
``options``
    option combinations under jax.jit: grpo_loss with a reference model (``beta``),
    linear_ppo_loss with ``dual_clip``, a reference and the entropy bonus, and an FSDP "dv"
    head (D over ``data``, V over ``model``) under hidden states whose D is split over
    ``model``.
``distill``
    linear_distill_loss (the JSD, a teacher of another D in the other weight layout, biases)
    under jax.jit, lean on the backend (where it serves it) and ``memory="fast"``, both heads
    split over the vocabulary; the compiled program gathers no device's share of either
    head's hidden states.
``vocab_axis``
    a user's jax.shard_map (``check_vma=True``) with ``vocab_axis="model"`` while the rows are
    split over ``data``: linear_logprobs, linear_grpo_loss, token_logprobs and grpo_loss; a
    loss there is the loss of the device's row block.
``sampler``
    sampler-matched log-probs (top-k, top-p, min-p; docs/api.md) under jax.jit:
    linear_logprobs and token_logprobs in one program, the rows split over ``model`` and the
    vocabulary over ``data``, so that the kept-set passes combine each row's counts and sums
    across the two processes; the compiled program gathers no device's share of the logits.

With ``JAXRL_MULTIPROCESS_ON=gpu`` each process runs on the GPUs its CUDA_VISIBLE_DEVICES
names (NCCL collectives) instead, the mesh is (data=2, model=<GPUs per process>), the head,
hidden states and logits are bfloat16, and results are compared within a bfloat16 rounding.

usage: python multiprocess_worker.py <process id> <port> <backend> <Auto|Explicit>:<cases> ...
"""

import contextlib
import os
import re
import sys

ON_GPU = os.environ.get("JAXRL_MULTIPROCESS_ON") == "gpu"
if not ON_GPU:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if not ON_GPU:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update(  # see conftest.py
    "jax_traceback_in_locations_limit",
    int(os.environ.get("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")),
)
pid, port, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3]
RUNS = [(kind, cases.split(",")) for kind, cases in (run.split(":") for run in sys.argv[4:])]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxrl_kernels as jk  # noqa: E402

B, T, D, V = 4, 8, 64 if ON_GPU else 32, 4096
rng = np.random.default_rng(0)  # same draw in both processes
h = rng.standard_normal((B, T, D)).astype(np.float32)
w = (rng.standard_normal((V, D)) / 4).astype(np.float32)
t = rng.integers(0, V, (B, T)).astype(np.int32)
old = (-8.0 + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
rewards = rng.standard_normal(B).astype(np.float32)
mask = (rng.random((B, T)) < 0.8).astype(np.float32)
ref_logp = (-8.0 + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
logits = (2.0 * rng.standard_normal((B, T, V))).astype(np.float32)
ref_logits = (2.0 * rng.standard_normal((B, T, V))).astype(np.float32)
t_h = rng.standard_normal((B, T, 48)).astype(np.float32)  # a teacher with D_t = 48, "dv" head
t_w = (rng.standard_normal((48, V)) / 4).astype(np.float32)
bias, t_bias = (0.3 * rng.standard_normal((2, V))).astype(np.float32)
# a sharded result against the unsharded one: float32 sums in another order, or (GPU) a
# bfloat16 gradient one rounding apart
TOL = 1e-5
if ON_GPU:
    h, w, logits, ref_logits, t_h, t_w, bias, t_bias = (
        x.astype(jnp.bfloat16) for x in (h, w, logits, ref_logits, t_h, t_w, bias, t_bias)
    )
    TOL = 1e-2

# ffi's kernels take a linear head; on logits its runs use pallas, the GPU's logits kernels
LOGITS_BACKEND = "pallas" if backend == "ffi" else backend
LOCAL = len(jax.local_devices())
assert jax.process_count() == 2 and len(jax.devices()) == 2 * LOCAL and LOCAL in (2, 4)
mesh = None  # the current run's (data=2, model=LOCAL) mesh, set below
local = jax.local_devices()[0]
ROWS, ROWS3, SEQ = P("data", None), P("data", None, None), P("data")


def place(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def gathered(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check(name, fn, args, specs, diff, *, unsharded=None, gather_limit=None, in_mesh=True):
    """fn's value and the gradient of the sum of its outputs with respect to args[diff]
    (sharded as specs say) against the unsharded call on this process's first device;
    ``in_mesh``: traced with the mesh set (jax.set_mesh), as a user does."""

    def total(out):
        return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0)) for o in jax.tree.leaves(out))

    def step(f):
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: total(f(*a)), diff)(*a)))

    placed = [place(x, s) for x, s in zip(args, specs)]
    with jax.set_mesh(mesh) if in_mesh else contextlib.nullcontext():
        compiled = step(fn).lower(*placed).compile()
    value, grads = compiled(*placed)
    want_value, want_grads = step(unsharded or fn)(*(jax.device_put(x, local) for x in args))
    for what, got, want in (("value", value, want_value), ("gradient", grads, want_grads)):
        for i, (g, wv) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            g, wv = gathered(g).astype(np.float64), np.asarray(wv).astype(np.float64)
            assert np.array_equal(np.isnan(g), np.isnan(wv)), f"{name}: {what} {i} NaNs"
            fin = np.isfinite(wv)
            err = float(np.max(np.abs(g[fin] - wv[fin]), initial=0.0))
            scale = max(
                float(np.max(np.abs(wv[fin]), initial=0.0)), 1.0 if wv.ndim <= 1 else 1e-3
            )  # a loss or metric: a signed aggregate of O(1) terms
            assert err <= TOL * scale, (
                f"process {pid}: {name}: {what} {i} error {err:.3e} > {TOL} x {scale:.3e}"
            )
    for g, i in zip(grads, diff):
        pad = lambda s, n: tuple(s) + (None,) * (n - len(s))
        assert pad(g.sharding.spec, g.ndim) == pad(specs[i], g.ndim), (
            f"process {pid}: {name}: gradient {i} sharded {g.sharding.spec}, argument {specs[i]}"
        )
    if gather_limit is not None:
        hlo = compiled.as_text()
        sizes = [
            int(np.prod([int(d) for d in m.group(1).split(",") if d]))
            for line in re.finditer(r"= (.*?) all-gather(?:-start)?\(", hlo)
            for m in re.finditer(r"\w+\[([\d,]*)\]", line.group(1))
        ]
        assert all(n < gather_limit for n in sizes), (
            f"process {pid}: {name}: all-gathers of {sizes} elements (limit {gather_limit})"
        )
    print(f"process {pid}: {name} ok", flush=True)


def case_linear():
    def loss(h, w, t, old, rewards, mask):
        lp, ent = jk.linear_logprobs(h, w, t, return_entropy=True, backend=backend)
        grpo, _, _ = jk.linear_grpo_loss(h, w, t, old, rewards, mask, group_size=2, backend=backend)
        return jnp.sum(lp * mask) + 0.1 * jnp.sum(ent) + grpo

    check(
        "linear",
        loss,
        (h, w, t, old, rewards, mask),
        (ROWS3, P("model", None), ROWS, ROWS, SEQ, ROWS),
        (0, 1),
        gather_limit=h.size // 8,
        in_mesh=False,
    )  # limit: a device's share of h


def case_packed():
    """Packed rows (two sequences a row, the last position of each masked), rows split over
    the processes, the per-sequence rewards [S] replicated: linear_grpo_loss with segment_ids
    against the same call on one device."""
    seg = np.repeat(np.arange(2 * B).reshape(B, 2), T // 2, axis=1).astype(np.int32)
    packed_mask = (mask * (np.arange(T) % (T // 2) != T // 2 - 1)).astype(np.float32)
    seq_rewards = np.tile(rewards, 2).astype(np.float32)

    def loss(h, w, t, old, seq_rewards, packed_mask, seg):
        out, _, _ = jk.linear_grpo_loss(
            h,
            w,
            t,
            old,
            seq_rewards,
            packed_mask,
            segment_ids=seg,
            num_segments=2 * B,
            groups=jk.Groups(size=2),
            config=jk.PolicyLoss(loss_agg_mode="seq_mean_token_mean"),
            backend=backend,
        )
        return out

    check(
        "packed: linear_grpo_loss with segment_ids",
        loss,
        (h, w, t, old, seq_rewards, packed_mask, seg),
        (ROWS3, P("model", None), ROWS, ROWS, P(), ROWS, ROWS),
        (0, 1),
        in_mesh=False,
    )


def case_options():
    check(
        "grpo_loss beta",
        lambda x, y: jk.grpo_loss(
            x, y, t, old, rewards, mask, group_size=2, beta=0.05, backend=LOGITS_BACKEND
        ),
        (logits, ref_logits),
        (P("data", None, "model"),) * 2,
        (0,),
    )
    check(
        "linear_ppo_loss dual_clip + reference + entropy",
        lambda h, w: jk.linear_ppo_loss(
            h,
            w,
            t,
            old,
            rewards,
            mask,
            dual_clip=3.0,
            ref_logp=ref_logp,
            kl_coef=0.1,
            entropy_coef=0.01,
            loss_agg_mode="seq_mean_token_mean",
            backend=backend,
        ),
        (h, w),
        (ROWS3, P("model", None)),
        (0, 1),
    )
    check(
        "FSDP dv head, hidden D over model",
        lambda h, w: jk.linear_logprobs(
            h, w, t, weight_layout="dv", return_entropy=True, temperature=0.8, backend=backend
        ),
        (h, np.ascontiguousarray(w.T)),
        (P("data", None, "model"), P("data", "model")),
        (0, 1),
    )


def case_distill():
    # lean on the backend where it serves these heads (pallas takes 16-bit ones, ffi "vd"
    # heads only and this teacher's is "dv")
    served = backend in jk.available_backends("linear_distill_loss") and backend not in (
        "pallas",
        "ffi",
    )
    for memory in ("lean", "fast") if served else ("fast",):
        route = dict(backend=backend) if memory == "lean" else dict(memory="fast")
        check(
            f"linear_distill_loss jsd, {memory}",
            lambda h, w, b, th, tw, tb, m: jk.linear_distill_loss(
                h,
                w,
                th,
                tw,
                m,
                bias=b,
                teacher_bias=tb,
                divergence="jsd",
                jsd_beta=0.3,
                temperature=0.8,
                teacher_weight_layout="dv",
                loss_agg_mode="seq_mean_token_sum",
                **route,
            ),
            (h, w, bias, t_h, t_w, t_bias, mask),
            (ROWS3, P("model", None), P("model"), ROWS3, P(None, "model"), P("model"), ROWS),
            (0, 1, 2),
            gather_limit=h.size // 8,
        )


def case_vocab_axis():
    def blocks(fn, whole=()):
        """fn of each row block (what a device computes), stacked; ``whole``: the positions
        of arguments without rows (the weight)."""

        def stacked(*a):
            parts = [
                fn(
                    *(
                        x if k in whole else x[i * B // 2 : (i + 1) * B // 2]
                        for k, x in enumerate(a)
                    )
                )
                for i in range(2)
            ]
            return jax.tree.map(lambda *ys: jnp.stack(ys), *parts)

        return stacked

    def mapped(fn, in_specs, n_out):
        return jax.shard_map(
            lambda *a: jax.tree.map(lambda y: y[None], fn(*a)),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(SEQ,) * n_out,
        )

    def linear(h, w, t, old, rewards, mask, ref, vocab_axis=None):
        lp, ent = jk.linear_logprobs(
            h, w, t, return_entropy=True, temperature=0.7, backend=backend, vocab_axis=vocab_axis
        )
        loss, pg, kl = jk.linear_grpo_loss(
            h,
            w,
            t,
            old,
            rewards,
            mask,
            group_size=2,
            ref_logp=ref,
            beta=0.05,
            dual_clip=3.0,
            backend=backend,
            vocab_axis=vocab_axis,
        )
        return lp, ent, jnp.stack([loss, pg, kl])

    specs = (ROWS3, P("model", None), ROWS, ROWS, SEQ, ROWS, ROWS)
    check(
        "shard_map vocab_axis: linear_logprobs, linear_grpo_loss",
        mapped(lambda *a: linear(*a, vocab_axis="model"), specs, 3),
        (h, w, t, old, rewards, mask, ref_logp),
        specs,
        (0, 1),
        unsharded=blocks(linear, whole=(1,)),
    )

    def from_logits(x, y, t, old, rewards, mask, vocab_axis=None):
        lp = jk.token_logprobs(
            x, t, ignore_index=-100, backend=LOGITS_BACKEND, vocab_axis=vocab_axis
        )
        loss = jk.grpo_loss(
            x,
            y,
            jnp.maximum(t, 0),
            old,
            rewards,
            mask,
            group_size=2,
            beta=0.05,
            backend=LOGITS_BACKEND,
            vocab_axis=vocab_axis,
        )
        return lp, jnp.stack(loss)

    t_ignored = t.copy()
    t_ignored[0, 1] = -100
    specs = (P("data", None, "model"),) * 2 + (ROWS, ROWS, SEQ, ROWS)
    check(
        "shard_map vocab_axis: token_logprobs, grpo_loss",
        mapped(lambda *a: from_logits(*a, vocab_axis="model"), specs, 2),
        (logits, ref_logits, t_ignored, old, rewards, mask),
        specs,
        (0,),
        unsharded=blocks(from_logits),
    )


# the sampler's truncations (after test_sharding_grid.py's SAMPLER_OPTIONS), each on one op:
# the candidates' pass (top-k), the pivot search (top-p alone), top-k with top-p, and all three
# with the entropy and whether each target is kept (min_p 0.2: it keeps fewer than top_k's 40
# in some rows here, so each option changes the results)
SAMPLER = (
    ("linear", dict(top_k=20)),
    ("token", dict(top_p=0.9, temperature=0.8)),
    (
        "linear",
        dict(
            top_k=40, top_p=0.9, min_p=0.2, return_entropy=True, return_kept=True, ignore_index=-100
        ),
    ),
    ("token", dict(top_k=40, top_p=0.9)),
)


def case_sampler():
    def in_set(z):  # half the targets the row's argmax (kept by every truncation), half t
        on = (np.arange(B)[:, None] + np.arange(T)) % 2 == 0
        targets = np.where(on, np.argmax(np.asarray(z, np.float32), -1), t).astype(np.int32)
        ignored = targets.copy()
        ignored[0, 1] = ignored[3, 6] = -100
        return targets, ignored

    targets = {
        "linear": in_set(np.asarray(h, np.float32) @ np.asarray(w, np.float32).T),
        "token": in_set(logits),
    }

    def sampled(h, w, x, *ids):
        ids = dict(zip(("linear", "token"), (ids[:2], ids[2:])))
        out = []
        for op, opts in SAMPLER:
            tg = ids[op]["ignore_index" in opts]
            out.append(
                jk.linear_logprobs(h, w, tg, backend=backend, **opts)
                if op == "linear"
                else jk.token_logprobs(x, tg, backend=LOGITS_BACKEND, **opts)
            )
        # kept (bool) compared as 0 / 1
        return jax.tree.map(lambda o: o.astype(jnp.float32) if o.dtype == jnp.bool_ else o, out)

    # the rows split over model, the vocabulary over data: across the two processes, which
    # combine each row's kept-set statistics
    rows = P("model", None)
    check(
        "sampler: top-k, top-p, min-p",
        sampled,
        (h, w, logits, *targets["linear"], *targets["token"]),
        (P("model", None, None), P("data", None), P("model", None, "data")) + (rows,) * 4,
        (0, 1, 2),
        gather_limit=logits.size // 8,
    )  # limit: a device's share of the logits


for kind, cases in RUNS:
    mesh = jax.make_mesh((2, LOCAL), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
    for case in cases:
        {
            "linear": case_linear,
            "options": case_options,
            "distill": case_distill,
            "vocab_axis": case_vocab_axis,
            "sampler": case_sampler,
            "packed": case_packed,
        }[case]()
    print(f"process {pid}: ok ({backend}, {kind}, {','.join(cases)})", flush=True)
jax.distributed.shutdown()
