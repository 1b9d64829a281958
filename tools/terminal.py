"""What the command line shows a person: the answer on stdout as it streams; on stderr, only
when it is a terminal, a progress bar for a long prefill; nothing of the runtime's logs but
warnings (unless asked)."""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from protocols.api import DenoiseProgress, Finished, GenerateRequest, PrefillProgress, SamplingParams, TokenDelta
from runtime.config import LoggingConfig, RuntimeConfig
from runtime.progress import Progress

# Prompts shorter than this prefill in a blink: no bar for them.
LONG_PREFILL_TOKENS = 1024


def quiet(config: RuntimeConfig, verbose: bool = False) -> RuntimeConfig:
    """`config` for a one-shot command: the runtime logs warnings only (unless `verbose`), so a
    person sees the answer, not the server's info events."""
    if verbose:
        return config
    return msgspec.structs.replace(config, logging=LoggingConfig(level="warning", format=config.logging.format))


def user_request(args, *, chat: bool) -> GenerateRequest:
    """The request of `--prompt` (as the one user message of a chat when `chat`) or `--prompt-ids`."""
    ids = [int(x) for x in args.prompt_ids.split(",")] if args.prompt_ids else None
    as_chat = chat and ids is None and not getattr(args, "raw", False)
    return GenerateRequest(
        prompt=None if as_chat else args.prompt,
        prompt_ids=ids,
        messages=[{"role": "user", "content": args.prompt}] if as_chat else None,
        max_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=args.temperature, seed=args.seed),
        report_progress=True,
        request_id=args.request_id,
        checkpoint_every=args.checkpoint_every,
        speculative=None if args.speculative is None else args.speculative == "on",
        adapter=args.adapter,
        model=args.request_model,
    )


async def print_events(events: AsyncIterator, as_json: bool, *, out=None, err=None) -> Finished | None:
    """Print a request's stream: each event as a JSON line, or its text as it arrives (with a
    prefill bar on a terminal for a long prompt, and a diffusion model's canvas being denoised).
    Returns the `Finished` event."""
    out, err = out or sys.stdout, err or sys.stderr
    finished: Finished | None = None
    prefill: Progress | None = None
    async for event in events:
        if as_json:
            out.write(msgspec.json.encode(event).decode() + "\n")
            out.flush()
        elif isinstance(event, PrefillProgress):
            if prefill is None and event.total_tokens >= LONG_PREFILL_TOKENS and err.isatty():
                prefill = Progress("prefill", stream=err)
            if prefill is not None:
                prefill.fraction(event.processed_tokens, event.total_tokens, "prompt tokens")
        elif isinstance(event, DenoiseProgress):
            if prefill is None and err.isatty():
                prefill = Progress("denoise", stream=err)
            if prefill is not None:
                prefill.fraction(event.revealed, event.positions, f"positions of canvas {event.canvas} final (step {event.step})")
        elif isinstance(event, TokenDelta):
            if prefill is not None:
                prefill.clear()
                prefill = None
            out.write(event.text)
            out.flush()
        if isinstance(event, Finished):
            finished = event
    if prefill is not None:
        prefill.clear()
    return finished


def self_command() -> str:
    """How to run this `mlxrt` from any directory, exactly as a person would paste it: `mlxrt`
    when that is on PATH and is this one, else the path of this environment's script."""
    script = Path(sys.executable).with_name("mlxrt")
    found = shutil.which("mlxrt")
    if found and script.exists() and Path(found).resolve() == script.resolve():
        return "mlxrt"
    if script.exists():
        return shlex.quote(str(script.absolute()))
    return f"{shlex.quote(sys.executable)} -m tools.cli"
