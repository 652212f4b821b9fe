"""Where a lean sampler-matched call's time goes: its forward with and without the statistics
pass, by the size of the kept-set kernel's blocks of rows, and by kernel.

Question: a lean ``linear_logprobs`` with ``top_k`` / ``top_p`` makes each block of float32
rows by a GEMM for the kept-set kernel (``backends.ffi.kept_set``); when those rows also give
each row's max and target logit, the forward needs no statistics pass over the vocabulary
(``logprob_core.stats_from_kept_set``). What does that save, what do wider blocks of rows
(``ffi.kept_set.ROW_BLOCK_BYTES``) add, and how are the kernels' times split? Inputs and the
step as ``bench_sampler_logprobs`` (``jax.jit(jax.value_and_grad(Σ g·logp, (hidden,
weight)))``, bf16, lean, backend automatic: on a Hopper GPU the ffi kernels). Rows:

- ``variant``: ``stats pass`` (the forward's statistics pass forced, as before it was
  skipped) or ``rows only``, with the block size in MiB; ``none`` is the plain call.

Columns: ``fwdbwd_ms`` the median of ``--runs`` synchronised calls after a warm-up
(``--rounds`` rotated rounds, the median kept), ``x_plain`` its ratio to the plain call,
``temp_mib`` XLA's temp size (``memory_analysis``), ``loss`` the value (the same in every
variant of a truncation); the per-kernel columns (top-k 50 and top-p 0.95 only, blocks of
128 and 256 MiB) are the mean device ms per call over one profiler trace of 3 calls:
``fwd`` the statistics kernel, ``rows_gemm`` XLA's GEMMs (the rows), ``kept`` the kept-set
kernel, ``grad`` the backward's grad kernel, ``gemms`` its CUTLASS GEMMs, ``other`` the rest.

    python -m benchmarks.studies.bench_sampler_forward --runs 10      # GPU (Hopper: the ffi kernels)
    python -m benchmarks.studies.bench_sampler_forward --small        # toy sizes, any device
    python -m benchmarks.studies.bench_sampler_forward --peak 256 top_p   # one call's device peak

``--peak MIB TRUNCATION`` (``none`` or ``top_p``): one lean call at the full size with blocks of
``MIB`` MiB, in a process of its own, printing XLA's temp size and the device's peak above the
inputs (``memory_stats``: XLA's temp size leaves out the FFI kernels' own workspace). The peak is
the process's: where the call does not raise it above what came before (the inputs' making,
the compile's autotuning), the line says so instead of a figure.

Results: ``bench_sampler_forward.{json,md}`` (``--name``) in out/bench (``--out``).
"""

from __future__ import annotations

import contextlib

from benchmarks.bench_sampler_logprobs import TRUNCATIONS

COLUMNS = [
    "variant",
    "truncation",
    "N",
    "D",
    "V",
    "fwdbwd_ms",
    "x_plain",
    "temp_mib",
    "loss",
    "fwd",
    "rows_gemm",
    "kept",
    "grad",
    "gemms",
    "other",
]
SIZES = {"full": [(4096, 2048, 131072)], "small": [(64, 32, 1000)]}
VARIANTS = (("stats pass", 128), ("rows only", 128), ("rows only", 256), ("rows only", 512))
"""(forward, ROW_BLOCK_BYTES in MiB)."""
KINDS = ("fwd", "rows_gemm", "kept", "grad", "gemms", "other")


def kernel_kind(name: str) -> str:
    if "linear_lse_kernel" in name or "linear_stats" in name:
        return "fwd"
    if "kept_set" in name:
        return "kept"
    if "linear_grad_kernel" in name or "weight_copy" in name or "weight_absmax" in name:
        return "grad"
    if "GemmUniversal" in name:
        return "gemms"
    if "gemm" in name.lower() or "nvjet" in name or "xmma" in name:
        return "rows_gemm"
    return "other"


def forward_variant(stats_pass: bool, block_mib: int) -> contextlib.ExitStack:
    """While tracing: the truncated forward's statistics pass forced (``stats_pass``), and the
    kept-set kernel's blocks of ``block_mib`` MiB of rows."""
    from unittest import mock

    from jaxrl_kernels.backends.ffi import kept_set as ffi_kept_set
    from jaxrl_kernels.engine import logprob_core

    patches = contextlib.ExitStack()
    if stats_pass:
        patches.enter_context(
            mock.patch.object(logprob_core, "stats_from_kept_set", lambda *args: False)
        )
    patches.enter_context(mock.patch.object(ffi_kept_set, "ROW_BLOCK_BYTES", block_mib * 2**20))
    return patches


def compiled_step(loss, data, stats_pass: bool, block_mib: int):
    """``jax.value_and_grad(loss, (hidden, weight))`` jitted and compiled for ``data`` under
    :func:`forward_variant`."""
    import jax

    with forward_variant(stats_pass, block_mib):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*data).compile()


def measure(size, runs, rounds, small):
    from benchmarks import common
    from benchmarks.bench_sampler_logprobs import calls, inputs

    n, d, v = size
    data = inputs(n, d, v)
    steps = []
    for forward, mib in VARIANTS:
        for name, trunc in TRUNCATIONS.items():
            if not trunc and (forward, mib) != VARIANTS[0]:
                continue
            loss = calls()[("lean", name)]  # a new function: traced under this variant
            step = compiled_step(loss, data, forward == "stats pass", mib)
            row = {
                "variant": f"{forward}, {mib} MiB" if trunc else "none",
                "truncation": name,
                "N": n,
                "D": d,
                "V": v,
                "temp_mib": step.memory_analysis().temp_size_in_bytes / 2**20,
                "loss": float(step(*data)[0]),
            }
            steps.append((row, step))
    common.rotated_ms(steps, data, runs=runs, rounds=rounds, warm_seconds=0.0 if small else 0.3)
    for row, step in steps:
        row["x_plain"] = row["fwdbwd_ms"] / steps[0][0]["fwdbwd_ms"]
        if (
            not small
            and row["truncation"] in ("top-k 50", "top-p 0.95")
            and not row["variant"].endswith("512 MiB")
        ):
            row.update(common.kernel_ms(step, data, KINDS, kind_of=kernel_kind))
        print(row, flush=True)
    return [row for row, _ in steps]


def print_peak(block_mib: int, truncation: str) -> None:
    """``--peak``: one lean call's XLA temp size and device peak above its inputs (MiB)."""
    import jax

    from benchmarks import common
    from benchmarks.bench_sampler_logprobs import calls, inputs

    data = inputs(*SIZES["full"][0])
    loss = calls()[("lean", {"none": "none", "top_p": "top-p 0.95"}[truncation])]
    step = compiled_step(loss, data, False, block_mib)
    inputs_mib = jax.devices()[0].memory_stats()["bytes_in_use"] / 2**20
    earlier_mib = common.peak_mib()  # the inputs' making, the compile's autotuning
    jax.block_until_ready(step(*data))
    peak_mib = common.peak_mib()
    call = (
        f"device peak above the inputs {peak_mib - inputs_mib:.1f} MiB"
        if peak_mib > earlier_mib
        else f"the call stayed under the process's earlier peak ({earlier_mib - inputs_mib:.1f} "
        f"MiB above the inputs): its own not measured"
    )
    print(
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {SIZES['full'][0]}, {truncation}, "
        f"blocks of {block_mib} MiB: temp {step.memory_analysis().temp_size_in_bytes / 2**20:.1f} "
        f"MiB, {call}",
        flush=True,
    )


def main(argv=None):
    import sys

    from benchmarks import common

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peak"]:
        return print_peak(int(argv[1]), argv[2])

    return common.sized_main(
        argv,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_sampler_forward",
        columns=COLUMNS,
        measure=measure,
        rounds=2,
    )


if __name__ == "__main__":
    main()
