"""The peer libraries' rows of ``benchmarks.bench_tokens`` (``--peers``), in a process of their
own: PyTorch only, never JAX, so that the two allocators never share it.

Per (N, D, V) of the sweep, forward+backward of QuACK's chunked linear cross-entropy and
Liger's fused linear cross-entropy on bf16 hidden [N, D] ~ N(0, 1), head [V, D] ~
N(0, 4/D) (the scale of ``bench_tokens.inputs``) and random targets. The implementations
are ``benchmarks.side_by_side.torch_worker``'s, imported, not copied: ``liger()`` gives
logp = −(per-token loss, reduction "none"), timed as L = Σ g·logp with a random cotangent
g ~ N(0, 1); ``quack(False)`` (``chunked_linear_cross_entropy``, ``use_scaled_exp=False``)
gives only the summed loss (its API has no per-token loss), timed as that L. Each is
``torch.autograd.grad(L, (h, W))``, timed as ``bench_tokens.torch_worker`` times the plain
torch code: CUDA events around each call, the median of ``runs`` calls after 3 warm-up calls.

The peers compute cross-entropy, that is the log-probs; the GRPO loss on top of them adds
one elementwise pass over [N] values, negligible beside the [N, V] work.

Records: ``{"impl", "N", "D", "V", "fwdbwd_ms", "version", "note"}``, or with ``"error"``
instead of ``"fwdbwd_ms"``. A peer that cannot be imported (or no CUDA GPU) gives one record,
without a size; one that fails at a size (out of memory) gives that size's record.

    python -m benchmarks.token_peers '[[512, 2048, 131072]]' 20   # one JSON line of records
"""

from __future__ import annotations

import json
import statistics
import sys

PEERS = ("QuACK chunked", "Liger")
"""Impl names of the rows, in table order."""
WARMUP = 3
NOTE = (
    "; cross-entropy (the log-probs): the GRPO loss on top of them adds one elementwise "
    "pass over [N], negligible"
)


def error_text(err: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(err).split())
    return f"{type(err).__name__}: {msg[:limit]}"


def makers(torch_worker):
    """``{impl: (maker, summed)}``: ``maker() -> (fn, version, note)`` from the side-by-side
    worker; ``summed``: fn returns the summed loss L, else the per-token logp [N]."""
    return {
        "QuACK chunked": (lambda: torch_worker.quack(False), True),
        "Liger": (torch_worker.liger, False),
    }


def fwdbwd_ms(fn, summed, h, w, t, g, runs, clock):
    """Median CUDA-event milliseconds of ``torch.autograd.grad(L, (h, W))`` after warm-up
    (``benchmarks.torch_clock``)."""
    import torch

    def fwdbwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = fn(hg, wg, t) if summed else (g * fn(hg, wg, t)).sum()
        return torch.autograd.grad(loss, (hg, wg))

    return statistics.median(clock.time_calls(fwdbwd, warmup=WARMUP, runs=runs, events=True))


def worker(sizes, runs):
    """The records (module docstring) of every peer at every ``(N, D, V)`` of ``sizes``."""
    try:
        import torch

        from benchmarks import torch_clock
        from benchmarks.side_by_side import torch_worker
    except Exception as err:  # noqa: BLE001 - no torch (or a broken one): no peer can run
        return [{"impl": impl, "error": "import failed: " + error_text(err)} for impl in PEERS]
    if not torch.cuda.is_available():
        return [
            {"impl": impl, "error": "skipped: its kernels need a CUDA GPU (torch sees none)"}
            for impl in PEERS
        ]
    out, ready = [], {}
    torch_version = f"torch {torch.__version__}"
    for impl, (make, summed) in makers(torch_worker).items():
        try:
            fn, version, note = make()
        except Exception as err:  # noqa: BLE001 - a missing or incompatible wheel: one record
            out.append({"impl": impl, "error": "import failed: " + error_text(err)})
            continue
        ready[impl] = (fn, summed, f"{version}, {torch_version}", note + NOTE)
    clock = torch_clock.Clock(torch.device("cuda"))
    for n, d, v in sizes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(v, d, device="cuda", generator=gen) * (2.0 / d**0.5)).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda", generator=gen)
        g = torch.randn(n, device="cuda", generator=gen)
        for impl, (fn, summed, version, note) in ready.items():
            row = {"impl": impl, "N": n, "D": d, "V": v}
            try:
                row["fwdbwd_ms"] = fwdbwd_ms(fn, summed, h, w, t, g, runs, clock)
            except Exception as err:  # noqa: BLE001 - out of memory: this size's record says so
                row["error"] = error_text(err)
            row.update(version=version, note=note)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.append(row)
            torch.cuda.empty_cache()
        del h, w, t, g
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]), int(sys.argv[2]))))
