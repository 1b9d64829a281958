"""Progress for long operations: a live line on a terminal (tqdm), log events otherwise."""

from __future__ import annotations

import sys
import threading
import time

import structlog
from tqdm import tqdm

log = structlog.get_logger(actor="progress")

_STEP_FORMAT = "{desc} [{elapsed}]"
_BAR_FORMAT = "{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"


class Progress:
    """Reports steps of one operation (model load, benchmark, long prefill).

    On a terminal one live line (a bar once `fraction` gives a total) replaced by one summary
    line at `done` (none when `summary` is false: a one-shot command shows only its answer);
    elsewhere structured log events. Thread-safe: model loading reports from the MLX thread."""

    def __init__(self, operation: str, *, stream=None, summary: bool = True):
        self.operation = operation
        self._summary = summary
        self._stream = stream or sys.stderr
        self._is_tty = self._stream.isatty()
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._bar: tqdm | None = None

    def _line(self) -> tqdm:
        if self._bar is None:
            self._bar = tqdm(file=self._stream, bar_format=_STEP_FORMAT, leave=False, dynamic_ncols=True, desc=self.operation)
        return self._bar

    def step(self, message: str) -> None:
        with self._lock:
            if self._is_tty:
                line = self._line()
                line.bar_format = _STEP_FORMAT
                line.set_description_str(f"{self.operation}: {message}")
            else:
                log.info("progress", operation=self.operation, message=message)

    def fraction(self, done: int, total: int, label: str = "") -> None:
        with self._lock:
            if self._is_tty:
                line = self._line()
                line.bar_format, line.total, line.n = _BAR_FORMAT, max(total, 1), done
                line.set_description_str(f"{self.operation}{': ' + label if label else ''}")
            else:
                log.info("progress", operation=self.operation, done=done, total=total, label=label)

    def done(self, message: str = "done") -> None:
        with self._lock:
            elapsed = time.monotonic() - self._started
            if self._is_tty:
                self._close_line()
                if self._summary:
                    self._stream.write(f"[{self.operation}] {message} ({elapsed:.1f}s)\n")
                    self._stream.flush()
            else:
                log.info("progress_done", operation=self.operation, message=message, elapsed_s=round(elapsed, 3))

    def clear(self) -> None:
        """Remove the live line (if any) without a summary: the operation failed or was left."""
        with self._lock:
            self._close_line()

    def _close_line(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    __call__ = step
