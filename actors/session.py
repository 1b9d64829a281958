"""The session actor: one per request, between the scheduler and the caller.

Receives `protocols.session` messages in a coalescing inbox; detokenizes
incrementally (mlx-lm's streaming detokenizer), holds back text that may start
a stop string, asks the scheduler to finish the request when one matches, and
delivers `TokenDelta`/`PrefillProgress`/`Finished` to the caller through a
bounded stream. If the caller goes away, it asks for a cancel and ends. Every request
that ends (whether or not its caller still listens) is reported to its observer
(metrics, spans), with the gaps between its token deliveries.
"""

from __future__ import annotations

import time
from typing import Protocol, assert_never

import anyio
import structlog

from actors.mailbox import EventChannel, Mailbox, SessionMailbox
from policies.detokenize import Detokenizer
from policies.output_parser import Parsed, StreamParser
from policies.stops import StopMatcher
from protocols.api import DenoiseProgress, FillStats, Finished, PrefillProgress, SpecStats, Timings, TokenDelta, TokenLogprob, ToolCall, ToolCallDelta, Usage
from protocols.scheduler import CancelRequest, FinishRequest, SetPaused
from protocols.session import (
    DenoiseProgressed,
    PrefillProgressed,
    RequestFinished,
    RequestRejected,
    RequestTimeline,
    TokensGenerated,
)

log = structlog.get_logger(actor="session")


class RequestObserver(Protocol):
    """Told about every request's token deliveries and its end; must not block."""

    def inter_token(self, seconds: float) -> None: ...

    def request_ended(self, finished: Finished, timeline: RequestTimeline) -> None: ...


class SessionActor:
    def __init__(
        self,
        *,
        request_id: str,
        num_prompt_tokens: int,
        detokenizer: Detokenizer,
        stop: list[str],
        scheduler: Mailbox,
        events: EventChannel,
        parser: StreamParser | None = None,
        fill: FillStats | None = None,
        max_pause_s: float = 300.0,
        spec: SpecStats | None = None,
        observer: RequestObserver | None = None,
        stream_tool_calls: bool = False,
        report_progress: bool = True,
    ):
        self.request_id = request_id
        self._report_progress = report_progress
        # The prompt's scored tokens (`GenerateRequest.prompt_logprobs`), delivered with the first token.
        self._prompt_logprobs: list[TokenLogprob] | None = None
        # Report tool calls as they are generated (`ToolCallDelta`), not only once complete.
        self._stream_tool_calls = stream_tool_calls
        self.inbox = SessionMailbox()
        self._num_prompt_tokens = num_prompt_tokens
        self._detokenizer = detokenizer
        self._matcher = StopMatcher(stop)
        self._parser = parser
        # Fast-forwarding figures until the scheduler reports the engine's.
        self._fill = fill
        # Speculation figures until the engine's arrive (a refused request's reason).
        self._spec = spec
        self._num_calls = 0
        self._scheduler = scheduler
        self._events = events
        self._num_tokens = 0
        self._stop_sequence: str | None = None
        # The scheduler is done with the request (it sent RequestFinished or RequestRejected).
        self._ended = False
        # A caller that reads nothing for this long has its request cancelled (it keeps what
        # was generated, and learns why in `Finished.error` once it reads again).
        self._max_pause_s = max_pause_s
        self._stalled = False
        self._scope = anyio.CancelScope()
        self._observer = observer
        self._last_tokens_at: float | None = None

    def abandon(self) -> None:
        """Stop now (the runtime is shutting down and the caller is not reading): the caller
        gets what is queued, then the end of the stream without `Finished`."""
        self._scope.cancel()

    async def run(self) -> None:
        with self._events, self._scope:
            try:
                await self._serve()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The caller stopped listening: stop the request, and hold its id until
                # the scheduler is done with it, so a new request cannot take the id too early.
                with anyio.CancelScope(shield=True):
                    try:
                        await self._scheduler.send(CancelRequest(request_id=self.request_id))
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return  # the runtime is gone
                if not self._ended:
                    await self._drain()  # not shielded: a runtime shutting down cancels it

    async def _drain(self) -> None:
        while not isinstance(message := await self.inbox.receive(), RequestFinished | RequestRejected):
            pass
        self._ended = True
        if isinstance(message, RequestFinished):
            self._finished(message)  # nobody reads it, but it is counted

    async def _serve(self) -> None:
        while True:
            message = await self.inbox.receive()
            match message:
                case TokensGenerated():
                    await self._on_tokens(message)
                case PrefillProgressed(processed_tokens=done, total_tokens=total, prompt_logprobs=scored):
                    if scored is not None:
                        self._prompt_logprobs = (self._prompt_logprobs or []) + scored
                    if self._report_progress:
                        await self._emit(PrefillProgress(request_id=self.request_id, processed_tokens=done, total_tokens=total))
                case DenoiseProgressed(canvas=canvas, step=step, revealed=revealed, positions=positions):
                    if self._report_progress:
                        await self._emit(DenoiseProgress(request_id=self.request_id, canvas=canvas, step=step, revealed=revealed, positions=positions))
                case RequestFinished():
                    self._ended = True
                    await self._on_finished(message)
                    return
                case RequestRejected():
                    self._ended = True
                    await self._events.send(message)
                    return
                case _:
                    assert_never(message)

    async def _on_tokens(self, message: TokensGenerated) -> None:
        if self._stop_sequence is not None:
            return
        now = time.monotonic()
        if self._observer is not None and self._last_tokens_at is not None:
            self._observer.inter_token(now - self._last_tokens_at)
        self._last_tokens_at = now
        ids, texts = [], []
        for token in message.token_ids:
            self._num_tokens += 1
            ids.append(token)
            text, stop = self._matcher.feed(self._detokenizer.add(token))
            texts.append(text)
            if stop is not None:
                self._stop_sequence = stop
                await self._scheduler.send(FinishRequest(request_id=self.request_id))
                break
        logprobs = message.logprobs[: len(ids)] if message.logprobs is not None else None
        await self._deliver("".join(texts), ids, logprobs)

    async def _deliver(self, text: str, ids: list[int], logprobs=None, *, final: bool = False) -> None:
        """A TokenDelta for the new text (split into content and reasoning), then any tool calls."""
        parsed = Parsed(content=text)
        if self._parser is not None:
            parsed = self._parser.feed(text)
            if final:
                rest = self._parser.flush()
                parsed = Parsed(parsed.content + rest.content, parsed.reasoning + rest.reasoning, parsed.calls + rest.calls, parsed.deltas + rest.deltas)
        calls = []
        for call in parsed.calls:
            if "error" in call:
                parsed.content += call["raw"]  # not a call after all: keep the text visible
            else:
                calls.append(call)
        if ids or parsed.content or parsed.reasoning or not final:
            scored, self._prompt_logprobs = self._prompt_logprobs, None
            text = parsed.content
            await self._emit(
                TokenDelta(request_id=self.request_id, token_ids=ids, text=text, logprobs=logprobs, reasoning=parsed.reasoning, prompt_logprobs=scored)
            )
        for part in parsed.deltas if self._stream_tool_calls else []:
            await self._emit(ToolCallDelta(request_id=self.request_id, index=self._num_calls, id=self._call_id(), **part))
        for call in calls:
            await self._emit(ToolCall(request_id=self.request_id, index=self._num_calls, id=self._call_id(), **call))
            self._num_calls += 1

    def _call_id(self) -> str:
        return f"call-{self.request_id}-{self._num_calls}"

    async def _emit(self, event) -> None:
        """Deliver an event; while the caller is not reading, the request stops decoding.

        It restarts only once the caller has drained half of its buffer, so a reader
        slightly slower than decoding does not park and rejoin the row at every token.
        A caller that reads nothing for `max_pause_s` has its request cancelled.
        """
        events = self._events
        try:
            events.send_nowait(event)
            return
        except anyio.WouldBlock:
            pass
        await self._scheduler.send(SetPaused(request_id=self.request_id, paused=True))
        # Each event the caller takes re-arms the deadline: only a caller that reads nothing
        # for `max_pause_s` is given up on.
        while len(events) > events.capacity // 2:
            with anyio.move_on_after(self._max_pause_s) as deadline:
                await events.wait_room(len(events) - 1)
            if deadline.cancelled_caught:
                log.warning("caller_stalled", seconds=self._max_pause_s)
                self._stalled = True
                await self._scheduler.send(CancelRequest(request_id=self.request_id))
                await events.wait_room()
                break
        events.send_nowait(event)
        if not self._stalled:
            await self._scheduler.send(SetPaused(request_id=self.request_id, paused=False))

    async def _on_finished(self, message: RequestFinished) -> None:
        try:
            if self._stop_sequence is None:
                text, stop = self._matcher.feed(self._detokenizer.flush())
                self._stop_sequence = stop
                text += "" if stop is not None else self._matcher.flush()
                await self._deliver(text, [], final=True)
            elif self._parser is not None:
                await self._deliver("", [], final=True)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._finished(message)  # the caller left: nobody reads it, but it is counted
            raise
        await self._events.send(self._finished(message))

    def _finished(self, message: RequestFinished) -> Finished:
        """The request's last event, as reported to its observer."""
        num_completion = self._num_tokens + (message.stop_token_id is not None)
        reason = "stop" if self._stop_sequence is not None and message.finish_reason != "error" else message.finish_reason
        error = message.error
        if self._stalled and reason == "cancelled":
            error = f"the caller read nothing for {self._max_pause_s:g} s (scheduler.max_pause_s)"
        finished = Finished(
            request_id=self.request_id,
            finish_reason=reason,
            usage=Usage(prompt_tokens=self._num_prompt_tokens, completion_tokens=num_completion, cached_tokens=message.cached_tokens),
            timings=_timings(message.timeline, self._num_prompt_tokens, message.cached_tokens, num_completion),
            stop_sequence=self._stop_sequence,
            error=error,
            error_code=message.error_code if message.finish_reason == "error" else None,
            fill=message.fill or self._fill,
            checkpoint=message.checkpoint,
            spec=message.spec or self._spec,
            denoising_steps=message.denoising_steps,
        )
        if self._observer is not None:
            self._observer.request_ended(finished, message.timeline)
        return finished


def _timings(t: RequestTimeline, num_prompt: int, num_cached: int, num_completion: int) -> Timings:
    values = {"total_s": time.monotonic() - t.submitted}
    if t.admitted is not None:
        values["queue_s"] = t.admitted - t.submitted
    if t.first_token is not None:
        values["ttft_s"] = t.first_token - t.submitted
        started = t.prefill_started or t.admitted or t.submitted
        values["prefill_s"] = max(0.0, t.first_token - started)
        if t.first_token > started and num_prompt > num_cached:
            values["prefill_tokens_per_s"] = (num_prompt - num_cached) / (t.first_token - started)
        if t.last_token is not None and t.last_token > t.first_token:
            values["decode_s"] = t.last_token - t.first_token
            if num_completion > 1:
                values["decode_tokens_per_s"] = (num_completion - 1) / (t.last_token - t.first_token)
    return Timings(**values)
