"""Where the server's socket lives, and making that place safe.

The socket sits in a directory only its owner (or, with mode 0660, the owner's
group) can enter; existing directories are checked, never loosened or tightened.
A leftover socket with no server behind it is removed; a live one is refused.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from runtime import env
from runtime.errors import MlxrtError


class SocketPathError(MlxrtError):
    """The socket path is unsafe, or a live server already listens there."""


class SocketInUseError(SocketPathError):
    """Another server is accepting connections on this path."""


def default_socket_path() -> Path:
    base = env.runtime_dir()
    if base:
        return Path(base) / "mlxrt" / "mlxrt.sock"
    return Path(f"/tmp/mlxrt-{os.getuid()}") / "mlxrt.sock"


def directory_mode(socket_mode: int) -> int:
    return 0o750 if socket_mode & 0o070 else 0o700


def prepare(path: Path, socket_mode: int) -> None:
    """Make `path` ready for a new listener, or raise `SocketPathError`."""
    directory = path.parent
    wanted = directory_mode(socket_mode)
    if not directory.exists():
        directory.mkdir(parents=True, mode=wanted)
        os.chmod(directory, wanted)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise SocketPathError(f"{directory} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) & ~wanted & 0o777:
        raise SocketPathError(f"{directory} is open to others (mode {stat.S_IMODE(info.st_mode):o}); put the socket in a private directory (mode {wanted:o})")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketPathError(f"{path} exists and is not a socket")
        if is_live(path):
            raise SocketInUseError(f"a server is already listening on {path}")
        path.unlink()


def is_live(path: Path) -> bool:
    """Whether something accepts connections on the socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True
