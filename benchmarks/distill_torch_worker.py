"""Liger's ``fused_linear_jsd`` (torch) on the problem of ``bench_distill``: one JSON row.

Forward+backward: ``loss.backward()`` of its scalar JSD (β = 0.5, temperature 1, mean over the
N tokens: ``bench_distill``'s L for ``divergence="jsd"``) with respect to the student's h and
W. Time: the median of synchronised calls by the host clock (``torch_clock``); extra memory:
``torch.cuda.max_memory_allocated`` during the call above what was allocated before, less the
returned gradients. Where torch, a CUDA device or Liger is missing, the row says which.

    python -m benchmarks.distill_torch_worker --out rows.jsonl --size '{"N": 64, ...}'
"""

from __future__ import annotations

import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    size = json.loads(args.size)
    row = {"variant": "liger fused_linear_jsd", "divergence": "jsd", **size}

    def emit(**extra):
        row.update(extra)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("row:", row, flush=True)

    try:
        import torch

        from benchmarks import torch_clock
    except ImportError as err:
        return emit(note=f"skipped: torch does not import ({err})")
    if not torch.cuda.is_available():
        return emit(note="skipped: no CUDA device for torch (Liger's kernels are Triton)")
    try:
        import liger_kernel
        from liger_kernel.transformers.functional import liger_fused_linear_jsd
    except ImportError as err:
        return emit(note=f"skipped: liger-kernel does not import ({err})")

    n, ds, dt, v = size["N"], size["D_s"], size["D_t"], size["V"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    h = torch.randn(n, ds, device=dev, generator=gen).to(bf16).requires_grad_()
    w = (torch.randn(v, ds, device=dev, generator=gen) * (2.0 / ds**0.5)).to(bf16)
    w.requires_grad_()
    th = torch.randn(n, dt, device=dev, generator=gen).to(bf16)
    tw = (torch.randn(v, dt, device=dev, generator=gen) * (2.0 / dt**0.5)).to(bf16)

    def step():
        h.grad = w.grad = None
        loss = liger_fused_linear_jsd(h, w, th, tw, None, 0.5, -100, 1.0)
        loss.backward()
        return loss

    try:
        loss = step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = step()
        torch.cuda.synchronize()
        grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w))
        extra = (torch.cuda.max_memory_allocated() - before - grads) / 2**20
        times = torch_clock.Clock().time_calls(step, warmup=3, runs=args.runs)
        version = getattr(liger_kernel, "__version__", "?")
        emit(
            fwdbwd_ms=torch_clock.median(times),
            spread_ms=torch_clock.spread(times),
            temp_mib=extra,
            loss=float(loss),
            note=f"liger-kernel {version}; torch allocator peak above inputs, less the grads",
        )
    except Exception as err:  # one row saying what failed
        emit(error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
