"""ppo_loss (and group_advantages): pallas vs reference (jnp under jit) vs chunked.

ppo_loss with float32 [B, T] inputs at B=128, T=512 and B=1024, T=8192, option
sets: dual clip + TIS, every option (dual clip, TIS, k3 KL term,
entropy bonus, seq_mean_token_mean), and the policy-loss variants each beside
the token-level PPO set it changes: ``ratio_level="sequence"`` (GSPO),
``policy_loss="cispo"``, sequence-level TIS with masking, and all of them on top of
"everything". ``x_base_fwd`` / ``x_base_fwdbwd`` are the variant's time over its base
set's, same backend (at most 1.10 is the aim for pallas). Forward = (loss, metrics);
forward+backward = the gradient of the loss to logp (and entropy). The inputs rotate over
enough independent sets that they do not sit in L2 between runs. At B=128, T=512 the floor
(bytes ÷ copy bandwidth) is a fraction of a microsecond: every implementation is bound by
launches, and the wall-clock time includes the ~tens-of-µs dispatch of one jitted call; B=1024,
T=8192 is bound by memory.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_ppo
    PYTHONPATH=$PWD python3 -m benchmarks.bench_ppo --sizes tiny     # smoke test (CPU too)

Results: ``bench_ppo.{json,md}`` in out/bench (``--out``, ``--update-results``: benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common, output

BACKENDS = ("pallas", "reference", "chunked")
SIZES = {"tiny": [(8, 16)], "base": [(128, 512)], "all": [(128, 512), (1024, 8192)]}
LARGE_BACKENDS = ("pallas", "reference")  # chunked's ppo_loss is the reference's function
_EVERYTHING = jk.PolicyLoss(
    tis_cap=2.0, kl_coef=0.05, entropy_coef=0.01, loss_agg_mode="seq_mean_token_mean"
)
_ALL_INPUTS = ("rollout_logp", "ref_logp", "entropy")
# name: (optional inputs, ppo_loss's config, the config it is compared with or None)
CONFIGS = {
    "dual_clip+tis": (("rollout_logp",), jk.PolicyLoss(dual_clip=3.0, tis_cap=2.0), None),
    "everything": (_ALL_INPUTS, dataclasses.replace(_EVERYTHING, dual_clip=3.0), None),
    "ppo (token)": ((), jk.PolicyLoss(), None),
    "gspo (sequence ratio)": (
        (),
        jk.PolicyLoss(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
        "ppo (token)",
    ),
    "cispo": ((), jk.PolicyLoss(policy_loss="cispo", clip_low=0.2, clip_high=0.28), "ppo (token)"),
    "gspo+cispo": ((), jk.PolicyLoss(ratio_level="sequence", policy_loss="cispo"), "ppo (token)"),
    "tis sequence mask": (
        ("rollout_logp",),
        jk.PolicyLoss(dual_clip=3.0, tis_cap=2.0, tis_level="sequence", tis_mode="mask"),
        "dual_clip+tis",
    ),
    "everything, gspo": (
        _ALL_INPUTS,
        dataclasses.replace(
            _EVERYTHING,
            dual_clip=3.0,
            ratio_level="sequence",
            tis_level="sequence",
            tis_mode="mask",
        ),
        "everything",
    ),
    "everything, cispo": (
        _ALL_INPUTS,
        dataclasses.replace(_EVERYTHING, policy_loss="cispo", tis_level="sequence"),
        "everything",
    ),
}
COLUMNS = [
    "op",
    "config",
    "B",
    "T",
    "impl",
    "fwd_ms",
    "fwdbwd_ms",
    "x_base_fwd",
    "x_base_fwdbwd",
    "floor_fwd_ms",
    "floor_fwdbwd_ms",
    "fwd_temp_mib",
    "fwdbwd_temp_mib",
]
ROTATE_BYTES = 128 * 2**20  # > 2x the H100's 50 MB L2


def rotating_median_ms(fn, arg_sets, warmup=3, runs=40):
    """Median ms of fn over runs that cycle through independent argument sets."""
    return common.time_calls(fn, arg_sets=arg_sets, warmup=warmup, runs=runs).median


def make_inputs(rng, b, t, extra):
    lp = -np.abs(rng.standard_normal((b, t))) * 2
    old = lp + 0.3 * rng.standard_normal((b, t))
    arrays = dict(
        logp=lp,
        old_logp=old,
        advantages=rng.standard_normal((b, t)),
        mask=(rng.random((b, t)) < 0.9).astype(np.float32),
        rollout_logp=old + 0.3 * rng.standard_normal((b, t)),
        ref_logp=lp + 0.3 * rng.standard_normal((b, t)),
        entropy=np.abs(rng.standard_normal((b, t))),
    )
    keep = ("logp", "old_logp", "advantages", "mask") + extra
    return tuple(jnp.asarray(arrays[k], jnp.float32) for k in keep)


def ppo_fns(backend, extra, policy):
    names = ("logp", "old_logp", "advantages", "mask") + extra

    def call(*arrays):
        kw = dict(zip(names[4:], arrays[4:]))
        return jk.ppo_loss(*arrays[:4], config=policy, backend=backend, **kw)

    diff = (0,) + tuple(4 + i for i, n in enumerate(extra) if n == "entropy")
    fwd = jax.jit(call)
    fwdbwd = jax.jit(jax.value_and_grad(lambda *a: call(*a)[0], argnums=diff))
    return fwd, fwdbwd, len(names), len(diff)


def ppo_rows(b, t, gbps, rng, runs, backends):
    rows = []
    done = {}
    for config, (extra, policy, base) in CONFIGS.items():
        n_sets = max(2, min(128, ROTATE_BYTES // (b * t * 4 * (4 + len(extra)))))
        arg_sets = [make_inputs(rng, b, t, extra) for _ in range(n_sets)]
        for backend in backends:
            row = dict(op="ppo_loss", config=config, B=b, T=t, impl=backend)
            try:
                fwd, fwdbwd, n_in, n_grad = ppo_fns(backend, extra, policy)
                row["fwd_ms"] = rotating_median_ms(fwd, arg_sets, runs=runs)
                row["fwdbwd_ms"] = rotating_median_ms(fwdbwd, arg_sets, runs=runs)
                row["fwd_temp_mib"] = common.temp_mib(fwd, *arg_sets[0])
                row["fwdbwd_temp_mib"] = common.temp_mib(fwdbwd, *arg_sets[0])
                row["floor_fwd_ms"] = n_in * b * t * 4 / (gbps * 1e9) * 1e3
                row["floor_fwdbwd_ms"] = (2 * n_in + n_grad) * b * t * 4 / (gbps * 1e9) * 1e3
                base_row = done.get((base, backend), {})
                for key in ("fwd", "fwdbwd"):
                    if f"{key}_ms" in base_row:
                        row[f"x_base_{key}"] = row[f"{key}_ms"] / base_row[f"{key}_ms"]
            except Exception as err:
                traceback.print_exc()
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            if base is not None:
                row["base"] = base
            done[(config, backend)] = row
            rows.append(row)
            print(row, flush=True)
        del arg_sets
    return rows


def run(size):
    tiny = size == "tiny"
    gbps = common.copy_bandwidth_gbps(2**24 if tiny else 2**31)
    rng = np.random.default_rng(0)
    runs = 5 if tiny else 40
    rows = []
    for i, (b, t) in enumerate(SIZES[size]):
        rows += ppo_rows(b, t, gbps, rng, runs, BACKENDS if i == 0 else LARGE_BACKENDS)
    b = SIZES[size][0][0]
    # group_advantages over B rewards in groups of 8
    n_groups = max(1, b // 8)
    rewards = [jnp.asarray(rng.standard_normal(b), jnp.float32) for _ in range(8)]
    for backend in BACKENDS:
        row = dict(op="group_advantages", config=f"{n_groups} groups of 8", B=b, T=1, impl=backend)
        try:
            fn = jax.jit(
                lambda r, backend=backend: jk.group_advantages(
                    r, groups=jk.Groups(size=8), backend=backend
                )
            )
            row["fwd_ms"] = rotating_median_ms(fn, [(r,) for r in rewards], runs=runs)
        except Exception as err:
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
        print(row, flush=True)
    rows.append(
        dict(
            op=f"(floors use the measured copy bandwidth: {gbps:.0f} GB/s)",
            impl="xla",
            copy_gbps=gbps,
        )
    )
    print(common.write_results("bench_ppo", rows, COLUMNS))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    output.output_arguments(parser)
    parser.add_argument("--sizes", choices=sorted(SIZES), default="all")
    run(parser.parse_args().sizes)


if __name__ == "__main__":
    main()
