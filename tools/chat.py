"""`mlxrt chat`: a conversation with the model on a terminal (as `mlx_lm.chat`, `ollama run`).

Each turn sends the whole conversation, rendered by the model's chat template, and streams the
answer; the runtime's prefix cache holds the conversation so far, so a turn prefills only what
is new (`--verbose` shows the cached tokens). In-process (loading the model here), or against a
running server's socket or its OpenAI-compatible HTTP API. `/reset` forgets the conversation,
`/exit` (or Ctrl-D) leaves; Ctrl-C stops an answer, or leaves at the prompt.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.lowlevel

from net.http.client import HttpError
from protocols.api import Finished, GenerateRequest, SamplingParams, TokenDelta
from protocols.errors import MlxrtError

HELP = "/reset forgets the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer"


@dataclass
class ChatOptions:
    system: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.7
    seed: int | None = None
    verbose: bool = False


@dataclass
class TurnStats:
    """What a turn cost, as the server reported it."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    finish_reason: str = ""

    def line(self) -> str:
        parts = [f"{self.prompt_tokens} prompt tokens ({self.cached_tokens} cached)", f"{self.completion_tokens} generated"]
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s * 1000:.0f} ms")
        if self.decode_tokens_per_s:
            parts.append(f"{self.decode_tokens_per_s:.1f} tok/s")
        return "[" + ", ".join(parts) + (f"; {self.finish_reason}" if self.finish_reason not in ("stop", "") else "") + "]"


@dataclass
class Conversation:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()

    def rendered(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages


# A backend streams one answer: text pieces, then the turn's stats.
Answer = Callable[[list[dict[str, str]], ChatOptions], AsyncIterator["str | TurnStats"]]


def event_backend(generate: Callable[[GenerateRequest], AsyncIterator]) -> Answer:
    """An answer from `Runtime.generate` or `Client.generate` (the same events)."""

    async def answer(messages: list[dict[str, str]], options: ChatOptions) -> AsyncIterator[str | TurnStats]:
        request = GenerateRequest(messages=messages, max_tokens=options.max_tokens, sampling=SamplingParams(temperature=options.temperature, seed=options.seed))
        async for event in generate(request):
            if isinstance(event, TokenDelta):
                yield event.text
            elif isinstance(event, Finished):
                if event.finish_reason == "error":
                    raise RuntimeError(event.error or "the request failed")
                u, t = event.usage, event.timings
                yield TurnStats(u.prompt_tokens, u.cached_tokens, u.completion_tokens, t.ttft_s, t.decode_tokens_per_s, event.finish_reason)

    return answer


def http_backend(connection, model: str) -> Answer:
    """An answer from `/v1/chat/completions` (streamed, with usage)."""

    async def answer(messages: list[dict[str, str]], options: ChatOptions) -> AsyncIterator[str | TurnStats]:
        payload: dict = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}, "temperature": options.temperature}
        if options.max_tokens:
            payload["max_tokens"] = options.max_tokens
        if options.seed is not None:
            payload["seed"] = options.seed
        stats = TurnStats()
        async for chunk in connection.events("/v1/chat/completions", payload):
            for choice in chunk.get("choices") or ():
                if text := (choice.get("delta") or {}).get("content"):
                    yield text
                stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
            if usage := chunk.get("usage"):
                stats.prompt_tokens, stats.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                stats.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        yield stats

    return answer


async def read_line(prompt: str) -> str | None:
    """A line from the terminal (None at end of input), read on a daemon thread so that a
    read still blocked when the chat ends never holds the process."""
    token = anyio.lowlevel.current_token()
    ready = anyio.Event()
    result: list = []

    def read() -> None:
        try:
            result.append(input(prompt))
        except EOFError:
            result.append(None)
        except BaseException as exc:  # reported on the loop's side
            result.append(exc)
        try:
            anyio.from_thread.run_sync(ready.set, token=token)
        except RuntimeError:  # the loop is gone: nobody waits
            pass

    threading.Thread(target=read, name="mlxrt-chat-input", daemon=True).start()
    await ready.wait()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


class _Interrupts:
    """Ctrl-C stops the answer being streamed, or ends the chat at the prompt."""

    def __init__(self, chat_scope: anyio.CancelScope):
        self.chat_scope = chat_scope
        self.answer_scope: anyio.CancelScope | None = None

    async def watch(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if self.answer_scope is not None:
                    self.answer_scope.cancel()
                else:
                    self.chat_scope.cancel()


async def chat(answer: Answer, options: ChatOptions, *, title: str, out=None, err=None) -> None:
    """The conversation loop, until /exit, end of input or Ctrl-C at the prompt."""
    out, err = out or sys.stdout, err or sys.stderr
    conversation = Conversation(options.system)
    err.write(f"mlxrt chat with {title}. {HELP}.\n")
    async with anyio.create_task_group() as tg:
        interrupts = _Interrupts(tg.cancel_scope)
        if threading.current_thread() is threading.main_thread():
            tg.start_soon(interrupts.watch)
        while True:
            line = await read_line(">>> ")
            if line is None or line.strip() in ("/exit", "/quit", "/bye"):
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                conversation.reset()
                err.write("(the conversation is forgotten)\n")
                continue
            if text.startswith("/"):
                err.write(f"unknown command {text.split()[0]}; {HELP}\n")
                continue
            conversation.messages.append({"role": "user", "content": line})
            try:
                reply = await _stream_answer(answer, conversation, options, interrupts, out, err)
            except (MlxrtError, HttpError, RuntimeError) as exc:  # this turn failed; the chat goes on
                conversation.messages.pop()
                err.write(f"\nmlxrt: {type(exc).__name__}: {exc}\n")
                continue
            conversation.messages.append({"role": "assistant", "content": reply})
        tg.cancel_scope.cancel()


async def _stream_answer(answer: Answer, conversation: Conversation, options: ChatOptions, interrupts: _Interrupts, out, err) -> str:
    reply, stats = "", None
    with anyio.CancelScope() as scope:
        interrupts.answer_scope = scope
        try:
            async for piece in answer(conversation.rendered(), options):
                if isinstance(piece, TurnStats):
                    stats = piece
                else:
                    reply += piece
                    out.write(piece)
                    out.flush()
        finally:
            interrupts.answer_scope = None
    out.write("\n")
    if scope.cancelled_caught:
        err.write("[stopped]\n")
    elif options.verbose and stats is not None:
        err.write(stats.line() + "\n")
    out.flush()
    return reply
