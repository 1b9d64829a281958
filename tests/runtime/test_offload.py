"""`runtime.offload`: big tokenizer jobs in a niced worker process give what a thread gives,
errors come back whole, and a cancelled caller abandons its job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest
from mlx_lm.utils import load_tokenizer

from net.http import anthropic_types as at
from net.http import tokens
from net.http.anthropic import map_body
from net.http.errors import HttpError
from protocols.api import GenerateRequest
from protocols.config import LimitsConfig
from protocols.errors import InvalidRequestError
from runtime import offload
from runtime.admission import render_prompt
from tests.support.config import builtin_dir

pytestmark = pytest.mark.slow  # (a worker process starts: a few seconds)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = load_tokenizer(builtin_dir("tiny"))
    yield tokenizer
    offload.shutdown(tokenizer)


def niceness(_tokenizer) -> tuple[int, int]:
    return os.getpid(), os.nice(0)


def scheduling_policy(_tokenizer) -> int:
    return os.sched_getscheduler(0)


def fail_typed(_tokenizer, message: str) -> None:
    raise InvalidRequestError(message, field="messages[3]")


def sleep_then_pid(_tokenizer, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


async def both(tokenizer, fn, *args):
    """The job's answer in a thread and in the worker process."""
    in_thread = await offload.run(tokenizer, fn, *args, size=10, min_size=100)
    in_process = await offload.run(tokenizer, fn, *args, size=100, min_size=100)
    return in_thread, in_process


async def test_big_jobs_run_in_one_niced_worker_process_and_small_ones_here(tokenizer):
    here = os.getpid(), os.nice(0)
    assert await offload.run(tokenizer, niceness, size=10, min_size=100) == here
    assert await offload.run(tokenizer, niceness, size=10**9, min_size=0) == here  # 0: never a process
    pid, nice = await offload.run(tokenizer, niceness, size=100, min_size=100)
    assert pid != here[0] and nice >= min(here[1] + offload.NICE, 19)
    assert (await offload.run(tokenizer, niceness, size=100, min_size=100))[0] == pid  # the same worker
    if sys.platform == "linux":  # below every normal thread there
        assert await offload.run(tokenizer, scheduling_policy, size=100, min_size=100) == os.SCHED_IDLE
        assert await offload.run(tokenizer, scheduling_policy, size=10, min_size=100) == os.sched_getscheduler(0)


async def test_the_worker_renders_tokenizes_and_decodes_as_the_thread_does(tokenizer):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(31)]
    request = GenerateRequest(messages=messages)
    thread_ids, process_ids = await both(tokenizer, render_prompt, request, 1 << 20)
    assert thread_ids == process_ids and len(thread_ids) > 500
    body = tokens.TokenizeRequest(prompt="hello world, " * 400, return_token_strs=True)
    in_thread, in_process = await both(tokenizer, tokens.tokenize, body, 1 << 20, 2048, None)
    assert in_thread == in_process and in_thread.token_strs and len(in_thread.token_strs) == in_thread.count
    detok = tokens.DetokenizeRequest(tokens=thread_ids)
    assert (await both(tokenizer, tokens.detokenize, detok, len(tokenizer.get_vocab()))) == (
        tokens.detokenize(tokenizer, detok, len(tokenizer.get_vocab())),
    ) * 2
    # The JSON answers the routes send are encoded where the job ran, and say the same.
    answer = await offload.run(tokenizer, tokens.tokenize_json, body, 1 << 20, 2048, None, size=100, min_size=100)
    assert msgspec.json.decode(answer, type=tokens.TokenizeResponse) == in_thread
    answer = await offload.run(tokenizer, tokens.detokenize_json, detok, len(tokenizer.get_vocab()), size=100, min_size=100)
    assert msgspec.json.decode(answer)["prompt"] == tokenizer.decode(thread_ids)


async def test_an_anthropic_conversation_maps_in_the_worker_as_in_the_thread(tokenizer):
    blocks = [{"type": "text", "text": f"part {k}"} for k in range(3)]
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": blocks} for i in range(41)]}
    raw = msgspec.json.encode(body)
    in_thread, in_process = await both(tokenizer, map_body, raw, at.MessagesRequest, LimitsConfig())
    strip = lambda mapped: (mapped[0], mapped[1], msgspec.structs.replace(mapped[2], request_id=None))  # noqa: E731 (ids are new each time)
    assert strip(in_thread) == strip(in_process) and len(in_process[2].messages or []) == 41
    with pytest.raises(HttpError) as refused:
        await offload.run(tokenizer, map_body, raw, at.MessagesRequest, LimitsConfig(max_messages=40), size=100, min_size=100)
    assert refused.value.code == "invalid_request" and refused.value.param == "messages"


async def test_errors_come_back_typed_with_their_fields(tokenizer):
    with pytest.raises(InvalidRequestError) as raised:
        await offload.run(tokenizer, fail_typed, "no", size=100, min_size=100)
    assert str(raised.value) == "no" and raised.value.field == "messages[3]"
    bad = tokens.DetokenizeRequest(tokens=[1, 10**9])
    with pytest.raises(HttpError) as http:
        await offload.run(tokenizer, tokens.detokenize, bad, tokenizer.vocab_size, size=100, min_size=100)
    assert http.value.code == "invalid_request" and http.value.param == "tokens[1]"


async def test_a_cancelled_caller_does_not_wait_for_its_job(tokenizer):
    await offload.run(tokenizer, niceness, size=100, min_size=100)  # (the worker started)
    started = time.monotonic()
    with anyio.move_on_after(0.2):
        await offload.run(tokenizer, sleep_then_pid, 5.0, size=100, min_size=100)
    assert time.monotonic() - started < 4.0


async def test_a_tokenizer_that_does_not_pickle_keeps_its_jobs_in_threads():
    class Local:  # (a class defined in a function does not pickle)
        vocab_size = 3

    tokenizer = Local()
    assert await offload.run(tokenizer, niceness, size=100, min_size=100) == (os.getpid(), os.nice(0))


def test_a_worker_ends_when_the_server_process_is_killed(tmp_path):
    # A server process whose tokenizer worker started, then SIGKILLed: the worker must not outlive it.
    script = tmp_path / "server.py"
    script.write_text(
        "import anyio, os, sys\n"
        "from mlx_lm.utils import load_tokenizer\n"
        "from runtime import offload\n"
        "from tests.support.config import builtin_dir\n"
        "from tests.runtime.test_offload import niceness\n"
        "async def main():\n"
        "    tokenizer = load_tokenizer(builtin_dir('tiny'))\n"
        "    print((await offload.run(tokenizer, niceness, size=2, min_size=1))[0], flush=True)\n"
        "    await anyio.sleep(60)\n"
        "anyio.run(main)\n"
    )
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root, env=env)
    try:
        assert server.stdout is not None
        worker = int(server.stdout.readline())
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(worker):
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_a_job_the_worker_cannot_import_fails_alone(tokenizer, tmp_path, monkeypatch):
    await offload.run(tokenizer, niceness, size=100, min_size=100)  # (the worker started with the path as it was)
    (tmp_path / "offload_late_module.py").write_text("def job(_tokenizer):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from offload_late_module import job  # type: ignore[import-not-found]

    with pytest.raises(ModuleNotFoundError):
        await offload.run(tokenizer, job, size=100, min_size=100)
    assert (await offload.run(tokenizer, niceness, size=100, min_size=100))[0] != os.getpid()  # the worker lives on
