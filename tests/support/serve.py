"""`mlxrt serve` subprocesses for the server tests, and waiting for a server to go idle.

`running_server` starts `python -m tools.cli serve` on a fresh socket directory (a config for the
tiny built-in model written by `write_config`) and stops it afterwards (SIGTERM, then SIGKILL);
`start_server` and `stop_all` let several start and stop at once. `wait_idle` polls a client's
stats until nothing is live, with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec

from protocols.wire import Stats
from tests.support.config import CHUNK, REPO
from tests.support.waiting import wait_until

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


def write_config(directory: Path, *, scheduler: dict | None = None, server: dict | None = None, name: str = "server.toml", **sections: dict) -> Path:
    """A config for the tiny built-in model, matching `tests.support.config.make_config` unless overridden
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
        return wait_until(
            lambda: next((line for line in list(self.stdout_lines) if text in line), None),
            timeout,
            message=lambda: f"the server never printed {text!r}; stdout: {self.stdout_lines}",
        )

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
