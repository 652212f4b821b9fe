"""A dependency-free progress bar with live metrics.

On a terminal it redraws one line in place; elsewhere (CI logs, pipes) it
prints a line at every tenth of the work so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        width: int = 24,
    ):
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, done: int, **fields: float | str) -> None:
        if not self.enabled:
            return
        decile = 10 * done // self.total
        if not self.tty and decile == self._last_decile and done < self.total:
            return
        self._last_decile = decile
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()]
        line = (
            f"{self.label} [{bar}] {done}/{self.total} "
            + " ".join(parts)
            + f" | {rate:.1f} it/s, {elapsed:.0f}s elapsed, eta {eta:.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
