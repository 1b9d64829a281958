"""Claude Code and the Codex CLI against the HTTP server, offline (issue 47): each completes a
one-shot turn with its default system prompt and tools and prints the model's text, and a tool
round trip (the model's call, the CLI's result, the server's answer to it); a prompt over the
model's context is the API's own error, shown once, not retried.

The model is the tiny built-in one with a 64K-token context (the agents' first requests are
about 24K and 19K of its tokens). A random model does not call tools by itself, so the round
trips send the `x-mlxrt-tool-choice` header (`net.http.forced_tools`), as a user would through
`ANTHROPIC_CUSTOM_HEADERS` or a Codex provider's `http_headers`: the server forces the request
answering the user to call the named tool with the tool-call grammar, a real path through the
engine (the call's arguments are the model's own tokens under the grammar); the request that
carries the tool result is the model's free choice. The calls run nothing: Claude Code's `Read`
of a path the model wrote, Codex's `get_goal` (no arguments, reads the session's goal).
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import msgspec
import pytest

from net.http.forced_tools import TOOL_CHOICE_HEADER
from runtime.config import GenerationConfig
from tests.support.agents import Agents, claude_command, codex_command, installed_agents
from tests.support.config import make_config
from tests.support.http_serving import serving
from tests.support.recording_proxy import Recording, recording_proxy

pytestmark = [pytest.mark.agents, pytest.mark.server, pytest.mark.slow]

RUN_TIMEOUT_S = 240
# Long enough for the agents' default prompts in the tiny model's tokens; the model's own
# end-of-sequence ends its answers (Codex sends no max_output_tokens: an answer cut at the
# server's default would be an error to it).
LONG_CONTEXT = 65536


@pytest.fixture(scope="module")
def agents() -> Agents:
    return installed_agents()


def _config(max_context: int = LONG_CONTEXT):
    config = make_config("builtin:tiny")
    return msgspec.structs.replace(
        config,
        model=msgspec.structs.replace(config.model, max_context=max_context),
        generation=GenerationConfig(seed=0, default_max_tokens=max_context // 2),
    )


async def _run(command: tuple[list[str], dict[str, str]], cwd: Path) -> tuple[int, str, str]:
    argv, env = command
    with anyio.fail_after(RUN_TIMEOUT_S):
        done = await anyio.run_process(argv, env=env, cwd=cwd, check=False, stdin=None)
    return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def _posts(recording: Recording, path: str):
    return [(request, response) for request, response in recording.exchanges() if request.start_line.split()[1].split("?")[0] == path]


def _anthropic_text(events: list[dict]) -> str:
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")


def _completed(events: list[dict]) -> dict:
    return next(e["response"] for e in events if e["type"] == "response.completed")


async def test_claude_code_answers_a_turn_with_its_default_prompt_and_tools(agents: Agents, tmp_path: Path):
    async with serving(_config()) as served, recording_proxy(served.url) as proxy:
        command = claude_command(agents, tmp_path, proxy.url, ["-p", "Say hello", "--model", served.model, "--output-format", "json"])
        code, out, err = await _run(command, tmp_path)
    posts = _posts(proxy, "/v1/messages")
    assert code == 0, (out, err)
    assert len(posts) == 1 and posts[0][1] is not None and posts[0][1].start_line.endswith("200 OK")
    request, response = posts[0]
    assert len(request.json()["tools"]) >= 5 and request.json()["stream"] is True
    text = _anthropic_text(response.sse())
    result = json.loads(out)
    assert text.strip() and result["is_error"] is False and printable(result["result"]) == printable(text)


async def test_claude_code_sends_a_tool_result_back_and_the_server_answers_it(agents: Agents, tmp_path: Path):
    headers = {TOOL_CHOICE_HEADER: "function:Read"}
    async with serving(_config()) as served, recording_proxy(served.url) as proxy:
        args = ["-p", "Read the file notes.txt", "--model", served.model, "--max-turns", "3", "--output-format", "json"]
        code, out, err = await _run(claude_command(agents, tmp_path, proxy.url, args, headers), tmp_path)
    posts = _posts(proxy, "/v1/messages")
    assert len(posts) >= 2, (out, err)
    called, (second, answered) = posts[0][1], posts[1]
    assert called is not None and answered is not None and answered.start_line.endswith("200 OK")
    uses = [e["content_block"] for e in called.sse() if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    assert [use["name"] for use in uses] == ["Read"]
    results = [block for block in second.json()["messages"][-1]["content"] if isinstance(block, dict) and block.get("type") == "tool_result"]
    assert [result["tool_use_id"] for result in results] == [uses[0]["id"]]
    assert any(e["type"] == "message_stop" for e in answered.sse())
    assert code == 0, (out, err)


async def test_codex_answers_a_turn_with_its_default_prompt_and_tools(agents: Agents, tmp_path: Path):
    async with serving(_config()) as served, recording_proxy(served.url) as proxy:
        last = tmp_path / "last.txt"
        command = codex_command(agents, tmp_path, proxy.url, ["-m", served.model, "-o", str(last), "Say hello"])
        code, out, err = await _run(command, tmp_path)
    posts = _posts(proxy, "/v1/responses")
    assert code == 0, (out, err)
    assert len(posts) == 1 and posts[0][1] is not None
    request, response = posts[0]
    assert request.json()["store"] is False and {tool["type"] for tool in request.json()["tools"]} >= {"function", "web_search"}
    completed = _completed(response.sse())
    text = "".join(part["text"] for item in completed["output"] if item["type"] == "message" for part in item["content"])
    assert text.strip() and printable(last.read_text()) == printable(text)


async def test_codex_sends_a_function_call_output_back_and_the_server_answers_it(agents: Agents, tmp_path: Path):
    headers = {TOOL_CHOICE_HEADER: "function:get_goal"}
    async with serving(_config()) as served, recording_proxy(served.url) as proxy:
        command = codex_command(agents, tmp_path, proxy.url, ["-m", served.model, "What is my goal?"], headers)
        code, out, err = await _run(command, tmp_path)
    posts = _posts(proxy, "/v1/responses")
    assert len(posts) >= 2, (out, err)
    called, (second, answered) = posts[0][1], posts[1]
    assert called is not None and answered is not None
    calls = [item for item in _completed(called.sse())["output"] if item["type"] == "function_call"]
    assert [call["name"] for call in calls] == ["get_goal"]
    outputs = [item for item in second.json()["input"] if item.get("type") == "function_call_output"]
    assert [item["call_id"] for item in outputs] == [calls[0]["call_id"]]
    assert _completed(answered.sse())["status"] == "completed"
    assert code == 0, (out, err)


async def test_a_prompt_over_the_context_is_shown_by_both_agents_and_not_retried(agents: Agents, tmp_path: Path):
    async with serving(_config(max_context=2048)) as served, recording_proxy(served.url) as proxy:
        claude = await _run(claude_command(agents, tmp_path, proxy.url, ["-p", "Say hello", "--model", served.model]), tmp_path)
        codex = await _run(codex_command(agents, tmp_path, proxy.url, ["-m", served.model, "Say hello"]), tmp_path)
    answers = [response for _, response in proxy.exchanges() if response is not None]
    assert len(answers) == 2 and all(answer.start_line.split()[1] == "400" for answer in answers)
    assert answers[0].json()["error"]["message"].startswith("prompt is too long: ")
    assert answers[1].json()["error"]["code"] == "context_length_exceeded"
    assert claude[0] != 0 and "Prompt is too long" in claude[1] + claude[2]
    assert codex[0] != 0 and "context window" in codex[1] + codex[2]


def printable(text: str) -> str:
    """A random model's text as a terminal program passes it on: its printable characters (the
    CLIs drop control characters and may replace undecodable bytes)."""
    return "".join(c for c in text if c.isprintable() and c != "\ufffd").strip()
