"""A socket client to be killed mid-stream: `python -m tests.support.doomed_client <socket>` starts a
long greedy request, prints "streaming" once its first tokens arrive, and reads on (a test SIGKILLs
it there); `first_line` reads what such a child prints, within a time limit."""

from __future__ import annotations

import select
import subprocess
import sys
import time

import anyio

from net.client import Client
from protocols.api import GenerateRequest, TokenDelta


async def main(path: str) -> None:
    async with Client.connect(path) as client:
        request = GenerateRequest(prompt_ids=[5, 6, 7, 8], max_tokens=5000, ignore_eos=True, request_id="doomed")
        announced = False
        async for event in client.generate(request):
            if isinstance(event, TokenDelta) and not announced:
                announced = True
                print("streaming", flush=True)
    print("finished before it was killed", flush=True)


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's first line of output; an AssertionError (with its stderr) if none comes in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.05)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError(f"the child printed nothing (exit code {proc.poll()}): {proc.stderr.read() if proc.poll() is not None else ''}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
