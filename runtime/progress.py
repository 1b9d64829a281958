"""Progress for long operations: a live line on a terminal, log events otherwise."""

from __future__ import annotations

import sys
import threading
import time

import structlog

log = structlog.get_logger(actor="progress")


class Progress:
    """Reports steps of one operation (model load, benchmark, long prefill).

    Thread-safe: model loading reports from the MLX thread.
    """

    def __init__(self, operation: str, *, stream=None):
        self.operation = operation
        self._stream = stream or sys.stderr
        self._is_tty = self._stream.isatty()
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def step(self, message: str) -> None:
        with self._lock:
            if self._is_tty:
                elapsed = time.monotonic() - self._started
                self._stream.write(f"\r\x1b[2K[{self.operation} {elapsed:5.1f}s] {message}")
                self._stream.flush()
            else:
                log.info("progress", operation=self.operation, message=message)

    def fraction(self, done: int, total: int, label: str = "") -> None:
        if self._is_tty:
            width = 30
            filled = int(width * done / max(total, 1))
            self.step(f"{label}[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        else:
            with self._lock:
                log.info("progress", operation=self.operation, done=done, total=total, label=label)

    def done(self, message: str = "done") -> None:
        with self._lock:
            elapsed = time.monotonic() - self._started
            if self._is_tty:
                self._stream.write(f"\r\x1b[2K[{self.operation}] {message} ({elapsed:.1f}s)\n")
                self._stream.flush()
            else:
                log.info("progress_done", operation=self.operation, message=message, elapsed_s=round(elapsed, 3))

    __call__ = step
