"""What a caller already has of a request, and a later run's events past it.

A model pool's request may run more than once (its model was swapped out under it); generation
is exact given the seed, so a later run repeats what the caller has: `Replay` yields only what
is new (tokens, text, reasoning, tool calls), from the same detokenizer's cumulative text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from protocols.api import Event, Finished, TokenDelta, ToolCall, ToolCallDelta, Usage
from runtime.errors import InternalError


@dataclass
class Delivered:
    """What the caller already has of a request: replays skip it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    tool_calls: int = 0
    # The argument text of each streamed call (`ToolCallDelta`), by index.
    call_arguments: dict[int, str] = field(default_factory=dict)
    # The calls whose name went out (their first `ToolCallDelta`).
    call_names: set[int] = field(default_factory=set)


class Replay:
    """One run's events against what the caller already has (a run after a swap repeats it
    exactly): `new` is the part of a delta past it, `record` marks a part delivered."""

    def __init__(self, delivered: Delivered):
        self.delivered = delivered
        self.seen = Delivered()
        # A text-only part (a final flush of text held back for stop strings): delivered with
        # the run's next event, never if the run is cut first (a later run repeats it).
        self.held: TokenDelta | None = None

    def deliver(self, event: Event) -> list[Event]:
        """What of this run's `event` the caller gets, marked delivered."""
        if isinstance(event, TokenDelta):
            part = self.new(event)
            if part is not None and not part.token_ids:
                self.held = part
            elif part is not None:
                self.held = None  # (its text is in this part: `held` was not recorded)
                self.record(part)
                return [part]
            return []
        out: list[Event] = []
        if self.held is not None:
            self.record(self.held)
            out.append(self.held)
            self.held = None
        if isinstance(event, ToolCallDelta):
            call_part = self.new_call_delta(event)
            if call_part is not None:
                out.append(call_part)
        elif isinstance(event, ToolCall):
            if self.new_tool_call():
                out.append(event)
        elif isinstance(event, Finished) or not self.delivered.token_ids:
            out.append(event)  # the end, or prefill progress before any token
        return out

    def new(self, event: TokenDelta) -> TokenDelta | None:
        seen, have = self.seen, self.delivered
        seen.token_ids += event.token_ids
        seen.text += event.text
        seen.reasoning += event.reasoning
        fresh = len(seen.token_ids) - len(have.token_ids)
        if fresh <= 0 and len(seen.text) <= len(have.text) and len(seen.reasoning) <= len(have.reasoning):
            return None
        if not (seen.text.startswith(have.text) and seen.reasoning.startswith(have.reasoning)):
            raise InternalError("a resumed stream differs from what it replays")
        return msgspec.structs.replace(
            event,
            token_ids=seen.token_ids[len(have.token_ids) :] if fresh > 0 else [],
            text=seen.text[len(have.text) :],
            reasoning=seen.reasoning[len(have.reasoning) :],
            logprobs=(event.logprobs[-fresh:] if fresh > 0 else []) if event.logprobs else event.logprobs,
            # The prompt's scores went out with the caller's first delta.
            prompt_logprobs=event.prompt_logprobs if not have.token_ids else None,
        )

    def record(self, part: TokenDelta) -> None:
        self.delivered.token_ids += part.token_ids
        self.delivered.text += part.text
        self.delivered.reasoning += part.reasoning

    def new_call_delta(self, event: ToolCallDelta) -> ToolCallDelta | None:
        """The part of a streamed call's delta past what the caller has of that call."""
        seen, have = self.seen, self.delivered
        if event.name is not None:
            if event.index in have.call_names:
                return None
            have.call_names.add(event.index)
            return event
        text = seen.call_arguments[event.index] = seen.call_arguments.get(event.index, "") + event.arguments
        sent = have.call_arguments.get(event.index, "")
        if len(text) <= len(sent):
            return None
        if not text.startswith(sent):
            raise InternalError("a resumed stream differs from what it replays")
        have.call_arguments[event.index] = text
        return msgspec.structs.replace(event, arguments=text[len(sent) :])

    def new_tool_call(self) -> bool:
        self.seen.tool_calls += 1
        if self.seen.tool_calls <= self.delivered.tool_calls:
            return False
        self.delivered.tool_calls = self.seen.tool_calls
        return True


def cancelled(rid: str, delivered: Delivered) -> Finished:
    return Finished(request_id=rid, finish_reason="cancelled", usage=Usage(prompt_tokens=0, completion_tokens=len(delivered.token_ids)))
