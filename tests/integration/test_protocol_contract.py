"""A client written from `protocols/README.md` alone, against a real `mlxrt serve`.

Nothing here imports the wire types: frames are built with `struct` and `msgspec.msgpack` from plain
dicts whose every field the README's tables document (`ProtocolReadme.message`), and every frame the
server sends is checked against those tables (`ProtocolReadme.conformance`), in the shape of the
version the connection chose. So the test breaks when the README lies about the server.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.support.protocol_readme import ProtocolReadme
from tests.support.serve import running_server

pytestmark = pytest.mark.server

# The README's "Framing": a uint32 length, big-endian, then one MessagePack map.
HEADER = struct.Struct(">I")


@pytest.fixture(scope="module")
def readme() -> ProtocolReadme:
    return ProtocolReadme.load()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("contract")) as process:
        yield process


class ReadmeClient:
    """A blocking connection that speaks only what the README documents."""

    def __init__(self, path: Path, readme: ProtocolReadme, timeout: float = 30.0):
        self.readme = readme
        self.version: int | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self._buffer = b""

    def __enter__(self) -> ReadmeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send_body(self, body: dict[str, Any]) -> None:
        data = msgspec.msgpack.encode(body)
        self.sock.sendall(HEADER.pack(len(data)) + data)

    def send(self, name: str, **fields: Any) -> None:
        self.send_body(self.readme.message(name, **fields))

    def hello(self, version: int) -> dict:
        self.send("Hello", protocol_version=version, client="readme-client")
        answer = self.read()
        assert answer is not None, "the server closed without answering Hello"
        if answer["type"] == "Welcome":
            self.version = answer["protocol_version"]
        return answer

    def _fill(self, n: int) -> bool:
        while len(self._buffer) < n:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return False
            self._buffer += chunk
        return True

    def read(self) -> dict | None:
        """The next message as a plain dict, checked against the README (None at end of stream)."""
        if not self._fill(HEADER.size):
            assert not self._buffer, "the server closed mid-frame"
            return None
        (size,) = HEADER.unpack(self._buffer[: HEADER.size])
        assert self._fill(HEADER.size + size), "the server closed mid-frame"
        body, self._buffer = self._buffer[HEADER.size : HEADER.size + size], self._buffer[HEADER.size + size :]
        message = msgspec.msgpack.decode(body)
        problem = self.readme.conformance(message, self.version)
        assert problem is None, f"the server sent what the README does not document: {problem}"
        return message

    def read_request(self, request_id: str) -> tuple[list[dict], dict]:
        """The request's events up to its `Finished` (other requests' events skipped)."""
        events: list[dict] = []
        while True:
            message = self.read()
            assert message is not None, "the server closed before Finished"
            if message.get("request_id") != request_id:
                continue
            assert message["type"] != "Error", message
            if message["type"] == "Finished":
                return events, message
            events.append(message)


def _generate(client: ReadmeClient, request_id: str, max_tokens: int) -> tuple[list[int], str, dict]:
    request = {"request_id": request_id, "prompt_ids": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True}
    client.send("Generate", request=request)
    events, finished = client.read_request(request_id)
    deltas = [e for e in events if e["type"] == "TokenDelta"]
    return [t for d in deltas for t in d["token_ids"]], "".join(d["text"] for d in deltas), finished


def test_a_client_of_the_documented_version_generates_cancels_and_reads_stats(server, readme):
    with ReadmeClient(server.socket, readme) as client:
        welcome = client.hello(readme.version)
        assert welcome["type"] == "Welcome" and welcome["protocol_version"] == readme.version

        tokens, _text, finished = _generate(client, "contract-1", 4)
        assert len(tokens) == 4 == finished["usage"]["completion_tokens"]
        assert finished["finish_reason"] == "length" and finished["usage"]["prompt_tokens"] == 3

        client.send("GetStats")
        stats = client.read()
        assert stats is not None and stats["type"] == "Stats"
        assert stats["connections"] >= 1 and stats["adapters"] == []

        client.send("Generate", request={"request_id": "contract-2", "prompt_ids": [1, 2, 3], "max_tokens": 5000, "ignore_eos": True})
        while (message := client.read()) is not None and message["type"] != "TokenDelta":
            pass
        client.send("Cancel", request_id="contract-2")
        _events, finished = client.read_request("contract-2")
        assert finished["finish_reason"] == "cancelled"

        client.send("Cancel", request_id="nobody")
        error = client.read()
        assert error is not None and (error["type"], error["code"], error["request_id"]) == ("Error", "unknown_request", "nobody")


def test_a_field_the_readme_does_not_document_is_an_invalid_message(server, readme):
    with ReadmeClient(server.socket, readme) as client:
        client.hello(readme.version)
        assert "priority" in readme.fields("GenerateRequest") and "urgency" not in readme.fields("GenerateRequest")
        client.send_body({"type": "Generate", "request": {"request_id": "x", "prompt_ids": [1], "urgency": 3}})
        error = client.read()
        assert error is not None and (error["type"], error["code"]) == ("Error", "invalid_message")
        tokens, _text, _finished = _generate(client, "after-undocumented", 2)  # the connection stays usable
        assert len(tokens) == 2


def test_an_older_supported_version_gets_its_own_shapes(server, readme):
    older = [v for v in readme.versions if v < readme.version]
    assert 1 in older
    with ReadmeClient(server.socket, readme) as client:
        welcome = client.hello(1)
        assert welcome["type"] == "Welcome" and welcome["protocol_version"] == 1
        client.send("GetStats")
        stats = client.read()  # checked against the `Stats` (version 1) table
        assert stats is not None and stats["type"] == "Stats"
        assert "adapters" not in stats and stats["connections"] >= 1
        tokens, _text, finished = _generate(client, "contract-v1", 3)
        assert len(tokens) == 3 and finished["finish_reason"] == "length"


def test_a_version_the_server_does_not_speak_is_refused_naming_the_ones_it_does(server, readme):
    for version in (max(readme.versions) + 1, min(readme.versions) - 1):
        with ReadmeClient(server.socket, readme) as client:
            error = client.hello(version)
            assert error is not None and (error["type"], error["code"]) == ("Error", "protocol_error"), error
            assert error["supported_versions"] == readme.versions
            assert all(str(v) in error["message"] for v in readme.versions) and str(version) in error["message"]
            assert client.read() is None  # then the server closes the connection
    assert server.alive


def test_a_version_1_connection_gets_only_the_fields_version_1_had(server, readme):
    """A version-1 client that refuses unknown fields: no field added since (`Finished.denoising_steps`,
    `TokenLogprob.rank`, `KvStats.disk`, ...) reaches it, at any depth; version 2 gets them."""
    from protocols.wire_v1 import V1_FIELDS

    def unknown(message: dict, name: str) -> set[str]:
        return set(message) - set(V1_FIELDS[name]) - {"type"}

    with ReadmeClient(server.socket, readme) as old, ReadmeClient(server.socket, readme) as new:
        old.hello(1), new.hello(readme.version)
        seen: dict[int, tuple[list[dict], dict, dict]] = {}
        for version, client in ((1, old), (readme.version, new)):
            request = {"request_id": f"fields-v{version}", "prompt_ids": [1, 2, 3], "max_tokens": 2, "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
            client.send("Generate", request=request)
            events, finished = client.read_request(request["request_id"])
            client.send("GetStats")
            stats = client.read()
            assert stats is not None and stats["type"] == "Stats"
            seen[version] = events, finished, stats
    events, finished, stats = seen[1]
    assert unknown(finished, "Finished") == set() and unknown(finished["usage"], "Usage") == set()
    deltas = [e for e in events if e["type"] == "TokenDelta"]
    assert deltas and all(unknown(d, "TokenDelta") == set() and all(unknown(lp, "TokenLogprob") == set() for lp in d["logprobs"]) for d in deltas)
    assert unknown(stats, "StatsV1") == set() and unknown(stats["kv"], "KvStats") == set()
    events, finished, stats = seen[readme.version]
    assert "denoising_steps" in finished and "disk" in stats["kv"] and "adapters" in stats
    assert "rank" in next(e for e in events if e["type"] == "TokenDelta")["logprobs"][0]
