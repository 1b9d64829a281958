"""The server's socket file: modes, stale and live sockets, unsafe paths, peer uids.

In-process servers (`Runtime.open` + `Server.serve`) unless a test needs `mlxrt serve` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from net.client import Client
from net.server import Server
from net.socket_path import SocketInUseError, SocketPathError
from protocols.api import GenerateRequest
from runtime import Runtime
from runtime.config import ServerConfig
from tests.support.config import REPO, make_config
from tests.support.events import collect
from tests.support.serve import write_config

pytestmark = pytest.mark.server

NOBODY = 65534


@contextlib.asynccontextmanager
async def serving(path: Path, **options):
    """A real runtime served on `path` until the block ends."""
    async with Runtime.open(make_config()) as rt, anyio.create_task_group() as tg:
        server = Server(rt, ServerConfig(**options), path)
        await tg.start(server.serve)
        try:
            yield server
        finally:
            server.stop()


async def _refused(path: Path, error: type[Exception] = SocketPathError, **options) -> Exception:
    """`serve` must refuse before listening (no runtime is needed to get that far)."""
    with pytest.raises(error) as info, anyio.fail_after(5):
        await Server(None, ServerConfig(**options), path).serve()
    return info.value


async def _answers(path: Path) -> None:
    async with Client.connect(path) as client:
        outcome = await collect(client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=3, ignore_eos=True)))
        assert len(outcome.tokens) == 3 and outcome.last.finish_reason == "length"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _private_dir(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize(
    "options, socket_mode, directory_mode",
    [({}, 0o600, 0o700), ({"socket_mode": "0600"}, 0o600, 0o700), ({"socket_mode": "0660"}, 0o660, 0o750)],
    ids=["default", "0600", "0660"],
)
async def test_socket_and_directory_modes(tmp_path, options, socket_mode, directory_mode):
    path = tmp_path / "a" / "run" / "s.sock"  # missing parents are created too
    async with serving(path, **options):
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert _mode(path) == socket_mode
        assert _mode(path.parent) == directory_mode
        assert os.stat(path).st_uid == os.getuid()
        await _answers(path)
    assert not os.path.lexists(path), "the socket file must be removed when the server stops"
    assert _mode(path.parent) == directory_mode


async def test_a_stale_socket_is_replaced(tmp_path):
    path = _private_dir(tmp_path / "run") / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.listen()
    stale.close()  # the file stays, nobody listens
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(str(path))
    async with serving(path):
        await _answers(path)
    assert not os.path.lexists(path)


async def test_a_live_server_is_not_displaced(tmp_path):
    path = tmp_path / "run" / "s.sock"
    async with serving(path) as first:
        inode = os.lstat(path).st_ino
        await _refused(path, SocketInUseError)
        second = Server(first.runtime, ServerConfig(), path)
        with pytest.raises(SocketInUseError, match="already listening"), anyio.fail_after(5):
            await second.serve()
        assert os.lstat(path).st_ino == inode, "the live server's socket must not be touched"
        await _answers(path)
    assert not os.path.lexists(path)


async def test_mlxrt_serve_on_a_busy_or_unsafe_path_exits_2(tmp_path):
    """Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): the SocketPathError reached main() inside an ExceptionGroup
    (tg.start within Runtime.open), giving exit code 1 and a traceback."""
    config = write_config(tmp_path)
    path = tmp_path / "run" / "s.sock"
    unsafe = tmp_path / "open"
    unsafe.mkdir()
    os.chmod(unsafe, 0o755)
    results = {}

    async def serve(name: str, socket_path: Path) -> None:
        results[name] = await anyio.run_process(
            [sys.executable, "-m", "tools.cli", "serve", "--config", str(config), "--socket", str(socket_path)], cwd=REPO, check=False
        )

    async with serving(path):
        inode = os.lstat(path).st_ino
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve, "busy", path)
                tg.start_soon(serve, "unsafe", unsafe / "s.sock")
        assert os.lstat(path).st_ino == inode
        await _answers(path)
    for name, expected in (("busy", "already listening"), ("unsafe", "open to others")):
        result = results[name]
        stderr = result.stderr.decode(errors="replace")
        assert result.returncode == 2, f"{name}: exit code {result.returncode}\n{stderr[-2000:]}"
        assert expected in stderr and "Traceback" not in stderr, stderr[-2000:]
        assert b"serving" not in result.stdout
    assert list(unsafe.iterdir()) == []


@pytest.mark.parametrize(
    "directory_mode, socket_mode",
    [(0o755, "0600"), (0o750, "0600"), (0o711, "0600"), (0o777, "0600"), (0o770, "0660"), (0o755, "0660"), (0o701, "0660")],
)
async def test_a_directory_open_to_others_is_refused(tmp_path, directory_mode, socket_mode):
    run = _private_dir(tmp_path / "run", directory_mode)
    error = await _refused(run / "s.sock", socket_mode=socket_mode)
    assert "open to others" in str(error)
    assert _mode(run) == directory_mode, "an existing directory is never loosened or tightened"
    assert list(run.iterdir()) == []


async def test_a_tighter_existing_directory_is_accepted(tmp_path):
    run = _private_dir(tmp_path / "run", 0o700)
    path = run / "s.sock"
    async with serving(path, socket_mode="0660"):
        assert _mode(path) == 0o660
        await _answers(path)
    assert _mode(run) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
async def test_a_directory_owned_by_someone_else_is_refused(tmp_path):
    run = _private_dir(tmp_path / "run")
    os.chown(run, NOBODY, NOBODY)
    error = await _refused(run / "s.sock")
    assert f"uid {NOBODY}" in str(error)


async def test_a_path_that_is_not_a_socket_is_refused_and_kept(tmp_path):
    run = _private_dir(tmp_path / "run")
    elsewhere = _private_dir(tmp_path / "elsewhere")

    regular = run / "file.sock"
    regular.write_text("precious")
    error = await _refused(regular)
    assert "not a socket" in str(error)
    assert regular.read_text() == "precious"

    directory = run / "dir.sock"
    directory.mkdir()
    (directory / "inside").write_text("kept")
    await _refused(directory)
    assert (directory / "inside").read_text() == "kept"

    fifo = run / "fifo.sock"
    os.mkfifo(fifo)
    await _refused(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)

    # A symlink is not followed, even to a (stale) socket.
    target = elsewhere / "target.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(target))
    link = run / "link.sock"
    link.symlink_to(target)
    await _refused(link)
    assert link.is_symlink() and stat.S_ISSOCK(os.lstat(target).st_mode)


async def test_stopping_removes_only_its_own_socket(tmp_path):
    path = tmp_path / "run" / "s.sock"
    async with serving(path):
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert not os.path.lexists(path)

    # If another socket took the path meanwhile, stopping leaves it alone.
    async with serving(path):
        os.unlink(path)
        newcomer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        newcomer.bind(str(path))
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode), "another server's socket was removed"
    finally:
        newcomer.close()


# -- peer uid (SO_PEERCRED) --------------------------------------------------------

CHILD = """
import json
import os
import socket
import sys

import anyio
import msgspec

from protocols.api import Finished, GenerateRequest, TokenDelta
from protocols.wire import PROTOCOL_VERSION, Error, Hello, ServerMessage
from net.client import Client, ServerError
from net.framing import HEADER, encode_frame


async def _warm():
    await anyio.sleep(0)


anyio.run(_warm)  # load the event loop machinery while the interpreter's files are readable
# Become another user; keep group 0, the socket's group (socket_mode = "0660").
os.setgroups([])
os.setgid(0)
os.setuid(int(sys.argv[2]))
path = sys.argv[1]
decoder = msgspec.msgpack.Decoder(ServerMessage)


def read_frame(sock):
    data = b""
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack(data[: HEADER.size])[0]:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return "eof" if not data else "partial"
        data += chunk
    return decoder.decode(data[HEADER.size :])


result = {"uid": os.getuid()}
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
    sock.settimeout(10)
    sock.connect(path)
    try:
        sock.sendall(encode_frame(Hello(protocol_version=PROTOCOL_VERSION)))
    except (BrokenPipeError, ConnectionResetError):
        result["raw_hello_refused"] = True  # the server may refuse before reading; its answer is still readable
    first = read_frame(sock)
    result["raw_first"] = type(first).__name__
    if isinstance(first, Error):
        result["raw_code"], result["raw_message"] = first.code, first.message
        then = read_frame(sock)
        result["raw_then"] = then if isinstance(then, str) else type(then).__name__


async def with_client():
    try:
        async with Client.connect(path) as client:
            tokens, reason = [], None
            async for event in client.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)):
                if isinstance(event, TokenDelta):
                    tokens += event.token_ids
                elif isinstance(event, Finished):
                    reason = event.finish_reason
            result["client"] = {"tokens": len(tokens), "reason": reason}
    except ServerError as exc:
        result["client"] = {"error": exc.code, "message": str(exc)}
    except Exception as exc:  # anything else is a failure the test reports
        result["client"] = {"exception": repr(exc)}


anyio.run(with_client)
print(json.dumps(result), flush=True)
"""


@pytest.fixture
def shared_dir():
    """A directory others may traverse (pytest's own tmp dirs are private to root)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("needs root on Linux: the test connects as another uid (SO_PEERCRED)")
    directory = Path(tempfile.mkdtemp(prefix="mlxrt-peer-", dir="/tmp"))
    os.chmod(directory, 0o711)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _connect_as_nobody(path: Path, tmp_path: Path) -> dict:
    script = tmp_path / "peer_child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    with anyio.fail_after(60):
        result = await anyio.run_process([sys.executable, str(script), str(path), str(NOBODY)], cwd=REPO, env=env, check=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-3000:]
    outcome = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert outcome["uid"] == NOBODY
    return outcome


async def test_a_peer_with_another_uid_is_refused(shared_dir, tmp_path):
    path = shared_dir / "run" / "s.sock"
    async with serving(path, socket_mode="0660"):
        assert _mode(path.parent) == 0o750 and _mode(path) == 0o660
        outcome = await _connect_as_nobody(path, tmp_path)
        await _answers(path)  # the server's own uid still gets in
    # An Error frame naming the uid, then the server closes the connection.
    assert outcome["raw_first"] == "Error" and outcome["raw_code"] == "protocol_error"
    assert str(NOBODY) in outcome["raw_message"]
    assert outcome["raw_then"] == "eof"
    # `Client.connect` reports the refusal as a ServerError, whether or not its Hello got through
    # before the server closed (see test_client_connect_reports_a_refusal_that_beat_its_hello).
    client = outcome["client"]
    assert client.get("error") == "protocol_error" and str(NOBODY) in client["message"], client


async def test_client_connect_reports_a_refusal_that_beat_its_hello(tmp_path, monkeypatch):
    """Regression (bug in 4251e0d..d2bc91e, fixed in be3bfab): Client.connect's Hello send raised anyio.BrokenResourceError when
    the server had already refused and closed, hiding the server's Error frame."""
    from net.client import ServerError
    from net.framing import encode_frame
    from protocols.wire import Error

    path = tmp_path / "refusing.sock"
    refused = anyio.Event()

    async def refuse(stream) -> None:
        async with stream:
            await stream.send(encode_frame(Error(code="protocol_error", message=f"uid {NOBODY} is not allowed")))
        refused.set()

    real_connect = anyio.connect_unix

    async def connect_then_wait(target):
        stream = await real_connect(target)
        with anyio.fail_after(5):
            await refused.wait()  # the server refuses (and closes) before the client says Hello
        return stream

    monkeypatch.setattr(anyio, "connect_unix", connect_then_wait)
    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, refuse)
        try:
            with pytest.raises(ServerError) as info:
                async with Client.connect(path):
                    pass
            assert info.value.code == "protocol_error" and str(NOBODY) in str(info.value)
        finally:
            tg.cancel_scope.cancel()


async def test_an_allowed_uid_is_served(shared_dir, tmp_path):
    path = shared_dir / "run" / "s.sock"
    async with serving(path, socket_mode="0660", allowed_uids=[NOBODY]):
        outcome = await _connect_as_nobody(path, tmp_path)
    assert outcome["raw_first"] == "Welcome"
    assert outcome["client"] == {"tokens": 4, "reason": "length"}
