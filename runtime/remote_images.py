"""Images named by URL in a prompt, fetched when `server.allow_remote_images` is set, before the
prompt is rendered (`prefetch`: each fetch in a thread of the fetches' own limiter, so a slow
image host never holds the threads that render prompts or feed the MLX thread).

Bounded: http(s) only; at most `max_bytes` read (a larger declared or actual body is refused);
all of a request's fetches, DNS, connects, redirects and bodies included, within
`server.remote_image_timeout_s` (a timer shuts the socket at the deadline, so a host dripping
bytes is cut off too); at most `MAX_REDIRECTS` redirects, each hop checked like the first; a 200
answer only. Hosts: a name is resolved once, every address it resolves to must be public
(or in `server.remote_image_allowed_networks`), and the connection goes to that checked
address (the Host header and TLS name stay the URL's), so DNS rebinding cannot move it. Any
failure is the request's typed error.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from policies import images as image_prompts
from protocols.config import LimitsConfig, ServerConfig
from protocols.errors import ConfigError, InvalidRequestError, MlxrtError, RequestTooLargeError

MAX_REDIRECTS = 3
_REDIRECTS = frozenset((301, 302, 303, 307, 308))
# A host of numbers ("2130706433", "0x7f.1", "0177.0.0.1") is read as `inet_aton` reads it, never looked up.
_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]*|\d+)(\.(0x[0-9a-f]*|\d+))*\.?", re.IGNORECASE)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class FetchSettings:
    timeout_s: float
    allowed_networks: tuple[Network, ...] = ()


def fetch_settings(server: ServerConfig) -> FetchSettings:
    """`server`'s remote-image settings, its allowed networks parsed. Raises `ConfigError`."""
    networks = []
    for entry in server.remote_image_allowed_networks:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigError(f"server.remote_image_allowed_networks: {entry!r} is not an IP address or network") from None
    return FetchSettings(server.remote_image_timeout_s, tuple(networks))


async def prefetch(messages: list[dict[str, Any]], limits: LimitsConfig, settings: FetchSettings, limiter: anyio.CapacityLimiter) -> image_prompts.Fetch:
    """The request's remote images fetched (each in a thread of `limiter`, all within
    `settings.timeout_s`), as the `fetch` that `policies.images` reads them with."""
    deadline = time.monotonic() + settings.timeout_s
    fetched: dict[str, bytes] = {}
    for url in dict.fromkeys(image_prompts.remote_urls(messages, limits)):
        fetch = functools.partial(fetch_image, url, limits.max_image_bytes, settings=settings, deadline=deadline)
        with anyio.move_on_after(deadline - time.monotonic() + 1.0):  # (the thread ends itself at the deadline: this bounds the wait for one)
            fetched[url] = await anyio.to_thread.run_sync(fetch, limiter=limiter, abandon_on_cancel=True)
        if url not in fetched:
            raise _late(url)
    return lambda url, _max_bytes: fetched[url]


def fetch_image(url: str, max_bytes: int, *, settings: FetchSettings, deadline: float | None = None) -> bytes:
    """The image at `url` (blocking), redirects followed. Raises `InvalidRequestError` /
    `RequestTooLargeError` (field "messages")."""
    deadline = deadline if deadline is not None else time.monotonic() + settings.timeout_s
    location = url
    for _ in range(MAX_REDIRECTS + 1):
        status, data, target = _get(location, max_bytes, settings, deadline)
        if status not in _REDIRECTS:
            break
        if not target:
            raise InvalidRequestError(f"the image at {_shown(location)} could not be fetched: HTTP {status} without a Location", field="messages")
        location = urllib.parse.urljoin(location, target)
    else:
        raise InvalidRequestError(f"the image at {_shown(url)} could not be fetched: more than {MAX_REDIRECTS} redirects", field="messages")
    if status != 200:
        raise InvalidRequestError(f"the image at {_shown(location)} could not be fetched: HTTP {status}", field="messages")
    return data


def _get(url: str, max_bytes: int, settings: FetchSettings, deadline: float) -> tuple[int, bytes, str]:
    """One GET: the status, the body (a 200's) and the Location (a redirect's)."""
    shown = _shown(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequestError(f"the image URL {shown} is not a valid URL", field="messages") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError(f"an image URL must be http(s)://host/... ({shown})", field="messages")
    addresses = _resolve(parts.hostname, port, settings, deadline, shown)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, port, timeout=max(0.001, deadline - time.monotonic()))
    # The socket goes to the checked addresses, never to a second lookup of the name.
    connection._create_connection = lambda _address, _timeout, _source=None: _connect(addresses, port, deadline)  # type: ignore[attr-defined]
    expired = threading.Event()
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), _expire, (connection, expired))
    timer.daemon = True
    timer.start()
    answer = None
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={"User-Agent": "mlxrt", "Accept": "image/*"})
        answer = connection.getresponse()
        if answer.status != 200:
            return answer.status, b"", answer.getheader("Location", "")
        declared = answer.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise RequestTooLargeError(f"the image at {shown} has more than {max_bytes} bytes (limits.max_image_bytes)", field="messages")
        data = _read(answer, max_bytes + 1, deadline)
    except MlxrtError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if expired.is_set() or time.monotonic() >= deadline:
            raise _late(url) from None
        raise InvalidRequestError(f"the image at {shown} could not be fetched: {type(exc).__name__}: {exc}", field="messages") from None
    finally:
        timer.cancel()
        if answer is not None:  # (closing the connection alone leaves the answer's file open)
            answer.close()
        connection.close()
    if expired.is_set():  # a body the deadline cut short is no image
        raise _late(url)
    if len(data) > max_bytes:
        raise RequestTooLargeError(f"the image at {shown} has more than {max_bytes} bytes (limits.max_image_bytes)", field="messages")
    return 200, data, ""


def _resolve(host: str, port: int, settings: FetchSettings, deadline: float, shown: str) -> list[Address]:
    """The addresses `host` names (an IP literal or numeric spelling without DNS), each
    checked; refused before any connection if one is not allowed."""
    try:
        addresses: list[Address] = [ipaddress.ip_address(host)]
    except ValueError:
        if _NUMERIC_HOST.fullmatch(host):
            try:
                addresses = [ipaddress.IPv4Address(socket.inet_aton(host))]
            except OSError:
                raise InvalidRequestError(f"the image URL {shown} names no valid address", field="messages") from None
        else:
            addresses = _lookup(host, port, deadline, shown)
    for address in addresses:
        if not is_allowed(address, settings.allowed_networks):
            raise InvalidRequestError(
                f"the image at {shown} is on {address}, not a public address (server.remote_image_allowed_networks lists those that may be fetched)",
                field="messages",
            )
    return addresses


def _lookup(host: str, port: int, deadline: float, shown: str) -> list[Address]:
    """`getaddrinfo` in a thread of its own, waited for until the deadline (it has no timeout)."""
    found: list[Any] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=lookup, name="mlxrt-image-dns", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not found:
        raise _late(shown)
    if isinstance(found[0], OSError) or not found[0]:
        raise InvalidRequestError(f"the image at {shown} could not be fetched: its host name does not resolve", field="messages")
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found[0]))


def is_allowed(address: Address, allowed_networks: tuple[Network, ...] = ()) -> bool:
    """Whether an image may be fetched from `address`: a public one, or one in `allowed_networks`."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in allowed_networks):
        return True
    special = (address.is_private, address.is_loopback, address.is_link_local, address.is_multicast, address.is_reserved, address.is_unspecified)
    if any(special) or not address.is_global:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        if address.is_site_local:
            return False
        # 6to4 reaches the IPv4 address inside (NAT64's 64:ff9b:: is in ::/8, reserved: refused above).
        if address.sixtofour is not None:
            return is_allowed(address.sixtofour, allowed_networks)
    return True


def _connect(addresses: list[Address], port: int, deadline: float) -> socket.socket:
    failure: OSError = OSError("no address to connect to")
    for address in addresses:
        try:
            return socket.create_connection((str(address), port), timeout=max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            failure = exc
    raise failure


def _expire(connection: http.client.HTTPConnection, expired: threading.Event) -> None:
    """At the deadline: shut the socket, so a read blocked on it returns at once."""
    expired.set()
    sock = connection.sock
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # (the plain socket's: a TLS socket's own drops its state)
        except OSError:
            pass


def _read(answer: http.client.HTTPResponse, limit: int, deadline: float) -> bytes:
    """Up to `limit` bytes, stopping at the deadline."""
    pieces, size = [], 0
    while size < limit:
        if time.monotonic() >= deadline:
            raise TimeoutError("the deadline passed")
        piece = answer.read(min(65536, limit - size))
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def _late(url: str) -> InvalidRequestError:
    return InvalidRequestError(f"the image at {_shown(url)} could not be fetched in time (server.remote_image_timeout_s)", field="messages")


def _shown(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
