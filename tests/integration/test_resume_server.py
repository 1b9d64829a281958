"""A server killed with SIGKILL mid-generation; a restarted one resumes exactly.

On the ~125M built-in model a 64-token generation lasts long enough (~3 s on 2 cores) to be
killed in the middle; the tiny sliding-window and hybrid recurrent models are fast, so they
generate 600 tokens (far past their 16-token windows) and are killed as early.
"""

from __future__ import annotations

import random

import anyio
import msgspec
import pytest

from net.client import Client, ConnectionLostError
from protocols import Finished, GenerateRequest, SamplingParams, TokenDelta
from runtime import Runtime, RuntimeConfig
from runtime.checkpoints import path_for
from tests.support.serve import ServerProcess

pytestmark = pytest.mark.server

# model: (tokens to generate, prompt token range)
MODELS = {
    "bench": (64, 30000),
    "tiny-gemma3": (600, 1000),
    "tiny-lfm2": (600, 1000),
    "tiny-qwen3next": (600, 1000),
    "tiny-spec": (600, 1000),
    "tiny-kv": (600, 1000),
}
# Models served with speculative decoding (every round drafting: rewinds happen all along).
SPECULATIVE = {"tiny-spec": {"draft": "builtin:tiny-spec-draft", "adaptive": False}}
# Models served with quantized KV (a float head, then 8-bit positions).
QUANTIZED_KV = {"tiny-kv": {"bits": 8, "quantized_start": 16}}


def _config(directory, model: str = "bench") -> tuple[dict, object]:
    tree = {
        "model": {"path": f"builtin:{model}"},
        "generation": {"seed": 0},
        "logging": {"level": "warning", "format": "json"},
        "checkpoints": {"dir": str(directory / "checkpoints")},
    }
    if model in SPECULATIVE:
        tree["speculative"] = SPECULATIVE[model]
    if model in QUANTIZED_KV:
        tree["kv"] = QUANTIZED_KV[model]
    path = directory / "server.toml"
    path.write_bytes(msgspec.toml.encode(tree))
    return tree, path


def _request(sampling: SamplingParams, model: str = "bench") -> GenerateRequest:
    max_tokens, vocab = MODELS[model]
    prompt = [random.Random(9).randrange(100, vocab) for _ in range(40)]
    return GenerateRequest(prompt_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id="job-1", checkpoint_every=8, sampling=sampling)


SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, top_k=50, seed=1234)}
# Seeded resumes are covered on the small models (lfm2, spec, kv); the bench model once, greedy.
# make test runs one model per layer kind (windows, recurrent, drafts, quantized KV); the
# ~125M model and the hybrid qwen3next run in make test-all.
CASES = [
    pytest.param("bench", "greedy", marks=pytest.mark.exhaustive),
    ("tiny-gemma3", "greedy"),
    ("tiny-lfm2", "seeded"),
    pytest.param("tiny-qwen3next", "greedy", marks=pytest.mark.exhaustive),
    ("tiny-spec", "seeded"),
    ("tiny-kv", "seeded"),
]


@pytest.mark.parametrize(
    ("model", "kind"), CASES, ids=["bench-greedy", "tiny-gemma3-greedy", "tiny-lfm2-seeded", "tiny-qwen3next-greedy", "tiny-spec-seeded", "tiny-kv-seeded"]
)
async def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, model, kind):
    sampling = SAMPLINGS[kind]
    max_tokens = MODELS[model][0]
    tree, config_path = _config(tmp_path, model)
    reference_config = RuntimeConfig.from_tree({**tree, "checkpoints": {"dir": str(tmp_path / "reference")}}, source="test")
    async with Runtime.open(reference_config) as rt:
        uninterrupted = [t async for e in rt.generate(_request(sampling, model)) if isinstance(e, TokenDelta) for t in e.token_ids]
    assert len(uninterrupted) == max_tokens

    checkpoint = path_for(tmp_path / "checkpoints", "job-1")
    socket = tmp_path / "run" / "s.sock"
    server = ServerProcess(config_path, socket, tmp_path)
    before: list[int] = []
    try:
        server.wait_ready()
        with pytest.raises(ConnectionLostError):
            async with Client.connect(socket) as client:
                async for event in client.generate(_request(sampling, model)):
                    if isinstance(event, TokenDelta):
                        before += event.token_ids
                        if len(before) >= 20 and checkpoint.exists():
                            server.proc.kill()
                            server.proc.wait()
    finally:
        server.stop()
    assert server.returncode == -9 and len(before) < max_tokens
    assert before == uninterrupted[: len(before)]

    restarted = ServerProcess(config_path, socket, tmp_path)
    try:
        restarted.wait_ready()
        async with Client.connect(socket) as client:
            deltas, finished = [], None
            async for event in client.resume("job-1"):
                if isinstance(event, TokenDelta):
                    deltas.append(event.token_ids)
                elif isinstance(event, Finished):
                    finished = event
            with anyio.fail_after(5):
                while checkpoint.exists():  # deleted once the request has finished
                    await anyio.sleep(0.02)
    finally:
        restarted.stop()
    # Killed once a checkpoint exists: at least the first one (8 tokens; later ones may still be
    # in the writer on a loaded machine). The first delta re-delivers everything before it.
    assert len(deltas[0]) >= 8, "the first delta re-delivers everything before the checkpoint"
    assert [t for d in deltas for t in d] == uninterrupted
    assert finished.finish_reason == "length" and finished.usage.completion_tokens == max_tokens
    if model in SPECULATIVE:  # the resumed request speculated again (its draft KV rebuilt), reported over the socket
        assert finished.spec is not None and finished.spec.rounds > 0 and finished.spec.accepted > 0


async def test_resume_over_the_socket_rejects_bad_checkpoints(tmp_path):
    from runtime.checkpoints import CheckpointError, CheckpointNotFoundError

    tree, config_path = _config(tmp_path)
    tree["model"]["path"] = "builtin:tiny"
    config_path.write_bytes(msgspec.toml.encode(tree))
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    path_for(directory, "broken").write_bytes(b"MLXRTCK1" + b"\x00" * 40)
    socket = tmp_path / "run" / "s.sock"
    server = ServerProcess(config_path, socket, tmp_path)
    try:
        server.wait_ready()
        async with Client.connect(socket) as client:
            with pytest.raises(CheckpointNotFoundError):
                async for _ in client.resume("missing"):
                    pass
            with pytest.raises(CheckpointError):
                async for _ in client.resume("broken"):
                    pass
            outcome = [e async for e in client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=3))]
            assert isinstance(outcome[-1], Finished)
    finally:
        server.stop()
