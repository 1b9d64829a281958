"""`mlxrt bench --peer llama.cpp` without either server: the roofline's arithmetic, the workload
(the same bodies to both servers, one server busy at a time, against two stand-in SSE servers),
and the table and JSON."""

from __future__ import annotations

import argparse
import json

import anyio
import h11
import msgspec
import pytest

from runtime.config import RuntimeConfig
from tools import bench_peer
from tools.cli_bench import add_bench_parsers
from tools.peers import roofline
from tools.peers.roofline import Attention, Tensor

# A tied-embedding Q4_1 model in miniature: 1,000 x 64 embedding (Q8_0), one 64x64 Q4_1 matrix, one norm.
TIED = [
    Tensor("token_embd.weight", 64_000, 68_000, "Q8_0"),
    Tensor("blk.0.attn_q.weight", 4096, 1280, "Q4_1"),
    Tensor("blk.0.attn_norm.weight", 64, 256, "F32"),
]
UNTIED = [*TIED, Tensor("output.weight", 64_000, 20_000, "Q4_1")]


def test_weights_are_counted_as_each_engine_reads_them():
    # llama.cpp reads stored blocks; a tied embedding is the output matrix, read whole.
    assert roofline.llamacpp_weight_bytes(TIED) == 68_000 + 1280 + 256
    # mlxrt dequantized: float32 for every element; kept quantized: MLX's affine format, a float32
    # scale and bias per 32 weights (Q4_1 as 4 bits: 0.75 bytes a weight), Q8_0's biases unread (its
    # biases are -128 times its scales: 1.125).
    assert roofline.mlxrt_weight_bytes(TIED, dequantized=True) == 4 * (64_000 + 4096 + 64)
    assert roofline.mlxrt_weight_bytes(TIED, dequantized=False) == 64_000 * 1.125 + 4096 * 0.75 + 256
    # Untied: the embedding is one row per token (left out), the output matrix is read whole.
    assert roofline.llamacpp_weight_bytes(UNTIED) == 1280 + 256 + 20_000
    assert roofline.mlxrt_weight_bytes(UNTIED, dequantized=True) == 4 * (4096 + 64 + 64_000)


def test_mlxrt_dequantizes_as_its_cpu_policy_says():
    float_bytes = 4 * (64_000 + 4096)
    assert roofline.mlxrt_dequantizes(TIED, "always", memory_bytes=1)
    assert not roofline.mlxrt_dequantizes(TIED, "never", memory_bytes=1 << 40)
    assert roofline.mlxrt_dequantizes(TIED, "auto", memory_bytes=2 * float_bytes)
    assert not roofline.mlxrt_dequantizes(TIED, "auto", memory_bytes=2 * float_bytes - 1)
    assert not roofline.mlxrt_dequantizes([TIED[2]], "always", memory_bytes=1)  # nothing quantized
    # "auto" keeps them for mlxrt's quantized kernels where those serve, whatever the memory.
    assert not roofline.mlxrt_dequantizes(TIED, "auto", memory_bytes=1 << 40, kernels=True)
    assert roofline.mlxrt_dequantizes(TIED, "always", memory_bytes=1 << 40, kernels=True)


def test_roofline_arithmetic():
    attention = Attention(layers=30, kv_heads=3, head_dim=64)
    assert attention.kv_bytes_per_position(2) == 2 * 30 * 3 * 64 * 2
    # KV is read at the request's mean length over its decode: prompt + half the new tokens.
    per_token = roofline.bytes_per_token(1_000_000, 100, prompt_tokens=128, new_tokens=64)
    assert per_token == 1_000_000 + 100 * 160
    assert roofline.roofline_tok_s(10e9, per_token) == pytest.approx(10e9 / 1_016_000)
    assert roofline.fraction_of_roofline(4921.26, 10e9, per_token) == pytest.approx(0.5, rel=1e-4)
    assert roofline.roofline_tok_s(10e9, 0) == 0.0


def test_the_smollm2_gguf_is_read_as_a_tied_q4_1_model():
    tensors, attention = roofline.gguf_tensors(str(bench_peer.default_gguf()))
    assert attention == Attention(layers=30, kv_heads=3, head_dim=64)
    assert not any(t.name == "output.weight" for t in tensors)
    stored, as_float = roofline.llamacpp_weight_bytes(tensors), roofline.mlxrt_weight_bytes(tensors, dequantized=True)
    assert 60e6 < stored < 120e6 and 500e6 < as_float < 600e6  # ~135M parameters: Q4_1/Q8_0 bytes vs float32


def test_mlxrt_kv_bytes_follow_kv_bits():
    config = RuntimeConfig.load("configs/bench.toml")
    assert bench_peer.mlxrt_kv_element_bytes(config) == 4.0
    quantized = msgspec.structs.replace(config, kv=msgspec.structs.replace(config.kv, bits=8, group_size=64))
    assert bench_peer.mlxrt_kv_element_bytes(quantized) == 1 + 8 / 64


def test_bench_read_bandwidth_is_a_positive_rate():
    assert roofline.measure_read_bandwidth(1 << 22, repeats=2, threads=2) > 1e6


def test_workload_alternates_which_server_goes_first():
    options = bench_peer.PeerBenchOptions(prompt_tokens=(8, 16), concurrency=(1, 4), repeats=2, new_tokens=4)
    cells = bench_peer.workload(options, vocab_size=1000)
    assert [(c.prompt_tokens, c.concurrency, len(c.prompts)) for c in cells[:4]] == [(8, 1, 1), (8, 4, 4), (16, 1, 1), (16, 4, 4)]
    assert [c.order[0] for c in cells] == ["mlxrt", "llama.cpp", "mlxrt", "llama.cpp", "llama.cpp", "mlxrt", "llama.cpp", "mlxrt"]
    prompts = [tuple(p) for c in cells for p in c.prompts]
    assert len(set(prompts)) == len(prompts)  # distinct: no prefix-cache hits
    assert all(bench_peer._FIRST_ID <= t < 1000 for p in prompts for t in p)
    assert bench_peer.workload(options, 1000)[3].prompts == cells[3].prompts  # deterministic


def test_the_request_body_is_greedy_streaming_ignore_eos():
    body = json.loads(bench_peer.completion_body("m", [5, 6], 32))
    assert body == {"model": "m", "prompt": [5, 6], "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}


class _Recorder:
    """Requests seen by the stand-in servers, and how many were in flight at once across both."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = {"mlxrt": [], "llama.cpp": []}
        self.in_flight: dict[str, int] = {"mlxrt": 0, "llama.cpp": 0}
        self.overlap = False


def _sse(tokens: int) -> bytes:
    events: list[dict[str, object]] = [{"choices": [{"text": f" t{i}", "index": 0}]} for i in range(tokens)]
    events.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": {"completion_tokens": tokens}})
    return b"".join(b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def _serve_one(name: str, recorder: _Recorder, stream) -> None:
    conn = h11.Connection(h11.SERVER)
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive())
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            break
    recorder.bodies[name].append(body)
    recorder.in_flight[name] += 1
    other = "llama.cpp" if name == "mlxrt" else "mlxrt"
    recorder.overlap |= recorder.in_flight[other] > 0
    await anyio.sleep(0.01)
    payload = _sse(json.loads(body)["max_tokens"])
    data = conn.send(h11.Response(status_code=200, headers=[("Content-Type", "text/event-stream"), ("Content-Length", str(len(payload)))]))
    await stream.send(data + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
    recorder.in_flight[name] -= 1
    await stream.aclose()


def test_both_servers_get_the_same_bodies_one_server_at_a_time():
    options = bench_peer.PeerBenchOptions(prompt_tokens=(8, 16), concurrency=(1, 3), repeats=2, new_tokens=5)
    recorder = _Recorder()

    async def main() -> dict:
        listeners = {name: await anyio.create_tcp_listener(local_host="127.0.0.1") for name in bench_peer.SERVERS}
        urls = {name: f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}" for name, listener in listeners.items()}
        try:
            async with anyio.create_task_group() as tg:
                for name, listener in listeners.items():
                    tg.start_soon(listener.serve, lambda stream, name=name: _serve_one(name, recorder, stream))
                runs = await bench_peer.measure(urls, bench_peer.workload(options, 500), "m", options.new_tokens, lambda _: None)
                tg.cancel_scope.cancel()
        finally:
            for listener in listeners.values():
                await listener.aclose()
        return runs

    runs = anyio.run(main)
    assert len(recorder.bodies["mlxrt"]) == 2 * (1 + 3) * 2
    assert sorted(recorder.bodies["mlxrt"]) == sorted(recorder.bodies["llama.cpp"])
    assert not recorder.overlap
    run = runs[(16, 3, "llama.cpp")]
    assert len(run) == 2 and all(len(r["streams"]) == 3 for r in run)
    stream = run[0]["streams"][0]
    assert stream.completion_tokens == 5 and len(stream.token_times) == 5 and stream.ttft_s == stream.token_times[0]


def _run(wall: float, ttfts: list[float], per_stream: float, new_tokens: int) -> dict:
    span = (new_tokens - 1) / per_stream
    return {"wall_s": wall, "streams": [bench_peer.StreamTiming(t, [t, t + span]) for t in ttfts]}


def _results() -> dict:
    options = bench_peer.PeerBenchOptions(prompt_tokens=(128,), concurrency=(1, 4), repeats=1, new_tokens=11)
    runs = {
        (128, 1, "mlxrt"): [_run(1.0, [0.02], 20.0, 11)],
        (128, 1, "llama.cpp"): [_run(0.5, [0.01], 40.0, 11)],
        (128, 4, "mlxrt"): [_run(1.0, [0.1, 0.2, 0.3, 0.4], 10.0, 11)],
        (128, 4, "llama.cpp"): [_run(2.0, [0.1, 0.1, 0.1, 0.1], 5.0, 11)],
    }
    machine = {"cores": 2, "memory_bytes": 1 << 34, "read_bandwidth_bytes_s": 10e9}
    models = {
        "mlxrt": {"weight_bytes": 500e6, "kv_bytes_per_position": 1000.0, "weights": "float32 (dequantized at load)"},
        "llama.cpp": {"weight_bytes": 100e6, "kv_bytes_per_position": 500.0, "weights": "as stored"},
    }
    return bench_peer.assemble(options, "/x/SmolLM2.gguf", machine, models, runs)


def test_cells_ratios_and_roofline_in_the_results():
    results = _results()
    c1, c4 = results["cells"]
    assert c1["mlxrt"]["decode_tok_s"] == pytest.approx(11.0) and c1["llama.cpp"]["decode_tok_s"] == pytest.approx(22.0)
    assert c1["ratios"]["decode_tok_s"] == pytest.approx(0.5) and c1["ratios"]["per_stream_tok_s"] == pytest.approx(0.5)
    assert c1["ratios"]["ttft_p50_ms"] == pytest.approx(2.0)
    assert c4["ratios"]["decode_tok_s"] == pytest.approx(2.0)
    assert c4["mlxrt"]["ttft_p50_ms"] == pytest.approx(300.0) and c4["mlxrt"]["ttft_p99_ms"] == pytest.approx(400.0)
    rows = {r["server"]: r for r in results["roofline"]}
    assert len(results["roofline"]) == 2  # c1 only
    assert rows["mlxrt"]["bytes_per_token"] == 500e6 + 1000 * (128 + 5.5)
    assert rows["mlxrt"]["fraction"] == pytest.approx(20.0 / (10e9 / rows["mlxrt"]["bytes_per_token"]))
    assert rows["llama.cpp"]["measured_tok_s"] == pytest.approx(40.0)
    assert json.loads(json.dumps(results))["cells"] == results["cells"]  # JSON as written


def test_the_table_shows_each_cell_and_each_c1_roofline_fraction():
    table = bench_peer.format_peer_table(_results())
    lines = table.splitlines()
    assert "SmolLM2.gguf" in lines[0]
    row = next(line for line in lines if line.split()[:2] == ["128", "c4"])
    assert row.split()[3:6] == ["44.0", "22.0", "2.00"]
    assert "10.0 GB/s" in table
    mlxrt_roof = next(line for line in lines if line.strip().startswith("mlxrt") and "-token prompt" in line)
    assert "20.0 tok/s" in mlxrt_roof and "float32" in mlxrt_roof and "%" in mlxrt_roof


def test_bench_peer_is_a_mode_of_mlxrt_bench_and_refuses_bad_levels_before_building(capsys, monkeypatch):
    from tools.cli import main
    from tools.cli_bench import BENCH_MODES, bench_runner
    from tools.peers import llamacpp

    parser = argparse.ArgumentParser(prog="mlxrt")
    add_bench_parsers(parser.add_subparsers(required=True))
    args = parser.parse_args(["bench", "--peer", "llama.cpp", "--model", "x.gguf"])
    assert args.peer == "llama.cpp" and args.peer_concurrency == "1,4,16" and bench_runner(args) is dict(BENCH_MODES)["peer"]
    assert parser.parse_args(["bench", "--peer"]).peer == "llama.cpp"
    monkeypatch.setattr(llamacpp, "ensure_llama_server", lambda *a, **k: pytest.fail("built before the arguments were checked"))
    assert main(["bench", "--config", "configs/tiny.toml", "--peer", "--peer-concurrency", "1,x"]) == 2
    assert "--peer-concurrency takes positive integers" in capsys.readouterr().err
