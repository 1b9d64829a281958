"""Several choices in one response: `n` samples of a prompt, or several prompts (completions).

Each choice is a runtime request of its own, submitted together (a seeded request's choices take
seeds seed, seed + 1, ...). `Merged` forwards their events into one stream as they come, from a
task of the response's own (`run`); `Choices` is one `Output` over the choices' outputs: their
chunks carry each choice's `index`, the whole response lists every choice, usage adds up, and a
request that fails fails the response."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import msgspec

from net.http import openai_types as oa
from net.http.outputs import OpenAIWire, Output, ending_error, usage_of
from protocols.api import Event, Finished, GenerateRequest, SamplingParams, Usage
from runtime.serving import EventStream, Serving


class Merged:
    """The events of several requests, in the order they arrive (each stream's refusal comes out
    where its events would). Closing it closes (and so cancels) them all.

    A `follower` is submitted once its leader's first event arrives: the leader has prefilled the
    prompt they share by then and kept it as a prefix (`snapshot_at`), so the prompt is prefilled
    once, not once per choice."""

    def __init__(self, leaders: Sequence[EventStream], followers: Sequence[tuple[int, Callable[[], EventStream]]] = ()):
        self.streams = list(leaders)
        self.request_id = self.streams[0].request_id
        self._followers = list(followers)
        self._started = [anyio.Event() for _ in self.streams]
        self._send, self._receive = anyio.create_memory_object_stream[Event | Exception](4 * (len(self.streams) + len(self._followers)))
        # `run`'s scope, and when it has ended: `aclose` stops the forwarding before it closes
        # the streams (closing a stream another task is iterating raises in that task).
        self._running: anyio.CancelScope | None = None
        self._ran = anyio.Event()

    async def run(self) -> None:
        """Forward every stream's events until all have ended (run it beside the reader)."""
        try:
            with anyio.CancelScope() as self._running:
                async with self._send, anyio.create_task_group() as tg:
                    for i, stream in enumerate(list(self.streams)):
                        tg.start_soon(self._forward, stream, self._send.clone(), self._started[i])
                    for leader, submit in self._followers:
                        tg.start_soon(self._follow, leader, submit, self._send.clone())
        finally:
            self._ran.set()

    async def _follow(self, leader: int, submit: Callable[[], EventStream], send: Any) -> None:
        await self._started[leader].wait()
        try:
            stream = submit()
        except Exception as exc:
            async with send:
                await send.send(exc)
            return
        self.streams.append(stream)
        await self._forward(stream, send, anyio.Event())

    @staticmethod
    async def _forward(stream: EventStream, send: Any, started: anyio.Event) -> None:
        async with send:
            try:
                async for event in stream:
                    started.set()
                    await send.send(event)
            except Exception as exc:  # its refusal, for the reader to raise
                await send.send(exc)
            finally:
                started.set()  # (a leader that failed: its followers go on their own)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        async for item in self._receive:
            if isinstance(item, Exception):
                raise item
            yield item

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._running is not None:
                self._running.cancel()
                await self._ran.wait()
            for stream in self.streams:
                await stream.aclose()
        self._receive.close()


class Choices(OpenAIWire):
    """One response over several choices' outputs (OpenAI's wire: chat or text completions)."""

    def __init__(self, outputs: list[Output], request_ids: list[str], *, include_usage: bool):
        self.outputs = outputs
        self.by_request = dict(zip(request_ids, outputs))
        self.stream = outputs[0].stream
        self.include_usage = include_usage
        self.finished: Finished | None = None
        self._opened: set[int] = set()  # the outputs whose first chunk went out

    def first_chunk(self) -> Any | None:
        return None  # each choice's own opens it (`on_event`)

    def on_event(self, event: Event) -> list[Any]:
        output = self.by_request[event.request_id]
        chunks = []
        if self.stream and id(output) not in self._opened:
            self._opened.add(id(output))
            first = output.first_chunk()
            chunks += [first] if first is not None else []
        chunks += [c for c in output.on_event(event) if c.choices]  # (usage chunks: one for all, below)
        if isinstance(event, Finished):
            self._check_finished()
            if self.finished is not None and self.stream and self.include_usage and chunks and ending_error(self.finished) is None:
                chunks.append(msgspec.structs.replace(chunks[-1], choices=[], usage=usage_of(self.finished)))
        return chunks

    def _check_finished(self) -> None:
        """Once every choice has ended: a failed one's end, or all of them added up."""
        ends = [o.finished for o in self.outputs]
        if any(end is None for end in ends):
            return
        failed = [end for end in ends if end is not None and ending_error(end) is not None]
        if failed:
            self.finished = failed[0]
            return
        usages = [end.usage for end in ends if end is not None]
        first = ends[0]
        assert first is not None
        self.finished = msgspec.structs.replace(
            first,
            usage=Usage(
                prompt_tokens=sum(u.prompt_tokens for u in usages),
                completion_tokens=sum(u.completion_tokens for u in usages),
                cached_tokens=sum(u.cached_tokens for u in usages),
            ),
        )

    def response(self) -> Any:
        assert self.finished is not None
        whole = self.outputs[0].response()
        whole.choices = [o.response().choices[0] for o in self.outputs]
        whole.usage = usage_of(self.finished)
        return whole


async def continuous_usage(runtime: Serving, generates: list[GenerateRequest], body: oa.ChatCompletionRequest | oa.CompletionRequest) -> list[int | None]:
    """Each choice's prompt tokens when a stream's chunks carry the usage so far (vLLM's
    `stream_options.continuous_usage_stats`); the prompt is rendered for it first."""
    if not (body.stream and body.stream_options is not None and body.stream_options.continuous_usage_stats):
        return [None] * len(generates)
    counts: dict[bytes, int] = {}
    out: list[int | None] = []
    for generate in generates:
        key = msgspec.json.encode(msgspec.structs.replace(generate, request_id=None, sampling=SamplingParams()))
        if key not in counts:
            counts[key] = len(await runtime.prompt_token_ids(generate))
        out.append(counts[key])
    return out
