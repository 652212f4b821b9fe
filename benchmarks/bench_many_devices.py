"""Linear-head ops fwd+bwd on one device vs all local devices, per layout, against the plain code.

Layouts (``Auto`` mesh axes unless ``--explicit``):
  ``1dev``  everything on device 0;
  ``rows``  hidden states / targets / per-token inputs split over a 1-D mesh ``x`` of every
            local device (data parallel), the weight replicated;
  ``vocab`` the weight split over its vocabulary on ``x`` (tensor parallel), rows replicated;
  ``both``  a 2-D mesh ``(x, y)`` of shape ``(n / 2, 2)`` (an even n >= 4): rows split over
            ``x``, the vocabulary over ``y``;
  ``fsdp``  FSDP (data parallel with the parameters sharded, as MaxText and tunix train): rows
            split over ``x`` and the weight [V, D] over ``x`` too, on its D; each call
            all-gathers the weight and reduce-scatters its gradient (docs/api.md, "A head
            sharded over the rows' axis");
  ``fsdp_v`` the same with the weight split on its V.
  (The plain code gathers the FSDP weight itself, as a user's FSDP layer does: Explicit axes
  would refuse its einsum of rows and weight split over one axis.)
Implementations (``--backends``): ``jnp_bf16``, the plain code a JAX user writes (an
``einsum`` to bf16 logits, float32 ``log_softmax`` through ``jk.token_logprobs``'s reference
backend, the same loss), under the same shardings (GSPMD partitions it); ``auto``, the library's
default (lean); ``fast``, ``memory="fast"``; ``reference`` or any backend name, that backend.
For each: the median time of value_and_grad (wall clock around ``block_until_ready``), XLA's
temp buffer size, the bytes of the weight each device holds, and every collective of the
compiled program with its bytes (the hidden states, logits or weight must never be gathered).
``--profile`` adds where one call's time goes on the first device of each split layout (a
profiler trace: its span, the compute kernels' busy time, the NCCL kernels' time and how much
of it no compute kernel overlaps), and when each device's kernels start and end within the
host call.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices              # N=8192, D=4096, V=131072 bf16
    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices --layouts 1dev --sizes base
                                                     # one GPU, N=4096 (B=8, T=512), D=2048
    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices --sizes base,n4k_d4096,n16k_d2048,n16k_d4096 \
        --layouts 1dev,rows,vocab,both --backends jnp_bf16,auto,fast --ops linear_grpo_loss \
        --profile                                                  # the 4-GPU grid
    PYTHONPATH=$PWD python3 -m benchmarks.bench_many_devices --smoke      # tiny, e.g. on CPU with
        XLA_FLAGS=--xla_force_host_platform_device_count=8

Results: ``bench_many_devices.{json,md}`` (benchmarks.common.write_results; the name adds
the sizes and layouts when not the default, and the device count beyond two).
"""

from __future__ import annotations

import argparse
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from benchmarks import common, output

COLUMNS = [
    "op",
    "backend",
    "N",
    "D",
    "layout",
    "devices",
    "ms",
    "speedup",
    "temp_mib",
    "weight_mib_per_dev",
    "collectives",
    "profile",
]
OPS = ["linear_logprobs", "linear_grpo_loss"]
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
    "n4k_d4096": (8, 512, 4096, 131072),
    "large": (16, 512, 4096, 131072),
    "n16k_d2048": (32, 512, 2048, 131072),
    "n16k_d4096": (32, 512, 4096, 131072),
}


def inputs(b, t, d, v, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        hidden=jnp.asarray(rng.standard_normal((b, t, d), np.float32), jnp.bfloat16),
        weight=jnp.asarray(
            rng.standard_normal((v, d), np.float32) * 1.5 / np.sqrt(d), jnp.bfloat16
        ),
        actions=jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32),
        old_logp=jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32),
        rewards=jnp.asarray(rng.standard_normal(b), jnp.float32),
        mask=jnp.asarray(rng.random((b, t)) < 0.9, jnp.float32),
    )


def loss_fn(op, impl):
    """``loss(hidden, weight, inputs)`` of ``op`` by ``impl`` (the module docstring)."""
    if impl == "jnp_bf16":

        def logp_of(h, w, x):
            return jk.token_logprobs(
                jnp.einsum("btd,vd->btv", h, w), x["actions"], backend="reference"
            )
    else:
        kw = {"memory": "fast"} if impl == "fast" else {"backend": None if impl == "auto" else impl}

        def logp_of(h, w, x):
            return jk.linear_logprobs(h, w, x["actions"], **kw)

    def logprobs(h, w, x):
        return jnp.sum(logp_of(h, w, x) * x["mask"])

    def grpo(h, w, x):
        if impl == "jnp_bf16":
            adv = jk.group_advantages(x["rewards"], groups=jk.Groups(size=4))
            return jk.ppo_loss(logp_of(h, w, x), x["old_logp"], adv, x["mask"])[0]
        return jk.linear_grpo_loss(
            h,
            w,
            x["actions"],
            x["old_logp"],
            x["rewards"],
            x["mask"],
            groups=jk.Groups(size=4),
            **kw,
        )[0]

    return {"linear_logprobs": logprobs, "linear_grpo_loss": grpo}[op]


FSDP_LAYOUTS = ("fsdp", "fsdp_v")


def gathered_head(loss, mesh, axis_type):
    """``loss`` on the weight gathered whole first (the plain code's FSDP all-gather)."""
    whole = NamedSharding(mesh, P())

    def gather(w):
        if axis_type == AxisType.Explicit:
            return jax.sharding.reshard(w, whole)
        return jax.lax.with_sharding_constraint(w, whole)

    return lambda h, w, x: loss(h, gather(w), x)


def _merged(spans):
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(spans, cover):
    """How much of the disjoint ``spans`` the disjoint ``cover`` intervals overlap."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in cover)


def time_split(fn, args):
    """Where one call's time goes on the first device (its profiler trace's kernels): 'span S
    ms: compute C (GEMMs G), nccl X (Y not overlapped)', then the host call's length and,
    for every device, its first kernel's start and last kernel's end from the host call's
    start: 'call H ms, devices 0.31–6.12, 0.35–6.15' (a device that starts late holds the
    others in the collectives and lengthens the call)."""
    kernels, host, meta = common.traced(fn, args, calls=2)
    last = [e for e in host if e["name"] == "call1"][0]
    in_call = [k for k in kernels if last["ts"] <= k["ts"] < last["ts"] + last["dur"]]
    names = {
        e["pid"]: str(e.get("args", {}).get("name", ""))
        for e in meta
        if e.get("name") == "process_name"
    }
    first = min(
        (pid for pid in {k["pid"] for k in kernels}),
        key=lambda pid: ("GPU:0" not in names.get(pid, ""), pid),
    )
    mine = [(k["ts"], k["ts"] + k["dur"], k["name"].lower()) for k in in_call if k["pid"] == first]
    if not mine:
        return "no device kernels traced"
    nccl = _merged([(a, b) for a, b, name in mine if "nccl" in name])
    compute = _merged([(a, b) for a, b, name in mine if "nccl" not in name])
    gemm = _merged(
        [
            (a, b)
            for a, b, name in mine
            if "nccl" not in name
            and any(g in name for g in ("gemm", "nvjet", "xmma", "cutlass", "sm90", "wgmma"))
        ]
    )
    size = lambda spans: sum(b - a for a, b in spans) / 1e3
    span = (max(b for _, b, _ in mine) - min(a for a, _, _ in mine)) / 1e3
    exposed = size(nccl) - _overlap(nccl, compute) / 1e3
    per_device = []
    for pid in sorted({k["pid"] for k in in_call}, key=lambda pid: names.get(pid, str(pid))):
        theirs = [k for k in in_call if k["pid"] == pid]
        start = (min(k["ts"] for k in theirs) - last["ts"]) / 1e3
        end = (max(k["ts"] + k["dur"] for k in theirs) - last["ts"]) / 1e3
        per_device.append(f"{start:.2f}–{end:.2f}")
    return (
        f"span {span:.2f} ms: compute {size(compute):.2f} (GEMMs {size(gemm):.2f}), "
        f"nccl {size(nccl):.2f} ({exposed:.2f} not overlapped); call {last['dur'] / 1e3:.2f}"
        f" ms, devices {', '.join(per_device)}"
    )


def specs(layout):
    """The PartitionSpec of each input in ``layout``."""
    rows = P("x") if layout in ("rows", "both") + FSDP_LAYOUTS else P()
    weight = {"vocab": P("x"), "both": P("y"), "fsdp": P(None, "x"), "fsdp_v": P("x")}.get(
        layout, P()
    )
    return dict(hidden=rows, weight=weight, actions=rows, old_logp=rows, rewards=rows, mask=rows)


def meshes(axis_type):
    """``{layout kind: mesh}``: 1-D over every local device, and 2-D (rows × vocabulary)
    where the device count is even and at least 4."""
    devices = jax.local_devices()
    out = {"1d": jax.make_mesh((len(devices),), ("x",), axis_types=(axis_type,), devices=devices)}
    if len(devices) >= 4 and len(devices) % 2 == 0:
        out["2d"] = jax.make_mesh(
            (len(devices) // 2, 2), ("x", "y"), axis_types=(axis_type,) * 2, devices=devices
        )
    return out


def run(sizes, ops, backends, layouts, axis_type, profile=False):
    devices = jax.local_devices()
    mesh_of = meshes(axis_type)
    data = inputs(*sizes)
    b, t, d, _ = sizes
    rows, base = [], {}
    for op in ops:
        for backend in backends:
            for layout in layouts:
                row = dict(
                    op=op,
                    backend=backend,
                    N=b * t,
                    D=d,
                    layout=layout,
                    devices=1 if layout == "1dev" else len(devices),
                )
                mesh = mesh_of.get("2d" if layout == "both" else "1d")
                if mesh is None:
                    row["error"] = "layout 'both' needs an even number of devices, at least 4"
                    rows.append(row)
                    continue
                if layout == "1dev":
                    placed = jax.device_put(data, devices[0])
                else:
                    placed = {
                        k: jax.device_put(v, NamedSharding(mesh, specs(layout)[k]))
                        for k, v in data.items()
                    }
                loss = loss_fn(op, backend)
                if backend == "jnp_bf16" and layout in FSDP_LAYOUTS:
                    loss = gathered_head(loss, mesh, axis_type)
                step = jax.jit(jax.value_and_grad(lambda h, w, x: loss(h, w, x), argnums=(0, 1)))
                args = (placed["hidden"], placed["weight"], placed)
                try:
                    with jax.set_mesh(mesh) if layout != "1dev" else contextlib.nullcontext():
                        compiled = step.lower(*args).compile()
                    row["ms"] = common.median_ms(compiled, *args, warmup=2, runs=10)
                    row["temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
                    shard = placed["weight"].addressable_shards[0].data
                    row["weight_mib_per_dev"] = shard.size * shard.dtype.itemsize / 2**20
                    row["collectives"] = "; ".join(collectives(compiled.as_text()))
                    if profile and layout != "1dev" and jax.default_backend() == "gpu":
                        try:
                            row["profile"] = time_split(compiled, args)
                        except Exception as err:  # the timing above stands without it
                            row["profile"] = f"no profile: {type(err).__name__}: {err}"[:200]
                except Exception as err:  # an OOM or a failure is a row, not a crash
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                if layout == "1dev" and "ms" in row:
                    base[(op, backend)] = row["ms"]
                if "ms" in row and (op, backend) in base:
                    row["speedup"] = base[(op, backend)] / row["ms"]
                print(
                    {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                    flush=True,
                )
                rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device)")
    parser.add_argument("--explicit", action="store_true", help="Explicit mesh axes")
    parser.add_argument(
        "--backends",
        default="reference,auto",
        help="comma-separated: jnp_bf16, auto (lean), fast, or a backend name",
    )
    parser.add_argument(
        "--layouts", default="1dev,rows,vocab", help="of 1dev, rows, vocab, both, fsdp, fsdp_v"
    )
    parser.add_argument(
        "--sizes", default="large", help=f"comma-separated, of {', '.join(sorted(SIZES))}"
    )
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="where each split layout's time goes (GPU: a profiler trace)",
    )
    args = parser.parse_args()
    sizes = ["smoke"] if args.smoke else args.sizes.split(",")
    layouts = args.layouts.split(",")
    rows = []
    for size in sizes:
        rows += run(
            SIZES[size],
            args.ops.split(","),
            args.backends.split(","),
            layouts,
            AxisType.Explicit if args.explicit else AxisType.Auto,
            args.profile,
        )
    name = (
        "bench_many_devices"
        + ("_smoke" if args.smoke else "")
        + ("" if args.sizes == "large" else "_" + args.sizes.replace(",", "_"))
        + ("" if layouts == ["1dev", "rows", "vocab"] else "_" + "_".join(layouts))
        + ("_explicit" if args.explicit else "")
        + (f"_{len(jax.local_devices())}dev" if len(jax.local_devices()) > 2 else "")
    )
    print(common.write_results(name, rows, COLUMNS + ["error"]))


if __name__ == "__main__":
    main()
