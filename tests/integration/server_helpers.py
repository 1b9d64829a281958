"""Shared helpers for the `mlxrt serve` integration tests.

`running_server` starts `python -m tools.cli serve` as a subprocess on a fresh
socket directory and stops it afterwards (SIGTERM, then SIGKILL). `RawConnection`
speaks the wire protocol over a plain blocking socket, for tests that must send
frames no `Client` would. The async helpers collect event streams and wait for a
server to become idle, always with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from net.framing import HEADER, encode_frame
from protocols.api import Finished, PrefillProgress, TokenDelta
from protocols.wire import PROTOCOL_VERSION, Hello, ServerMessage, Stats, Welcome
from tests.conftest import CHUNK, REPO

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


def write_config(directory: Path, *, scheduler: dict | None = None, server: dict | None = None, name: str = "server.toml", **sections: dict) -> Path:
    """A config for the tiny built-in model, matching `tests.conftest.make_config` unless overridden
    (other sections, e.g. `checkpoints={...}`, by keyword)."""
    tree = {
        "model": {"path": "builtin:tiny"},
        "scheduler": {"max_batch_size": 8, "prefill_chunk_size": CHUNK, **(scheduler or {})},
        "generation": {"seed": 0},
        "logging": {"level": "warning", "format": "json"},
        "checkpoints": {"dir": str(directory / "checkpoints")},
        **sections,
    }
    if server:
        tree["server"] = server
    path = directory / name
    path.write_bytes(msgspec.toml.encode(tree))
    return path


class ServerProcess:
    """One `mlxrt serve` subprocess; its stdout is drained by a thread."""

    def __init__(self, config: Path, socket_path: Path, log_dir: Path, command: list[str] | None = None, environ: dict[str, str] | None = None):
        """`command`: the `tools.cli` arguments before `--socket` (default: serve --config);
        `environ`: variables added to the test's own."""
        self.config = config
        self.socket = socket_path
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        self._stderr_path = log_dir / f"{socket_path.stem}-{time.monotonic_ns()}.stderr"
        self._stderr = open(self._stderr_path, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", *(command or ["serve", "--config", str(config)]), "--socket", str(socket_path)],
            cwd=REPO,
            start_new_session=True,  # its own process group: `kill_group` reaches every process it started
            env={**os.environ, **(environ or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self._reader = threading.Thread(target=self._read_stdout, name="server-stdout", daemon=True)
        self._reader.start()
        self.returncode: int | None = None

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            if "serving" in line:
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before serving:\n{self.stderr()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not print 'serving' within {timeout} s:\n{self.stderr()}")

    def wait_for_output(self, text: str, timeout: float = 10.0) -> str:
        """The first stdout line containing `text`, polled for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.stdout_lines):
                if text in line:
                    return line
            if time.monotonic() > deadline:
                raise AssertionError(f"the server never printed {text!r}; stdout: {self.stdout_lines}")
            time.sleep(0.01)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_kib(self) -> int:
        """The server's resident memory now."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def num_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stderr(self) -> str:
        """The tail of the server's log (for assertion messages)."""
        return self.log_text()[-6000:]

    def log_text(self) -> str:
        self._stderr.flush()
        return self._stderr_path.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        """SIGKILL the process and everything it started (a distributed world's ranks)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait_exit(timeout) is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self.proc.stdout.close()
        self._stderr.close()
        self.returncode = self.proc.returncode
        return self.returncode


def start_server(directory: Path, *, scheduler: dict | None = None, server: dict | None = None, **sections: dict) -> ServerProcess:
    """A server starting on `directory/run/s.sock` (the run directory is left for the server to create).

    Returns at once: call `wait_ready()` before use, and `stop()` in the end. Starting
    several before waiting for any lets their (CPU-bound) start-ups overlap.
    """
    config = write_config(directory, scheduler=scheduler, server=server, **sections)
    return ServerProcess(config, directory / "run" / "s.sock", directory)


def stop_all(processes) -> None:
    """Stop several servers at once (their shutdowns overlap)."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop()


@contextlib.contextmanager
def running_server(directory: Path, *, scheduler: dict | None = None, server: dict | None = None, **sections: dict) -> Iterator[ServerProcess]:
    """A ready server, stopped on exit."""
    process = start_server(directory, scheduler=scheduler, server=server, **sections)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


# -- event streams -----------------------------------------------------------------


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    events: list = field(default_factory=list)

    @property
    def last(self) -> Finished:
        assert len(self.finished) == 1, f"expected exactly one Finished, got {self.finished}"
        assert self.events[-1] is self.finished[0], "Finished must be the last event"
        return self.finished[0]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TokenDelta))


async def collect(events) -> Outcome:
    """Every event of a stream, tokens concatenated."""
    outcome = Outcome()
    async for event in events:
        outcome.events.append(event)
        if isinstance(event, TokenDelta):
            outcome.tokens += event.token_ids
        elif isinstance(event, Finished):
            outcome.finished.append(event)
        else:
            assert isinstance(event, PrefillProgress), event
    return outcome


async def collect_all(generate, requests: list) -> list[Outcome]:
    """The streams of `requests` submitted together through `generate` (a runtime's, a pool's or
    a client's), in request order."""
    outcomes: list[Outcome] = [Outcome() for _ in requests]

    async def one(i: int) -> None:
        outcomes[i] = await collect(generate(requests[i]))

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return outcomes


def is_idle(stats) -> bool:
    s = stats.scheduler
    return (
        stats.live_requests == 0
        and stats.kv.live_tokens == 0
        and stats.kv.reserved_tokens == 0
        and stats.kv.live_requests == 0
        and s.waiting == s.prefilling == s.decoding == 0
    )


async def wait_idle(client, timeout: float = 10.0, connections: int | None = None) -> Stats:
    """Poll `client.stats()` until nothing is live (and, if given, that many connections remain)."""
    stats = None
    try:
        with anyio.fail_after(timeout):
            while True:
                stats = await client.stats()
                if is_idle(stats) and (connections is None or stats.connections == connections):
                    return stats
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"the server did not become idle within {timeout} s: {stats}") from None


# -- raw frames --------------------------------------------------------------------

_DECODER = msgspec.msgpack.Decoder(ServerMessage)


def frame_of(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


class RawConnection:
    """A blocking Unix-socket connection that sends whatever bytes it is told to."""

    def __init__(self, path: Path | str, timeout: float = 5.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self._buffer = bytearray()
        self.reset = False

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send_bytes(self, data: bytes) -> bool:
        """False if the server had already closed the connection."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def send(self, message: msgspec.Struct) -> bool:
        return self.send_bytes(encode_frame(message))

    def send_body(self, body: bytes) -> bool:
        return self.send_bytes(frame_of(body))

    def shutdown_write(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def hello(self) -> Welcome:
        self.send(Hello(protocol_version=PROTOCOL_VERSION, client="raw-test"))
        welcome = self.read()
        assert isinstance(welcome, Welcome), welcome
        return welcome

    def _fill(self, n: int) -> bool:
        while len(self._buffer) < n:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                # Linux reports ECONNRESET instead of EOF when the server closed with our bytes unread.
                self.reset = True
                chunk = b""
            if not chunk:
                return False
            self._buffer += chunk
        return True

    def read(self):
        """The next server message, or None at end of stream (raises `TimeoutError` on a silent server)."""
        if not self._fill(HEADER.size):
            assert not self._buffer, f"the server closed mid-frame: {bytes(self._buffer)!r}"
            return None
        (size,) = HEADER.unpack(self._buffer[: HEADER.size])
        if not self._fill(HEADER.size + size):
            raise AssertionError("the server closed mid-frame")
        body = bytes(self._buffer[HEADER.size : HEADER.size + size])
        del self._buffer[: HEADER.size + size]
        return _DECODER.decode(body)

    def read_until_eof(self, limit: int = 100_000) -> list:
        messages = []
        while (message := self.read()) is not None:
            messages.append(message)
            assert len(messages) < limit
        return messages

    def read_until_finished(self, request_id: str) -> tuple[list[int], Finished]:
        tokens = []
        while True:
            message = self.read()
            assert message is not None, "the server closed the connection before Finished"
            if isinstance(message, TokenDelta) and message.request_id == request_id:
                tokens += message.token_ids
            elif isinstance(message, Finished) and message.request_id == request_id:
                return tokens, message
