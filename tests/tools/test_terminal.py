"""What the command line prints and sends, without a model: requests from flags, event printing,
the self-command line, the chat's conversation bookkeeping."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess

from protocols.api import Finished, PrefillProgress, TokenDelta, Usage
from tools.chat import Conversation, TurnStats
from tools.terminal import print_events, self_command, user_request


def _args(**overrides) -> argparse.Namespace:
    values = dict(
        prompt="What is 2+2?",
        prompt_ids=None,
        raw=False,
        max_tokens=8,
        temperature=0.0,
        seed=None,
        request_id=None,
        checkpoint_every=None,
        speculative=None,
        adapter=None,
        request_model=None,
    )
    return argparse.Namespace(**(values | overrides))


def test_a_prompt_is_a_chat_message_unless_raw_or_the_model_has_no_template():
    chat = user_request(_args(), chat=True)
    assert chat.messages == [{"role": "user", "content": "What is 2+2?"}] and chat.prompt is None
    assert user_request(_args(raw=True), chat=True).prompt == "What is 2+2?"
    assert user_request(_args(), chat=False).prompt == "What is 2+2?"
    ids = user_request(_args(prompt=None, prompt_ids="5,6,7"), chat=True)
    assert ids.prompt_ids == [5, 6, 7] and ids.messages is None


async def _events(*events):
    for event in events:
        yield event


async def test_events_print_as_text_or_json_lines_and_progress_stays_off_a_pipe():
    finished = Finished(request_id="r", finish_reason="stop", usage=Usage(prompt_tokens=3000, completion_tokens=2))
    events = [PrefillProgress(request_id="r", processed_tokens=1024, total_tokens=3000), TokenDelta(request_id="r", token_ids=[1], text="Hi"), finished]
    out, err = io.StringIO(), io.StringIO()
    assert await print_events(_events(*events), False, out=out, err=err) == finished
    assert out.getvalue() == "Hi" and err.getvalue() == ""  # stderr is not a terminal: no bar
    out = io.StringIO()
    await print_events(_events(*events), True, out=out, err=err)
    assert [json.loads(line)["type"] for line in out.getvalue().splitlines()] == ["PrefillProgress", "TokenDelta", "Finished"]


def test_the_self_command_runs_as_printed_from_anywhere(tmp_path):
    command = self_command()
    result = subprocess.run(f"{command} config check /dev/null", shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "model" in result.stderr  # mlxrt ran, and refused an empty config
    assert shlex.split(command)


def test_a_conversation_renders_its_system_prompt_and_forgets_on_reset():
    conversation = Conversation(system="Be brief.")
    conversation.messages += [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert [m["role"] for m in conversation.rendered()] == ["system", "user", "assistant"]
    conversation.reset()
    assert conversation.rendered() == [{"role": "system", "content": "Be brief."}]
    line = TurnStats(prompt_tokens=40, cached_tokens=36, completion_tokens=8, ttft_s=0.08, decode_tokens_per_s=12.5, finish_reason="length").line()
    assert line == "[40 prompt tokens (36 cached), 8 generated, first token 80 ms, 12.5 tok/s; length]"
