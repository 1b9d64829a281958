"""A raw wire-protocol connection to `mlxrt serve`, for frames no `Client` would send.

`RawConnection` speaks the framing over a plain blocking Unix socket: it sends whatever bytes
or messages it is told to, and reads server messages (or the end of the stream) with a timeout.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import msgspec

from net.framing import HEADER, encode_frame
from protocols.api import Finished, TokenDelta
from protocols.wire import PROTOCOL_VERSION, Hello, ServerMessage, Welcome

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

    def hello(self, version: int = PROTOCOL_VERSION) -> Welcome:
        """Say Hello in protocol `version` (the newest by default); the server's Welcome."""
        self.send(Hello(protocol_version=version, client="raw-test"))
        welcome = self.read()
        assert isinstance(welcome, Welcome) and welcome.protocol_version == version, welcome
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
