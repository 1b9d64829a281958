"""Images named by URL in a prompt, fetched when `server.allow_remote_images` is set (blocking;
run in the worker thread that renders the prompt). Bounded: at most `max_bytes` read (a larger
declared or actual body is refused), `timeout_s` for the connection and for the whole read,
http(s) only, a 200 answer only. Any failure is the request's typed error."""

from __future__ import annotations

import functools
import http.client
import time
import urllib.parse

from protocols.errors import InvalidRequestError, RequestTooLargeError


def fetcher(timeout_s: float):
    """`fetch(url, max_bytes)` for `policies.images`."""
    return functools.partial(fetch_image, timeout_s=timeout_s)


def fetch_image(url: str, max_bytes: int, *, timeout_s: float) -> bytes:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError("an image URL must be http(s)://host/...", field="messages")
    shown = url if len(url) <= 120 else url[:117] + "..."
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    answer = None
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"User-Agent": "mlxrt", "Accept": "image/*"})
        answer = connection.getresponse()
        if answer.status != 200:  # (redirects are not followed)
            raise InvalidRequestError(f"the image at {shown} could not be fetched: HTTP {answer.status}", field="messages")
        declared = answer.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise RequestTooLargeError(f"the image at {shown} has more than {max_bytes} bytes (limits.max_image_bytes)", field="messages")
        data = _read(answer, max_bytes + 1, time.monotonic() + timeout_s, shown)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise InvalidRequestError(f"the image at {shown} could not be fetched: {type(exc).__name__}: {exc}", field="messages") from None
    finally:
        if answer is not None:  # (closing the connection alone leaves the answer's file open)
            answer.close()
        connection.close()
    if len(data) > max_bytes:
        raise RequestTooLargeError(f"the image at {shown} has more than {max_bytes} bytes (limits.max_image_bytes)", field="messages")
    return data


def _read(answer, limit: int, deadline: float, shown: str) -> bytes:
    """Up to `limit` bytes, the whole read within the deadline (a server dripping bytes slower
    than the socket timeout is cut off too)."""
    pieces, size = [], 0
    while size < limit:
        if time.monotonic() > deadline:
            raise InvalidRequestError(f"the image at {shown} did not arrive in time (server.remote_image_timeout_s)", field="messages")
        piece = answer.read(min(65536, limit - size))
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)
