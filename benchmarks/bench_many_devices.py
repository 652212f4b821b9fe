"""linear_logprobs and linear_grpo_loss fwd+bwd on one device vs all local devices, per layout.

Layouts (a 1-D mesh ``x`` of every local device, ``Auto`` axes unless ``--explicit``):
  ``1dev``  everything on device 0;
  ``rows``  hidden states / targets / per-token inputs split over ``x`` (data parallel),
            the weight replicated;
  ``vocab`` the weight split over its vocabulary (tensor parallel), rows replicated.
For each: the median time of value_and_grad (wall clock around ``block_until_ready``), XLA's
temp buffer size, the bytes of the weight each device holds, and every collective of the
compiled program with its bytes (the hidden states, logits or weight must never be gathered).
``reference`` is XLA's materialised path under GSPMD: what a JAX user gets without us.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices              # N=8192, D=4096, V=131072 bf16
    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices --layouts 1dev --sizes base
                                                     # one GPU, N=4096 (B=8, T=512), D=2048
    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices --smoke      # tiny, e.g. on CPU with
        XLA_FLAGS=--xla_force_host_platform_device_count=8

Results: ``bench_many_devices.{json,md}`` (benchmarks.common.write_results).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxrl_kernels as jk
from benchmarks import common, output

COLUMNS = ["op", "backend", "layout", "devices", "ms", "speedup", "temp_mib", "weight_mib_per_dev",
           "collectives"]
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "u32": 4}


def collectives(hlo: str) -> list[str]:
    """'kind dtype[shape] (MiB)' for every collective of a compiled HLO text (async ones by
    their start, whose result tuple lists the operand first)."""
    out = []
    kinds = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) " + kinds, line)
        if not m:
            continue
        for t in re.finditer(r"(\w+)\[([\d,]*)\]", m.group(1)):  # a combined one: a tuple
            dims = [int(d) for d in t.group(2).split(",") if d]
            mib = int(np.prod(dims)) * _BYTES.get(t.group(1), 4) / 2**20
            out.append(f"{m.group(2)} {t.group(1)}[{t.group(2)}] ({mib:.1f} MiB)")
            if m.group(0).endswith("-start("):
                break  # an async start's tuple repeats the operand as its result
    return sorted(set(out))


SIZES = {  # B, T, D, V
    "smoke": (8, 16, 64, 1024),
    "base": (8, 512, 2048, 131072),
    "large": (16, 512, 4096, 131072),
}


def inputs(b, t, d, v, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        hidden=jnp.asarray(rng.standard_normal((b, t, d), np.float32), jnp.bfloat16),
        weight=jnp.asarray(rng.standard_normal((v, d), np.float32) * 1.5 / np.sqrt(d),
                           jnp.bfloat16),
        actions=jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
        old_logp=jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32),
        rewards=jnp.asarray(rng.standard_normal(b), jnp.float32),
        mask=jnp.asarray(rng.random((b, t)) < 0.9, jnp.float32))


def loss_fn(op, backend):
    def logprobs(h, w, x):
        return jnp.sum(jk.linear_logprobs(h, w, x["actions"], backend=backend) * x["mask"])

    def grpo(h, w, x):
        return jk.linear_grpo_loss(h, w, x["actions"], x["old_logp"], x["rewards"], x["mask"],
                                   group_size=4, backend=backend)[0]

    return {"linear_logprobs": logprobs, "linear_grpo_loss": grpo}[op]


def specs(layout):
    rows = P("x") if layout == "rows" else P()
    return dict(hidden=rows, weight=P("x") if layout == "vocab" else P(), actions=rows,
                old_logp=rows, rewards=rows, mask=rows)


def run(sizes, ops, backends, layouts, axis_type):
    devices = jax.local_devices()
    mesh = jax.make_mesh((len(devices),), ("x",), axis_types=(axis_type,), devices=devices)
    data = inputs(*sizes)
    rows, base = [], {}
    for op in ops:
        for backend in backends:
            for layout in layouts:
                if layout == "1dev":
                    placed = jax.device_put(data, devices[0])
                    n_dev = 1
                else:
                    placed = {k: jax.device_put(v, NamedSharding(mesh, specs(layout)[k]))
                              for k, v in data.items()}
                    n_dev = len(devices)
                loss = loss_fn(op, None if backend == "auto" else backend)
                step = jax.jit(jax.value_and_grad(
                    lambda h, w, x: loss(h, w, x), argnums=(0, 1)))
                args = (placed["hidden"], placed["weight"], placed)
                row = dict(op=op, backend=backend, layout=layout, devices=n_dev)
                try:
                    compiled = step.lower(*args).compile()
                    row["ms"] = common.median_ms(compiled, *args, warmup=2, runs=10)
                    row["temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
                    shard = placed["weight"].addressable_shards[0].data
                    row["weight_mib_per_dev"] = shard.size * shard.dtype.itemsize / 2**20
                    row["collectives"] = "; ".join(collectives(compiled.as_text()))
                except Exception as err:  # an OOM or a failure is a row, not a crash
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                if layout == "1dev" and "ms" in row:
                    base[(op, backend)] = row["ms"]
                if "ms" in row and (op, backend) in base:
                    row["speedup"] = base[(op, backend)] / row["ms"]
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                      flush=True)
                rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device)")
    parser.add_argument("--explicit", action="store_true", help="Explicit mesh axes")
    parser.add_argument("--backends", default="reference,auto")
    parser.add_argument("--layouts", default="1dev,rows,vocab")
    parser.add_argument("--sizes", default="large", choices=sorted(SIZES))
    args = parser.parse_args()
    sizes = SIZES["smoke" if args.smoke else args.sizes]
    layouts = args.layouts.split(",")
    rows = run(sizes, ["linear_logprobs", "linear_grpo_loss"], args.backends.split(","),
               layouts, AxisType.Explicit if args.explicit else AxisType.Auto)
    name = ("bench_many_devices" + ("_smoke" if args.smoke else "")
            + ("" if args.sizes == "large" else f"_{args.sizes}")
            + ("" if layouts == ["1dev", "rows", "vocab"] else "_" + "_".join(layouts))
            + ("_explicit" if args.explicit else ""))
    print(common.write_results(name, rows, COLUMNS + ["error"]))


if __name__ == "__main__":
    main()
