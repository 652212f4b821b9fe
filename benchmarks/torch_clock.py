"""The PyTorch workers' timer: the torch-side equivalent of ``common.time_calls``.

The workers that time PyTorch code run in processes of their own and never import JAX
(``side_by_side.torch_worker``, ``token_peers``, ``distill_torch_worker`` and
``bench_tokens.torch_worker``), so they cannot use ``benchmarks.common``; they all time
through :class:`Clock`, with the same practice: warm-up calls, then many synchronised calls,
their median and spread.
"""

from __future__ import annotations

import statistics
import time

import torch


class Clock:
    """Milliseconds of calls of ``fn()``: by the host clock around a call and a
    synchronisation (``torch.cuda.synchronize`` on a GPU), or by CUDA events around it."""

    def __init__(self, device: torch.device | None = None):
        device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn) -> float:
        """One call by the host clock, synchronised before and after."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return 1e3 * (time.perf_counter() - start)

    def device_ms(self, fn) -> float:
        """One call by CUDA events recorded around it."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def time_calls(
        self,
        fn,
        *,
        warmup: int = 3,
        runs: int = 20,
        budget_ms: float | None = None,
        events: bool = False,
    ) -> list[float]:
        """The ms of each of ``runs`` calls after ``warmup`` calls, by the host clock
        (:meth:`ms`) or by CUDA events (``events``, :meth:`device_ms`). ``budget_ms``: fewer
        runs for a slow ``fn`` (at least 5, at most ``runs``), from the first warm-up call's
        time."""
        first_ms = None
        for _ in range(warmup):
            ms = self.ms(fn)
            first_ms = ms if first_ms is None else first_ms
        if budget_ms is not None and first_ms is not None:
            runs = int(max(5, min(runs, budget_ms / max(first_ms, 1e-3))))
        one = self.device_ms if events else self.ms
        return [one(fn) for _ in range(runs)]


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def spread(samples: list[float]) -> float:
    """Largest less smallest sample."""
    return max(samples) - min(samples)
