"""A distributed world's control connections, authenticated (no MLX here).

A control connection counts as a rank only once it proves the world's shared secret
(`MLXRT_DISTRIBUTED_SECRET`, passed in by the caller): rank 0 sends a random nonce, the follower
answers with its rank, a nonce of its own and an HMAC-SHA256 of both nonces and the rank, and
rank 0 answers with its own HMAC, so neither side trusts a local stranger that connected or
listened first. `Gate` is rank 0's side (every connection challenged at once, side by side),
`reach_leader` a follower's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Container, Iterable

import structlog

from protocols.config import WORLD_SECRET_VARIABLE
from protocols.errors import ConfigError

log = structlog.get_logger(actor="world")

# A control connection answers rank 0's challenge within this, or is closed.
HANDSHAKE_S = 5.0
# Shorter secrets are refused: `mlxrt launch` makes 64 hex digits.
MIN_SECRET_CHARS = 16
_NONCE_BYTES = 32
_TAG_BYTES = 32  # HMAC-SHA256
_RANK = struct.Struct("!I")
_ANSWER_BYTES = _RANK.size + _NONCE_BYTES + _TAG_BYTES
# Connections mid-handshake at once; past this the oldest is closed (a real follower answers
# within a round trip, so a flood of strangers cannot crowd it out).
_PENDING_MAX = 64


def check_secret(address: str, secret: str) -> None:
    """Refuse (`ConfigError`) a world with a control address but no usable secret: its control
    connections would otherwise be open to any local process."""
    if len(secret) >= MIN_SECRET_CHARS:
        return
    found = f"a {len(secret)}-character {WORLD_SECRET_VARIABLE}" if secret else f"no {WORLD_SECRET_VARIABLE}"
    raise ConfigError(
        f"`distributed.control = {address!r}` but {found}: the control connections need a shared secret of at least {MIN_SECRET_CHARS} characters."
        f" `mlxrt launch` sets one; with mlx.launch set the same random value on every rank"
        f" (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`), or set `distributed.control = \"\"`"
    )


class HandshakeError(Exception):
    """A control connection that did not prove the world's secret (it is closed, never a rank)."""


def _tag(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    # The role keeps a follower's proof from serving as rank 0's (and the other way round);
    # every part has a fixed length, so their concatenation is unambiguous.
    return hmac.new(secret, b"mlxrt-world-control/" + role + b"\0" + b"".join(parts), hashlib.sha256).digest()


def check_answer(secret: bytes, nonce: bytes, answer: bytes, expected: Container[int]) -> tuple[int, bytes]:
    """Rank 0's check of a follower's answer to `nonce`: the rank it proves, and rank 0's proof
    to send back. Raises `HandshakeError` for a wrong proof, or a rank not in `expected`."""
    if len(answer) != _ANSWER_BYTES:
        raise HandshakeError(f"an answer of {len(answer)} bytes, not {_ANSWER_BYTES}")
    rank_bytes, theirs, tag = answer[: _RANK.size], answer[_RANK.size : -_TAG_BYTES], answer[-_TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, b"follower", nonce, rank_bytes, theirs)):
        raise HandshakeError("wrong proof of the world's secret")
    (rank,) = _RANK.unpack(rank_bytes)
    if rank not in expected:
        raise HandshakeError(f"rank {rank} is not a rank still expected (out of range, or already connected)")
    return rank, _tag(secret, b"leader", theirs, rank_bytes, nonce)


def answer_challenge(conn: socket.socket, secret: bytes, rank: int) -> None:
    """A follower's side, on a fresh connection to rank 0 (its timeout bounds each read): prove
    the secret and this rank, then check rank 0 proves it too (no stranger listening first)."""
    nonce = _receive(conn, _NONCE_BYTES)
    ours = secrets.token_bytes(_NONCE_BYTES)
    rank_bytes = _RANK.pack(rank)
    conn.sendall(rank_bytes + ours + _tag(secret, b"follower", nonce, rank_bytes, ours))
    proof = _receive(conn, _TAG_BYTES)
    if not hmac.compare_digest(proof, _tag(secret, b"leader", ours, rank_bytes, nonce)):
        raise HandshakeError("the listener did not prove the world's secret: not rank 0")


def _receive(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = conn.recv(n - len(data))
        except TimeoutError:
            raise HandshakeError("no answer in time") from None
        if not chunk:
            raise HandshakeError("closed by the peer (refused: is the secret the same on every rank?)")
        data += chunk
    return bytes(data)


def reach_leader(address: str, secret: bytes, rank: int, deadline: float) -> socket.socket:
    """A follower's control connection, retried until rank 0 listens and the handshake passes
    (both ways), or `deadline` passes (`ConfigError`)."""
    host, _, port = address.rpartition(":")
    while True:
        pause = 0.05
        try:
            conn = socket.create_connection((host, int(port)), timeout=HANDSHAKE_S)
        except OSError as exc:
            problem = f"cannot reach rank 0 ({exc})"
        else:
            try:
                answer_challenge(conn, secret, rank)
                conn.settimeout(None)
                return conn
            except (HandshakeError, OSError) as exc:
                conn.close()
                problem, pause = f"the handshake with rank 0 failed ({exc})", 0.5
                log.warning("control_handshake_failed", rank=rank, reason=str(exc))
        if time.monotonic() > deadline:
            raise ConfigError(f"`distributed.control = {address!r}`: rank {rank}: {problem}")
        time.sleep(pause)


class _Pending:
    """A connection rank 0 has challenged, and the part of its answer read so far."""

    def __init__(self, conn: socket.socket, peer: str, deadline: float):
        self.conn = conn
        self.peer = peer
        self.deadline = deadline
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self.answer = bytearray()


class Gate:
    """Rank 0's side of the handshake: every connection to the control port is challenged at
    once and answered side by side (a silent one delays no one); it becomes a rank only once it
    proves the secret and names a rank still expected. Any other is closed, with a warning."""

    def __init__(self, server: socket.socket, secret: bytes, ranks: Iterable[int], handshake_s: float):
        self.server = server
        self.secret = secret
        self.waiting = set(ranks)
        self.handshake_s = handshake_s
        self.joined: dict[int, socket.socket] = {}
        self.pending: dict[socket.socket, _Pending] = {}
        self.refused = 0
        self.selector = selectors.DefaultSelector()

    def run(self, deadline: float) -> dict[int, socket.socket]:
        """Every expected rank's connection, by rank; `TimeoutError` at `deadline`."""
        self.server.setblocking(False)
        self.selector.register(self.server, selectors.EVENT_READ)
        try:
            while self.waiting:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError
                for late in [p for p in self.pending.values() if p.deadline <= now]:
                    self._refuse(late, f"no answer within {self.handshake_s:g} s")
                wait = min([deadline, *(p.deadline for p in self.pending.values())]) - now
                for key, _ in self.selector.select(max(wait, 0.0)):
                    if key.data is None:
                        self._challenge(now)
                    elif key.fileobj in self.pending:
                        self._read(key.data)
            return dict(sorted(self.joined.items()))
        except BaseException:
            for conn in self.joined.values():
                conn.close()
            raise
        finally:
            for pending in self.pending.values():  # still unproven when the gate closed
                pending.conn.close()
                self._warn(pending.peer, "no answer before the gate closed")
            self.selector.close()

    def _challenge(self, now: float) -> None:
        try:
            conn, address = self.server.accept()
        except OSError:  # (gone again before it was accepted)
            return
        if len(self.pending) >= _PENDING_MAX:
            self._refuse(next(iter(self.pending.values())), "too many connections mid-handshake")
        pending = _Pending(conn, f"{address[0]}:{address[1]}", now + self.handshake_s)
        try:
            conn.settimeout(self.handshake_s)
            conn.sendall(pending.nonce)
        except OSError as exc:
            conn.close()
            self._warn(pending.peer, f"cannot send the challenge ({exc})")
            return
        self.pending[conn] = pending
        self.selector.register(conn, selectors.EVENT_READ, pending)

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.conn.recv(_ANSWER_BYTES - len(pending.answer))
        except OSError as exc:
            chunk, problem = b"", f"connection error ({exc})"
        else:
            problem = "closed before answering"
        if not chunk:
            self._refuse(pending, problem)
            return
        pending.answer += chunk
        if len(pending.answer) == _ANSWER_BYTES:
            try:
                rank, proof = check_answer(self.secret, pending.nonce, bytes(pending.answer), self.waiting)
            except HandshakeError as exc:
                self._refuse(pending, str(exc))
            else:
                self._admit(pending, rank, proof)

    def _admit(self, pending: _Pending, rank: int, proof: bytes) -> None:
        self._forget(pending)
        try:
            pending.conn.sendall(proof)
        except OSError as exc:  # the follower left; it connects again
            pending.conn.close()
            self._warn(pending.peer, f"rank {rank} left before rank 0's proof ({exc})")
            return
        pending.conn.settimeout(None)
        pending.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.waiting.discard(rank)
        self.joined[rank] = pending.conn

    def _forget(self, pending: _Pending) -> None:
        self.selector.unregister(pending.conn)
        del self.pending[pending.conn]

    def _refuse(self, pending: _Pending, reason: str) -> None:
        self._forget(pending)
        pending.conn.close()
        self._warn(pending.peer, reason)

    def _warn(self, peer: str, reason: str) -> None:
        self.refused += 1
        log.warning("control_refused", peer=peer, reason=reason)
