"""Stop-string matching over streamed text (pure, no I/O)."""

from __future__ import annotations


class StopMatcher:
    """Finds the first stop string in streamed text, holding back any suffix
    that could still become one, so emitted text never contains a stop."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        buffer = self._held + text
        if not self._stops:
            return buffer, None
        hits = [(i, stop) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            index, stop = min(hits)
            self._held = ""
            return buffer[:index], stop
        hold = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-k:]):
                    longest = k
                    break
        return longest
