"""Stop-string matching over streamed text (pure, no I/O).

All stop strings are matched at once by an Aho-Corasick automaton, so a token costs
time in proportion to its text, not to the number of stop strings: a request with
many stops slows only itself, and only by a constant factor.
"""

from __future__ import annotations


class _Automaton:
    """Aho-Corasick over characters. State 0 is the root; a state is a prefix of some stop."""

    def __init__(self, patterns: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        # The longest stop that is a suffix of the state's text (None: no stop ends here).
        self.longest: list[str | None] = [None]
        for pattern in patterns:
            state = 0
            for char in pattern:
                nxt = self.goto[state].get(char)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][char] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.fail.append(0)
                    self.longest.append(None)
                state = nxt
            self.longest[state] = pattern
        self._link()

    def _link(self) -> None:
        queue = list(self.goto[0].values())
        for state in queue:  # breadth first: a state's failure link is shallower than itself
            for char, child in self.goto[state].items():
                queue.append(child)
                fallback = self.fail[state]
                while char not in self.goto[fallback] and fallback:
                    fallback = self.fail[fallback]
                target = self.goto[fallback].get(char, 0)
                self.fail[child] = target if target != child else 0
                if self.longest[child] is None:
                    self.longest[child] = self.longest[self.fail[child]]

    def step(self, state: int, char: str) -> int:
        while char not in self.goto[state] and state:
            state = self.fail[state]
        return self.goto[state].get(char, 0)


class StopMatcher:
    """Finds the first stop string in streamed text, holding back any suffix
    that could still become one, so emitted text never contains a stop.

    The chunk that completes the first stop occurrence reports it; the text is cut
    at the earliest-starting occurrence complete in the text received so far.
    """

    def __init__(self, stops: list[str]):
        patterns = sorted({s for s in stops if s})
        self._automaton = _Automaton(patterns) if patterns else None
        self._state = 0
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        automaton = self._automaton
        if automaton is None:
            return text, None
        buffer = self._held + text
        offset, state, best = len(self._held), self._state, None
        for i, char in enumerate(text):
            state = automaton.step(state, char)
            stop = automaton.longest[state]
            if stop is not None:
                end = offset + i + 1
                # The longest stop ending here starts earliest; ties keep the one that ended first.
                if best is None or end - len(stop) < best[0]:
                    best = (end - len(stop), stop)
        if best is not None:
            self._held, self._state = "", 0
            return buffer[: best[0]], best[1]
        self._state = state
        hold = automaton.depth[state]
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
