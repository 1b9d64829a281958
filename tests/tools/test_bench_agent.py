"""`mlxrt bench-agent`: the scripted agent session, its client, its table and JSON, and (slow)
three turns on `builtin:tiny` prefilling only what each turn adds."""

from __future__ import annotations

import itertools
import json
import shutil

import anyio
import msgspec
import pytest

from tools.agent_session import MAX_RESULT_TOKENS, MIN_RESULT_TOKENS, TOOLS, USER_EVERY, agent_turns, turn_request
from tools.bench_agent import AgentBenchOptions, HttpStatusError, TurnResult, dump_agent, format_agent_table, post_events, run_agent_bench, summarize
from tools.cli import main

SMOLLM2_CONTEXT = 8192


def test_the_session_is_deterministic_and_each_turn_extends_the_one_before():
    turns = agent_turns(20, seed=3)
    assert turns == agent_turns(20, seed=3)
    assert turns != agent_turns(20, seed=4)
    assert len(turns) == 20 and [m["role"] for m in turns[0]] == ["system", "user"]
    for before, after in itertools.pairwise(turns):
        assert after[: len(before)] == before and len(after) == len(before) + 2
    last = turns[-1]
    calls = {c["id"]: c["function"] for m in last if m["role"] == "assistant" and m.get("tool_calls") for c in m["tool_calls"]}
    results = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == list(calls)
    assert {f["name"] for f in calls.values()} <= {t["function"]["name"] for t in TOOLS}
    assert all(isinstance(json.loads(f["arguments"]), dict) for f in calls.values())
    users = [i for i, m in enumerate(last) if m["role"] == "user"]
    assert len(users) == 1 + (20 - 1) // USER_EVERY


def test_turn_requests_stream_greedily_with_the_usage_chunk_and_the_tools_unless_told():
    body = turn_request(agent_turns(1)[0], "m", 16)
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    assert body["tools"] == TOOLS and body["max_tokens"] == 16
    assert "tools" not in turn_request(agent_turns(1)[0], "m", 16, tools=False)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from engine.builtin import PackagedModelMissingError, packaged_model_path
    from engine.model.gguf.format import GGUFFile
    from engine.model.gguf.tokenizer import load_tokenizer
    from runtime import env

    try:
        path = packaged_model_path("smollm2-135m-instruct")
    except PackagedModelMissingError as exc:
        pytest.skip(str(exc))
    with GGUFFile.open(path) as file:
        return load_tokenizer(file, env.home(), eos_token_ids=[], defaults=None)


def _num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_twenty_turns_fit_smollm2s_context_with_the_tools_and_tool_results_of_hundreds_of_tokens(smollm2_tokenizer):
    last = agent_turns(20)[-1]
    # SmolLM2's template renders neither tools nor tool calls: count both on top of the prompt.
    messages = [m | {"content": m["content"] or ""} for m in last]
    prompt = _num_tokens(smollm2_tokenizer, smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    extra = _num_tokens(smollm2_tokenizer, json.dumps(TOOLS)) + sum(_num_tokens(smollm2_tokenizer, json.dumps(m.get("tool_calls") or [])) for m in last)
    assert prompt > 4000 and prompt + extra + 16 < SMOLLM2_CONTEXT
    sizes = [_num_tokens(smollm2_tokenizer, m["content"]) for m in last if m["role"] == "tool"]
    # Sized by characters (about 3 a token): within a fifth of the nominal range.
    assert min(sizes) >= MIN_RESULT_TOKENS * 0.8 and max(sizes) <= MAX_RESULT_TOKENS * 1.2


def _results() -> dict:
    options = AgentBenchOptions(turns=3, repeats=2, servers=("mlxrt", "mlx-lm"))
    ours = [[TurnResult(0.5, 1000, 0), TurnResult(0.1, 1300, 1000), TurnResult(0.1, 1500, 1300)]] * 2
    theirs = [
        [TurnResult(0.6, 1000, 0), TurnResult(0.7, 1300, 0), TurnResult(0.2, 1500, 1300)],
        [TurnResult(0.8, 1000, 0), TurnResult(0.9, 1300, 10), TurnResult(0.4, 1500, 1300)],
    ]
    return summarize({"mlxrt": ours, "mlx-lm": theirs}, options, "builtin:x", tools=False)


def test_the_summary_takes_medians_and_names_turns_that_prefilled_more_than_their_new_tokens():
    results = _results()
    ours, theirs = results["servers"]["mlxrt"], results["servers"]["mlx-lm"]
    assert [t["new_tokens"] for t in ours["turns"]] == [1000, 300, 200]
    assert [t["prefilled"] for t in ours["turns"]] == [1000, 300, 200] and ours["reprefilled_turns"] == []
    assert [t["prefilled"] for t in theirs["turns"]] == [1000, 1295, 200] and theirs["reprefilled_turns"] == [2]
    assert theirs["turns"][1]["ttft_s"] == pytest.approx(0.8) and theirs["total_prefilled"] == 2495
    assert len(theirs["runs"]) == 2 and theirs["runs"][1][1] == {"ttft_s": 0.9, "prompt_tokens": 1300, "cached_tokens": 10, "prefilled": 1290}
    assert results["tools_sent"] is False


def test_the_table_has_a_row_per_turn_and_the_json_reads_back(tmp_path):
    results = _results()
    lines = format_agent_table(results).splitlines()
    assert lines[1].split()[:3] == ["turn", "context", "new"] and "mlxrt ms/prefill" in lines[1] and "mlx-lm ms/prefill" in lines[1]
    assert lines[3].split() == ["1", "1,000", "1,000", "500", "/", "1,000", "700", "/", "1,000"]
    assert lines[4].split() == ["2", "1,300", "300", "100", "/", "300", "800", "/", "1,295"]
    assert "mlxrt: every turn after the first prefilled only its new tokens" in lines
    assert "mlx-lm: turns prefilling more than their new tokens: [2]" in lines
    dump_agent(results, str(tmp_path / "agent.json"))
    assert json.loads((tmp_path / "agent.json").read_text()) == json.loads(json.dumps(results))


async def _http10_server(listener, answers: list[bytes]) -> None:
    """Answers each connection with the next of `answers`, then closes it (as an HTTP/1.0
    server like mlx_lm.server ends a stream)."""

    async def handle(stream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive()
            await stream.send(answers.pop(0))

    await listener.serve(handle)


async def test_the_client_reads_a_stream_ended_by_closing_and_types_an_error_status():
    events = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: {"usage":{"prompt_tokens":5}}\n\ndata: [DONE]\n\n'
    refusal = json.dumps({"error": {"message": "no tool-call format", "param": "tools"}}).encode()
    answers = [b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + events, b"HTTP/1.0 400 Bad Request\r\n\r\n" + refusal]
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        tg.start_soon(_http10_server, listener, answers)
        url = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        got = [data async for _, data in post_events(url, "/v1/chat/completions", {"stream": True})]
        assert got == [{"choices": [{"delta": {"content": "hi"}}]}, {"usage": {"prompt_tokens": 5}}]
        with pytest.raises(HttpStatusError) as refused:
            _ = [data async for _, data in post_events(url, "/v1/chat/completions", {"stream": True})]
        assert refused.value.status == 400 and refused.value.param == "tools"
        tg.cancel_scope.cancel()


def test_the_command_refuses_unknown_servers_with_a_usage_error(capsys):
    assert main(["bench-agent", "--servers", "mlxrt,vllm", "--config", "configs/tiny.toml"]) == 2
    assert "vllm" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.server
async def test_three_turns_on_tiny_prefill_only_their_new_tokens_and_a_restart_reads_the_disk():
    from tests.support.config import make_config

    config = make_config("builtin:tiny", prefill_chunk_size=512)
    # The scripted session outgrows tiny's 2,048 positions by turn 2; its RoPE does not care.
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, max_context=8192))
    results = await run_agent_bench(config, AgentBenchOptions(turns=3, repeats=1, servers=("mlxrt", "disk", "restart")))
    for name in ("mlxrt", "disk"):
        turns = results["servers"][name]["turns"]
        assert turns[0]["prefilled"] >= turns[0]["prompt_tokens"] - 16  # (the warm-up shares its first few tokens)
        assert [t["prefilled"] for t in turns[1:]] == [t["new_tokens"] for t in turns[1:]] and all(t["new_tokens"] > 100 for t in turns[1:])
    restart = results["servers"]["restart"]["turns"]
    assert restart[0]["prefilled"] <= 4 and all(t["prefilled"] <= t["new_tokens"] for t in restart[1:])
    assert results["tools_sent"] is True


@pytest.mark.slow
def test_a_gguf_file_exported_for_mlx_lm_gives_the_logits_of_the_model_mlxrt_serves(tmp_path, smollm2_tokenizer):
    import mlx.core as mx
    from mlx_lm.utils import load

    from engine.builtin import packaged_model_path
    from tools.bench import load_mlx_lm_model
    from tools.mlx_lm_server import mlx_lm_model_dir

    directory = mlx_lm_model_dir("builtin:smollm2-135m-instruct", root=tmp_path)
    try:
        written = (directory / "model.safetensors").stat().st_mtime_ns
        assert mlx_lm_model_dir("builtin:smollm2-135m-instruct", root=tmp_path) == directory
        assert (directory / "model.safetensors").stat().st_mtime_ns == written  # (exported once)
        model, tokenizer = load(str(directory))[:2]
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        assert prompt == smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        ours = load_mlx_lm_model(str(packaged_model_path("smollm2-135m-instruct")))
        assert mx.array_equal(model(mx.array([prompt])), ours(mx.array([prompt]))).item()
        assert tokenizer.eos_token_id in json.loads((directory / "config.json").read_text())["eos_token_id"]
    finally:
        shutil.rmtree(directory)  # 540 MB of float32 weights


@pytest.mark.slow
@pytest.mark.server
async def test_three_turns_on_a_hybrid_model_prefill_only_their_new_tokens():
    from tests.support.config import make_config

    config = make_config("builtin:tiny-qwen3next", prefill_chunk_size=512)
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, max_context=8192))
    turns = (await run_agent_bench(config, AgentBenchOptions(turns=3, repeats=1, servers=("mlxrt",))))["servers"]["mlxrt"]["turns"]
    assert [t["prefilled"] for t in turns[1:]] == [t["new_tokens"] for t in turns[1:]]


@pytest.mark.server
def test_a_session_over_the_models_context_fails_with_the_servers_message(capsys):
    # builtin:tiny's 2,048 positions hold less than the session's first turn.
    assert main(["bench-agent", "--config", "configs/tiny.toml", "--servers", "mlxrt", "--turns", "1", "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert "mlxrt bench-agent:" in err and "HTTP 400" in err and "context" in err
