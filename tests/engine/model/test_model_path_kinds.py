"""What a model path names, told plainly: a FIFO, a directory, a device or a socket given where a
GGUF file or a model directory belongs is refused typed naming what it is (from `stat`: a FIFO is
never opened, so nothing waits for a writer), and a missing one says it is missing."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from engine.model.loader import path_kind, resolve_model_path
from protocols.errors import ModelLoadError


def _resolved(path: Path | str, tmp_path: Path) -> ModelLoadError:
    """The refusal of `path`, taken in a thread that must end (a FIFO opened for reading blocks)."""
    outcome: list[BaseException | Path] = []
    worker = threading.Thread(target=lambda: outcome.append(_try(str(path), tmp_path)), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked opening a FIFO: a writer releases it, then the test fails
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"{path}: resolving blocked")
    assert isinstance(outcome[0], ModelLoadError), outcome
    return outcome[0]


def _try(path: str, root: Path) -> BaseException | Path:
    try:
        return resolve_model_path(path, root / "builtins")
    except BaseException as exc:
        return exc


def test_a_fifo_directory_device_or_socket_named_like_a_gguf_file_says_what_it_is(tmp_path):
    fifo, directory = tmp_path / "fifo.gguf", tmp_path / "dir.gguf"
    os.mkfifo(fifo)
    directory.mkdir()
    sock_path = tmp_path / "s.gguf"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        errors = {name: str(_resolved(path, tmp_path)) for name, path in (("fifo", fifo), ("dir", directory), ("socket", sock_path), ("dev", "/dev/null.gguf"))}
    assert "is a FIFO (named pipe), not a GGUF file" in errors["fifo"]
    assert "is a directory, not a GGUF file" in errors["dir"]
    assert "is a socket, not a GGUF file" in errors["socket"]
    assert "no such GGUF file" in errors["dev"]  # (nothing at that name)
    assert not any("no such" in errors[name] for name in ("fifo", "dir", "socket"))


def test_a_fifo_or_device_given_as_a_model_directory_says_what_it_is(tmp_path):
    fifo = tmp_path / "model"
    os.mkfifo(fifo)
    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "missing")
    assert "is a FIFO (named pipe), not an mlx-lm model directory" in str(_resolved(fifo, tmp_path))
    assert "is a character device, not an mlx-lm model directory" in str(_resolved("/dev/null", tmp_path))
    assert "is a broken symbolic link" in str(_resolved(link, tmp_path))
    assert "(no such directory)" in str(_resolved(tmp_path / "absent", tmp_path))
    (tmp_path / "empty").mkdir()
    assert "(no config.json)" in str(_resolved(tmp_path / "empty", tmp_path))


def test_path_kind_names_each_kind_from_stat_alone(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    os.mkfifo(tmp_path / "p")
    assert [path_kind(tmp_path / n) for n in ("f", "p", "nope")] == ["a regular file", "a FIFO (named pipe)", "nothing"]
    assert (path_kind(tmp_path), path_kind(Path("/dev/null")), path_kind(tmp_path / "f" / "under")) == ("a directory", "a character device", "nothing")
