"""The default model from the command line, as a new user meets it: `mlxrt serve` prints lines
that work exactly as printed (from another directory) and answer; `mlxrt chat` holds a
conversation in-process, over the socket and over HTTP, reusing the conversation's KV;
`mlxrt generate` renders the chat template unless `--raw`, and prints only the answer."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.config import REPO
from tests.support.serve import ServerProcess

CONFIG = str(REPO / "configs" / "default.toml")
QUESTION = "What is the capital of France?"


def _run(command: list[str] | str, *, stdin: str = "", cwd=REPO, timeout: float = 240) -> subprocess.CompletedProcess:
    shell = isinstance(command, str)
    argv = command if shell else [sys.executable, "-m", "tools.cli", *command]
    return subprocess.run(argv, shell=shell, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    process = ServerProcess(
        REPO / "configs" / "default.toml",
        directory / "run" / "mlxrt.sock",
        directory,
        command=["serve", "--config", CONFIG, "--http", "127.0.0.1:0"],
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.mark.server
def test_the_printed_client_line_answers_as_printed(server, tmp_path):
    line = server.wait_for_output("mlxrt: try  ")
    command = line.split("mlxrt: try  ", 1)[1].strip()
    assert QUESTION in command
    result = _run(command, cwd=tmp_path)  # a shell, elsewhere: exactly as a person pastes it
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and result.stderr == ""


def _stats(stderr: str) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn from `--verbose` lines."""
    return [(int(a), int(b)) for a, b in re.findall(r"\[(\d+) prompt tokens \((\d+) cached\)", stderr)]


@pytest.mark.server
def test_chat_over_the_socket_remembers_the_conversation_and_reuses_its_kv(server):
    command = server.wait_for_output("mlxrt: chat ").split("mlxrt: chat ", 1)[1].strip()
    turns = f"{QUESTION}\nWhat is its population, roughly?\n/reset\n/nonsense\nWhat is the capital of Germany?\n"
    result = _run(f"{command} --temperature 0 --verbose", stdin=turns)
    assert result.returncode == 0, result.stderr
    answers = [a for a in result.stdout.split(">>> ") if a.strip()]
    assert len(answers) == 3 and "Paris" in answers[0] and "Berlin" in answers[2]
    (first, _), (second, second_cached), (third, third_cached) = _stats(result.stderr)
    assert second > first and second_cached >= first, "the second turn starts from the first turn's KV"
    assert third < second and third_cached < second, "after /reset the earlier turns are gone"
    assert "forgotten" in result.stderr and "unknown command /nonsense" in result.stderr


@pytest.mark.server
def test_chat_over_http(server):
    url = re.search(r"OpenAI-compatible HTTP on (\S+)/v1", server.wait_for_output("OpenAI-compatible HTTP")).group(1)
    result = _run(["chat", "--http", url, "--temperature", "0"], stdin=QUESTION + "\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_in_process_answers():
    result = _run(["chat", "--config", CONFIG, "--temperature", "0", "--system", "Answer in one short sentence."], stdin=QUESTION + "\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and "{" not in result.stderr


@pytest.mark.slow
def test_generate_renders_the_chat_template_and_prints_only_the_answer():
    chat = _run(["generate", "--config", CONFIG, "--prompt", QUESTION])
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip().startswith("The capital of France is Paris") and chat.stderr == ""


@pytest.mark.server
def test_a_refused_turn_is_reported_and_the_chat_goes_on(server):
    url = re.search(r"OpenAI-compatible HTTP on (\S+)/v1", server.wait_for_output("OpenAI-compatible HTTP")).group(1)
    result = _run(["chat", "--http", url, "--temperature", "-1"], stdin=f"{QUESTION}\n{QUESTION}\n")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("HttpError: HTTP 400") == 2 and "temperature" in result.stderr
