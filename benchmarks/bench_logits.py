"""Logits ops: pallas vs reference (jnp under jit) vs chunked, beside the bandwidth floor.

Cases: ``ratio_kl`` and ``grpo_loss`` with B=16, T=512, V ∈ {32768, 131072},
fp16 and bf16 logits; ``token_logprobs`` with N=8192, V ∈ {32768, 131072} (bf16, logp
only and with entropy); ``grpo_loss`` with the policy-loss variants (
``ratio_level="sequence"``, ``policy_loss="cispo"``) at bf16, V=131072, beside the plain
``grpo_loss`` row (they should stay within 10 % of it). For each: median time of the forward and of forward + backward
(gradient to the policy logits of a random-weighted sum of the outputs, or of GRPO's
loss), XLA's temp buffer of each compiled function, and the floor = the bytes that
must move ÷ the measured device copy bandwidth:

    forward            each logits array read once             (1 or 2 passes of N·V)
    forward+backward   + the policy logits read again and
                       d logits written once                   (+2 passes)

(the backward must recompute softmax from the logits: a 2 GiB row block does not stay on
chip between the two). Masks are all ones, so no backend can skip rows.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_logits                 # the table
    PYTHONPATH=$PWD python3 -m benchmarks.bench_logits --sweep         # pallas launch plans
    PYTHONPATH=$PWD python3 -m benchmarks.bench_logits --sizes tiny    # smoke test
    PYTHONPATH=$PWD python3 -m benchmarks.bench_logits --ab            # A/B depth, then table

Results: ``bench_logits.{json,md}`` / ``bench_logits_sweep.{json,md}`` in out/bench (``--out``,
``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common, kernel_entry, output
from jaxrl_kernels.backends.pallas import logits as pallas_logits

BACKENDS = ("pallas", "reference", "chunked")
SIZES = {
    "tiny": dict(
        bt=[(4, 8)], n=[16], vocab=[1000], dtypes=["bfloat16"], variants=[(1000, "bfloat16")]
    ),
    "all": dict(
        bt=[(16, 512)],
        n=[8192],
        vocab=[32768, 131072],
        dtypes=["float16", "bfloat16"],
        variants=[(131072, "bfloat16")],
    ),
}
GRPO_GROUPS = jk.Groups(size=4)
GRPO_CONFIG = jk.PolicyLoss(kl_coef=0.04)  # the plain grpo_loss row's
GRPO_VARIANTS = {  # op label: grpo_loss's config (GRPO_CONFIG's kl_coef, in groups of 4)
    "grpo_loss[sequence ratio]": dataclasses.replace(
        GRPO_CONFIG, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4
    ),
    "grpo_loss[cispo]": dataclasses.replace(GRPO_CONFIG, policy_loss="cispo", clip_high=0.28),
}
COLUMNS = [
    "op",
    "V",
    "dtype",
    "impl",
    "fwd_ms",
    "fwd_floor_ms",
    "fwd_x_floor",
    "fwdbwd_ms",
    "fwdbwd_floor_ms",
    "fwdbwd_x_floor",
    "fwd_temp_mib",
    "fwdbwd_temp_mib",
]


def timed(fn, *args, budget_ms=2000.0):
    """Median ms, with a run count that keeps slow variants inside the time budget."""
    return common.time_calls(fn, *args, warmup=3, runs=30, budget_ms=budget_ms).median


def logits_pair(key, n, vocab, dtype):
    k1, k2 = jax.random.split(key)
    pol = (2.0 * jax.random.normal(k1, (n, vocab), jnp.float32)).astype(dtype)
    ref = (pol.astype(jnp.float32) + 0.3 * jax.random.normal(k2, (n, vocab))).astype(dtype)
    return pol, ref


def cases(size):
    """(op, V, dtype, passes_fwd, make_args, forward(backend), scalar loss(backend))."""
    cfg = SIZES[size]
    out = []
    for vocab in cfg["vocab"]:
        for n in cfg["n"]:

            def tok_args(key, n=n, vocab=vocab):
                rng = np.random.default_rng(1)
                pol, _ = logits_pair(key, n, vocab, jnp.bfloat16)
                t = jnp.asarray(rng.integers(0, vocab, n), jnp.int32)
                g = jnp.asarray(rng.standard_normal(n), jnp.float32)
                return pol, t, g

            for ent in (False, True):

                def fwd(b, ent=ent):
                    return lambda x, t, g: jk.token_logprobs(x, t, return_entropy=ent, backend=b)

                def loss(b, ent=ent):
                    def f(x, t, g):
                        out = jk.token_logprobs(x, t, return_entropy=ent, backend=b)
                        return jnp.sum(g * (out[0] + 0.1 * out[1])) if ent else jnp.sum(g * out)

                    return f

                name = "token_logprobs" + ("+entropy" if ent else "")
                out.append((name, vocab, "bfloat16", 1, tok_args, fwd, loss))
        for bsz, steps in cfg["bt"]:
            for dtype in cfg["dtypes"]:

                def pair_args(key, bsz=bsz, steps=steps, vocab=vocab, dtype=dtype):
                    rng = np.random.default_rng(2)
                    pol, ref = logits_pair(key, bsz * steps, vocab, jnp.dtype(dtype))
                    shape = (bsz, steps, vocab)
                    acts = jnp.asarray(rng.integers(0, vocab, (bsz, steps)), jnp.int32)
                    old = jnp.asarray(-np.abs(rng.standard_normal((bsz, steps))) * 2, jnp.float32)
                    rewards = jnp.asarray(rng.standard_normal(bsz), jnp.float32)
                    mask = jnp.ones((bsz, steps), jnp.float32)
                    c = jnp.asarray(rng.standard_normal((2, bsz, steps)), jnp.float32)
                    return pol.reshape(shape), ref.reshape(shape), acts, old, rewards, mask, c

                def rk_fwd(b):
                    return lambda p, r, a, o, rw, m, c: jk.ratio_kl(p, r, a, o, m, backend=b)

                def rk_loss(b):
                    def f(p, r, a, o, rw, m, c):
                        ratio, kl = jk.ratio_kl(p, r, a, o, m, backend=b)
                        return jnp.sum(c[0] * ratio + c[1] * kl)

                    return f

                def grpo_fwd(b, config=GRPO_CONFIG):
                    return lambda p, r, a, o, rw, m, c: jk.grpo_loss(
                        p, r, a, o, rw, m, groups=GRPO_GROUPS, config=config, backend=b
                    )

                def grpo_loss(b, config=GRPO_CONFIG):
                    return lambda p, r, a, o, rw, m, c: jk.grpo_loss(
                        p, r, a, o, rw, m, groups=GRPO_GROUPS, config=config, backend=b
                    )[0]

                out.append(("ratio_kl", vocab, dtype, 2, pair_args, rk_fwd, rk_loss))
                out.append(("grpo_loss", vocab, dtype, 2, pair_args, grpo_fwd, grpo_loss))
                if (vocab, dtype) in cfg["variants"]:
                    for label, config in GRPO_VARIANTS.items():
                        out.append(
                            (
                                label,
                                vocab,
                                dtype,
                                2,
                                pair_args,
                                lambda b, config=config: grpo_fwd(b, config),
                                lambda b, config=config: grpo_loss(b, config),
                            )
                        )
    return out


def run_table(size):
    nbytes = 2**24 if size == "tiny" else 2**31  # the smoke test needs no 2 GiB copies
    gbps = max(common.copy_bandwidth_gbps(nbytes) for _ in range(3))  # best of 3: least noise
    print(f"copy bandwidth {gbps:.0f} GB/s", flush=True)
    rows = []
    key = jax.random.key(0)
    for op, vocab, dtype, passes, make_args, fwd_of, loss_of in cases(size):
        args = make_args(key)
        n_rows, itemsize = args[0].size // vocab, jnp.dtype(args[0].dtype).itemsize
        pass_bytes = n_rows * vocab * itemsize
        floor_fwd = passes * pass_bytes / (gbps * 1e9) * 1e3
        floor_bwd = (passes + 2) * pass_bytes / (gbps * 1e9) * 1e3
        for backend in BACKENDS:
            row = dict(
                op=op,
                V=vocab,
                dtype=dtype,
                impl=backend,
                fwd_floor_ms=floor_fwd,
                fwdbwd_floor_ms=floor_bwd,
            )
            try:
                fwd = jax.jit(fwd_of(backend))
                row["fwd_ms"] = timed(fwd, *args)
                row["fwd_temp_mib"] = common.temp_mib(fwd, *args)
                bwd = jax.jit(jax.value_and_grad(loss_of(backend)))
                row["fwdbwd_ms"] = timed(bwd, *args)
                row["fwdbwd_temp_mib"] = common.temp_mib(bwd, *args)
                row["fwd_x_floor"] = row["fwd_ms"] / floor_fwd
                row["fwdbwd_x_floor"] = row["fwdbwd_ms"] / floor_bwd
            except Exception as err:  # one failing backend must not lose the others' numbers
                traceback.print_exc()
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
            print(
                {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                flush=True,
            )
        del args
    rows.append(
        dict(
            op=f"(floors use the measured copy bandwidth: {gbps:.0f} GB/s; pallas "
            f"forward pipelining depth {pallas_logits.FWD_STAGES})",
            impl="xla",
            copy_gbps=gbps,
            fwd_stages=pallas_logits.FWD_STAGES,
        )
    )
    print(common.write_results("bench_logits", rows, COLUMNS))


SWEEP_PLANS = [  # (block_v, num_warps, num_stages)
    (4096, 8, 2),
    (4096, 8, 3),
    (4096, 8, 4),
    (4096, 4, 3),
    (2048, 4, 3),
    (2048, 4, 4),
    (8192, 8, 3),
    (2048, 2, 3),
    (1024, 2, 3),
]


def run_sweep():
    """Pallas plans for the paired forward, the logp+entropy forward and the backward (fp16,
    N = 8192, V = 131072; the paired forward also at V = 32768). Every plan is compiled
    first and then timed in two passes, so the two columns per kernel show the noise."""
    gbps = max(common.copy_bandwidth_gbps() for _ in range(3))
    n = 8192
    rows = []
    for vocab in (131072, 32768):
        pol, ref = logits_pair(jax.random.key(0), n, vocab, jnp.float16)
        t = jnp.asarray(np.random.default_rng(0).integers(0, vocab, n), jnp.int32)
        valid = jnp.ones((n,), bool)
        g = jnp.asarray(np.random.default_rng(1).standard_normal(n), jnp.float32)
        pass_ms = n * vocab * 2 / (gbps * 1e9) * 1e3
        _, lse, _ = pallas_logits._forward(
            [pol],
            t,
            valid,
            temperature=1.0,
            entropy=False,
            plan=pallas_logits.make_launch(n, vocab, 2),
        )
        kernels = {}
        for block_v, warps, stages in SWEEP_PLANS:
            plan = pallas_logits.LogitsLaunch(block_v, 1, warps, stages)
            fns = {
                "paired_fwd": (
                    jax.jit(
                        lambda a, b, plan=plan: kernel_entry.pallas_paired_logprobs(
                            a, b, t, valid, plan=plan
                        )
                    ),
                    (pol, ref),
                    2,
                )
            }
            if vocab == 131072:
                fns["entropy_fwd"] = (
                    jax.jit(
                        lambda a, plan=plan: kernel_entry.pallas_token_logprobs(
                            a, t, valid, return_entropy=True, plan=plan
                        )
                    ),
                    (pol,),
                    1,
                )
                fns["bwd"] = (
                    jax.jit(
                        lambda a, plan=plan: pallas_logits._backward(
                            a, t, valid, lse, g, None, None, temperature=1.0, plan=plan
                        )
                    ),
                    (pol,),
                    2,
                )
            kernels[(block_v, warps, stages)] = fns
        times = {}
        for rep in range(2):
            for key, fns in kernels.items():
                for name, (fn, args, passes) in fns.items():
                    try:
                        ms = timed(fn, *args)
                        times.setdefault((key, name), []).append(ms / (passes * pass_ms))
                    except Exception:
                        traceback.print_exc()
                        times.setdefault((key, name), []).append(float("nan"))
        for key, fns in kernels.items():
            row = dict(V=vocab, block_v=key[0], num_warps=key[1], num_stages=key[2])
            for name in fns:
                a, b = times[(key, name)]
                row[f"{name}_x_floor"] = f"{a:.3f} / {b:.3f}"
            rows.append(row)
            print(row, flush=True)
        rows.append(dict(V=vocab, block_v="default", **_dispatch_overhead(pol, ref, t, valid)))
        print(rows[-1], flush=True)
        del pol, ref
    cols = [
        "V",
        "block_v",
        "num_warps",
        "num_stages",
        "paired_fwd_x_floor",
        "entropy_fwd_x_floor",
        "bwd_x_floor",
        "single_ms",
        "in_loop_ms",
    ]
    print(f"fp16 N={n}; floors at {gbps:.0f} GB/s (best of 3 copies); two timing passes")
    print(common.write_results("bench_logits_sweep", rows, cols))


def _dispatch_overhead(pol, ref, t, valid, k=10):
    """Default-plan paired forward: one jitted call vs per call inside a k-call loop."""
    vocab = pol.shape[1]
    one = jax.jit(lambda a, b, t: kernel_entry.pallas_paired_logprobs(a, b, t, valid))

    @jax.jit
    def loop(a, b, t):
        def body(i, acc):
            lp, rl = kernel_entry.pallas_paired_logprobs(a, b, (t + i) % vocab, valid)
            return acc + lp + rl

        return jax.lax.fori_loop(0, k, body, jnp.zeros(t.shape, jnp.float32))

    return dict(single_ms=timed(one, pol, ref, t), in_loop_ms=timed(loop, pol, ref, t) / k)


def run_ab(n=8192, vocab=131072, passes=3, k=10):
    """Interleaved A/B of the forward's pipelining depth (the one setting whose effect was
    within run-to-run noise): the default-plan paired forward with FWD_STAGES = 2 and 3,
    bf16 and fp16, timed per call inside a k-call jitted loop (no dispatch) and as one
    call, alternating over ``passes``. Returns the faster depth (sum of loop times)."""
    rows, total = [], {}
    for dtype in (jnp.bfloat16, jnp.float16):
        pol, ref = logits_pair(jax.random.key(3), n, vocab, dtype)
        t = jnp.asarray(np.random.default_rng(0).integers(0, vocab, n), jnp.int32)
        valid = jnp.ones((n,), bool)
        fns = {}
        for stages in (2, 3):
            plan = pallas_logits.make_launch(n, vocab, 2)._replace(num_stages=stages)

            def one(a, b, t, plan=plan):
                return kernel_entry.pallas_paired_logprobs(a, b, t, valid, plan=plan)

            def loop(a, b, t, plan=plan):
                def body(i, acc):
                    lp, rl = kernel_entry.pallas_paired_logprobs(
                        a, b, (t + i) % vocab, valid, plan=plan
                    )
                    return acc + lp + rl

                return jax.lax.fori_loop(0, k, body, jnp.zeros(t.shape, jnp.float32))

            fns[stages] = (jax.jit(one), jax.jit(loop))
        times = {s: ([], []) for s in fns}
        for _ in range(passes):
            for stages, (one, loop) in fns.items():
                times[stages][0].append(timed(one, pol, ref, t))
                times[stages][1].append(timed(loop, pol, ref, t) / k)
        for stages, (single, looped) in times.items():
            total[stages] = total.get(stages, 0.0) + sum(looped)
            rows.append(
                dict(
                    dtype=jnp.dtype(dtype).name,
                    fwd_stages=stages,
                    single_ms=" / ".join(f"{x:.3f}" for x in single),
                    in_loop_ms=" / ".join(f"{x:.3f}" for x in looped),
                )
            )
            print(rows[-1], flush=True)
        del pol, ref
    best = min(total, key=total.get)
    rows.append(dict(dtype="chosen", fwd_stages=best))
    print(
        common.write_results(
            "bench_logits_ab", rows, ["dtype", "fwd_stages", "single_ms", "in_loop_ms"]
        )
    )
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    output.output_arguments(parser)
    parser.add_argument("--sizes", choices=sorted(SIZES), default="all")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--ab",
        action="store_true",
        help="first A/B the forward pipelining depth and table with the faster",
    )
    args = parser.parse_args()
    if args.sweep:
        run_sweep()
        return
    if args.ab:
        pallas_logits.FWD_STAGES = run_ab()
    run_table(args.sizes)


if __name__ == "__main__":
    main()
