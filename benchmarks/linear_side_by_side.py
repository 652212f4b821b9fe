"""Linear log-probs side by side: jaxrl_kernels, XLA, tokamax, torch, Liger, Cut Cross-Entropy.

The same problem for all (``benchmarks.side_by_side.shared``): bf16 h [N, D] ~ N(0, 1),
W [V, D] ~ N(0, 1.5²/D), random targets, L = Σ g·logp with g ~ N(0, 1); by default N=4096,
D=2048, V=131072. One process per job, one after the other, so that memory pools never meet:

1. ``side_by_side.exact``: draws the inputs and computes the exact d_hidden, d_weight in
   float64 (JAX, x64, vocabulary chunks), into a temporary .npz;
2. ``side_by_side.jax_worker``: jaxrl_kernels (automatic backend with weight_layout "vd" and
   "dv", explicit pallas and chunked), XLA with materialised logits, tokamax's
   linear_softmax_cross_entropy_loss (its default and chunked_xla);
3. ``side_by_side.torch_worker``: torch with materialised logits, Liger's fused linear
   cross-entropy, Cut Cross-Entropy (gradient filtering on, its default, and off).

Each worker loads the same bf16 bits and writes its rows as JSON lines; a framework that
cannot run (missing wheel, out of memory, crash, time budget) gets rows that say why. Rows:
impl, layout, N, D, V, fwd_ms, fwdbwd_ms (median ms by the host clock around a synchronised
call), fwd_device_ms, fwdbwd_device_ms (median device time: CUDA events for torch, the
kernels' span in a profiler trace for JAX), fwdbwd_extra_mb (MiB beyond inputs and
outputs: XLA's temp size; torch's allocator peak less inputs and gradients), err_dh, err_dW
(‖got − exact‖/‖exact‖), bitwise_repeat (two forward+backward runs give the same bits).
Nothing is installed here: Liger, Cut Cross-Entropy and tokamax are imported if present.

    python -m benchmarks.linear_side_by_side            # the table (GPU)
    python -m benchmarks.linear_side_by_side --size large --impls A,B   # N=8192, D=4096
    python -m benchmarks.linear_side_by_side --smoke    # tiny sizes, any device

Results: ``linear_side_by_side.{json,md}`` (benchmarks.common.write_results).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

from benchmarks import output
from benchmarks.side_by_side import shared
from benchmarks.workers import failure, run_worker

# seconds: (full, smoke); each worker stops starting new rows at its budget and is killed
# GRACE seconds after it.
BUDGETS = {"exact": (120, 300), "jax": (280, 600), "torch": (90, 300)}
GRACE = 45


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, two timed runs")
    parser.add_argument(
        "--size",
        choices=("full", "large"),
        default="full",
        help="full: N=4096, D=2048, V=131072; large: N=8192, D=4096",
    )
    parser.add_argument("--impls", help="only these impl names, comma-separated (default: all)")
    parser.add_argument("--frameworks", default="jax,torch")
    parser.add_argument(
        "--torch-python",
        default=sys.executable,
        help="the interpreter of the PyTorch worker (default: this one)",
    )
    parser.add_argument("--keep", help="keep the inputs/exact .npz at this path")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="JOB=SECONDS",
        help="override a job's time budget (exact, jax, torch)",
    )
    args = parser.parse_args()
    which = 1 if args.smoke else 0
    budgets = {job: pair[which] for job, pair in BUDGETS.items()}
    for item in args.budget:
        job, seconds = item.split("=")
        budgets[job] = float(seconds)
    size = "smoke" if args.smoke else args.size
    impls = shared.selected(args.impls)
    n, d, v = shared.SIZES[size]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="side_by_side_"))
    data = pathlib.Path(args.keep) if args.keep else tmp / "inputs_exact.npz"
    rows = []
    try:
        limit = budgets["exact"]
        chunk = ["--chunk", "384"] if args.smoke else []
        code, tail = run_worker(
            "benchmarks.side_by_side.exact",
            ["--out", str(data), "--size", size, *chunk],
            sys.executable,
            limit,
        )
        exact_error = None if code == 0 else "exact gradients: " + failure(code, tail, limit)
        for framework in args.frameworks.split(","):
            jsonl = tmp / f"{framework}.jsonl"
            reason = exact_error
            if reason is None:
                budget = budgets[framework]
                python = args.torch_python if framework == "torch" else sys.executable
                worker_args = [
                    "--data",
                    str(data),
                    "--out",
                    str(jsonl),
                    "--deadline",
                    str(time.time() + budget),
                ]
                worker_args += ["--impls", args.impls] if args.impls else []
                code, tail = run_worker(
                    f"benchmarks.side_by_side.{framework}_worker",
                    worker_args + (["--smoke"] if args.smoke else []),
                    python,
                    budget + GRACE,
                )
                reason = None if code == 0 else failure(code, tail, budget + GRACE)
            got = {(r["impl"], r["layout"]): r for r in shared.read_rows(jsonl)}
            for impl, layout in impls[framework]:
                rows.append(
                    got.get((impl, layout))
                    or {
                        "impl": impl,
                        "layout": layout,
                        "N": n,
                        "D": d,
                        "V": v,
                        "error": reason or "the worker wrote no row for it",
                    }
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Only now does this process touch a device (metadata), after every worker has exited.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchmarks import common

    name = "linear_side_by_side" + ("_large" if size == "large" else "")
    print(common.write_results(name, rows, shared.COLUMNS))


if __name__ == "__main__":
    main()
