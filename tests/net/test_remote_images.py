"""runtime.remote_images: a remote image is fetched only from a public address (or one the config
allows), checked on the address actually connected to, before any connection; redirects are
followed up to three hops, each checked; DNS, a dripping host and a slow one are cut off at the
deadline; and a slow image host never stalls other requests.

Only loopback is ever connected to: `guard` fails the test on any other connection attempt and
on any DNS lookup (names are given by patching `getaddrinfo`)."""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import socket
import threading
import time

import anyio
import msgspec
import pytest

from protocols import GenerateRequest, SamplingParams
from protocols.errors import InvalidRequestError
from runtime import Runtime
from runtime.remote_images import FetchSettings, fetch_image, is_allowed
from tests.support.config import make_config
from tests.support.events import collect
from tests.support.vision import VISION_MODEL, image_message, png

IMAGE = png(3)
LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)
MAX_BYTES = 1 << 20


class Guard:
    def __init__(self) -> None:
        self.connects: list[tuple] = []
        self.lookups: list[str] = []
        self.names: dict[str, list[str]] = {}


@pytest.fixture
def guard(monkeypatch) -> Guard:
    """Connections only to loopback (others recorded and refused), and no DNS: a name resolves
    only to what `guard.names` says."""
    guarded = Guard()
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        guarded.connects.append(address)
        if address[0] not in ("127.0.0.1", "::1"):
            raise AssertionError(f"a connection to {address} was attempted")
        return real_connect(self, address)

    def getaddrinfo(host, port, *args, **kwargs):
        try:
            ipaddress.ip_address(host)
        except ValueError:
            guarded.lookups.append(host)
            if host not in guarded.names:
                raise AssertionError(f"a DNS lookup of {host!r} was attempted") from None
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in guarded.names[host]]
        return real_getaddrinfo(host, port, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return guarded


class Host:
    """A loopback HTTP server: `routes[path] = (status, headers, body)`, `drip` paths answered a
    byte at a time, `hold` paths answered once `release` is set; it records the Host headers."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {"/cat.png": (200, {}, IMAGE)}
        self.drip: dict[str, float] = {}
        self.hold: set[str] = set()
        self.release = threading.Event()
        self.hosts: list[str] = []
        self.finished: list[str] = []
        self.url = ""


@contextlib.contextmanager
def image_host():
    host = Host()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            host.hosts.append(self.headers.get("Host", ""))
            if self.path in host.hold:
                host.release.wait(30)
            status, headers, body = host.routes.get(self.path, (404, {}, b""))
            head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
            with contextlib.suppress(OSError):
                if self.path in host.drip:
                    for byte in head.encode() + body:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(host.drip[self.path])
                else:
                    self.wfile.write(head.encode() + body)
                host.finished.append(self.path)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield host
    finally:
        host.release.set()
        server.shutdown()
        server.server_close()


def fetch(url: str, *, timeout_s: float = 5.0, allowed=()) -> bytes:
    return fetch_image(url, MAX_BYTES, settings=FetchSettings(timeout_s, tuple(allowed)))


REFUSED = [
    "http://127.0.0.1/a.png",
    "http://127.0.0.2:8080/a.png",
    "http://localhost/a.png",
    "http://[::1]/a.png",
    "http://0.0.0.0/a.png",
    "http://0/a.png",
    "http://[::]/a.png",
    "http://10.1.2.3/a.png",
    "https://10.1.2.3/a.png",
    "http://172.16.0.1/a.png",
    "http://172.31.255.254/a.png",
    "http://192.168.1.1/a.png",
    "http://169.254.169.254/latest/meta-data",
    "http://100.64.0.1/a.png",
    "http://224.0.0.1/a.png",
    "http://239.255.255.250/a.png",
    "http://240.0.0.1/a.png",
    "http://255.255.255.255/a.png",
    "http://[fe80::1]/a.png",
    "http://[fc00::1]/a.png",
    "http://[fd12:3456::1]/a.png",
    "http://[ff02::1]/a.png",
    "http://[fec0::1]/a.png",
    "http://[::ffff:127.0.0.1]/a.png",
    "http://[::ffff:169.254.169.254]/a.png",
    "http://[::ffff:a00:1]/a.png",
    "http://[2002:7f00:1::1]/a.png",
    "http://[2002:a9fe:a9fe::1]/a.png",
    "http://[64:ff9b::7f00:1]/a.png",
    "http://[64:ff9b::a9fe:a9fe]/a.png",
    "http://2130706433/a.png",
    "http://0x7f.1/a.png",
    "http://0177.0.0.1/a.png",
    "http://127.1/a.png",
    "http://0x7f000001/a.png",
    "http://017700000001/a.png",
    "http://0xa9.0xfe.0xa9.0xfe/a.png",
]


@pytest.mark.parametrize("url", REFUSED)
def test_non_public_addresses_are_refused_before_any_connection(url, guard):
    guard.names["localhost"] = ["127.0.0.1", "::1"]
    with pytest.raises(InvalidRequestError, match=r"not a public address.*remote_image_allowed_networks") as refused:
        fetch(url)
    assert refused.value.field == "messages"
    assert guard.connects == []


def test_public_addresses_pass_and_allowed_networks_open_private_ones():
    for public in ("93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "2002:5db8:d822::1"):
        assert is_allowed(ipaddress.ip_address(public)), public
    private = (ipaddress.ip_network("10.0.0.0/8"),)
    assert is_allowed(ipaddress.ip_address("10.9.8.7"), private) and is_allowed(ipaddress.ip_address("::ffff:10.9.8.7"), private)
    assert not is_allowed(ipaddress.ip_address("192.168.0.1"), private)


def test_a_name_is_resolved_once_and_the_checked_address_is_the_one_connected_to(guard):
    with image_host() as host:
        port = int(host.url.rsplit(":", 1)[1])
        guard.names["images.test"] = ["127.0.0.1"]
        assert fetch(f"http://images.test:{port}/cat.png", allowed=LOOPBACK) == IMAGE
        assert guard.lookups == ["images.test"] and guard.connects == [("127.0.0.1", port)]
        assert host.hosts == [f"images.test:{port}"]  # (the Host header keeps the URL's name)
        # A name with one address outside the allowed ones is refused, whichever comes first.
        guard.names["rebound.test"] = ["127.0.0.1", "10.0.0.1"]
        with pytest.raises(InvalidRequestError, match=r"10\.0\.0\.1, not a public address"):
            fetch(f"http://rebound.test:{port}/cat.png", allowed=LOOPBACK)
        assert len(guard.connects) == 1
        # Loopback itself is refused unless allowed.
        with pytest.raises(InvalidRequestError, match="not a public address"):
            fetch(f"{host.url}/cat.png")
        assert len(guard.connects) == 1


def test_redirects_are_followed_three_hops_each_checked(guard):
    with image_host() as host:
        host.routes["/one"] = (302, {"Location": "/two"}, b"")
        host.routes["/two"] = (301, {"Location": f"{host.url}/three"}, b"")
        host.routes["/three"] = (307, {"Location": "cat.png"}, b"")
        assert fetch(f"{host.url}/one", allowed=LOOPBACK) == IMAGE
        host.routes["/zero"] = (308, {"Location": "/one"}, b"")
        with pytest.raises(InvalidRequestError, match="more than 3 redirects"):
            fetch(f"{host.url}/zero", allowed=LOOPBACK)
        host.routes["/away"] = (302, {"Location": "http://169.254.169.254/latest/meta-data"}, b"")
        host.routes["/file"] = (302, {"Location": "file:///etc/passwd"}, b"")
        before = len(guard.connects)
        with pytest.raises(InvalidRequestError, match=r"169\.254\.169\.254, not a public address"):
            fetch(f"{host.url}/away", allowed=LOOPBACK)
        with pytest.raises(InvalidRequestError, match="must be http"):
            fetch(f"{host.url}/file", allowed=LOOPBACK)
        assert guard.connects[before:] == [guard.connects[0]] * 2  # only the loopback host was connected to


def test_a_dripping_host_and_a_slow_lookup_are_cut_off_at_the_deadline(guard, monkeypatch):
    with image_host() as host:
        host.routes["/head.png"] = host.routes["/body.png"] = (200, {}, IMAGE)
        host.drip["/head.png"] = 0.1  # a byte every 0.1 s: every read returns well within any socket timeout
        host.drip["/body.png"] = 0.01
        for path in ("/head.png", "/body.png"):
            with pytest.raises(InvalidRequestError, match=r"in time \(server\.remote_image_timeout_s\)"):
                fetch(f"{host.url}{path}", timeout_s=1.0, allowed=LOOPBACK)
        assert host.finished == []  # (cut off mid-answer)
    answered = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answered.wait(30) and [])
    with pytest.raises(InvalidRequestError, match="in time"):
        fetch("http://slow-dns.test/cat.png", timeout_s=0.5)
    assert not answered.is_set()
    answered.set()


@pytest.mark.parametrize("url", ["ftp://example.test/a.png", "http:///a.png", "http://[::1/a.png", "http://127.0.0.1:99999/a.png", "http://1.2.3.4.5/a.png"])
def test_bad_urls_are_typed_refusals_without_a_connection(url, guard):
    with pytest.raises(InvalidRequestError):
        fetch(url)
    assert guard.connects == []


@pytest.mark.server
async def test_a_slow_remote_image_does_not_stall_other_requests():
    config = make_config(VISION_MODEL)
    server = msgspec.structs.replace(config.server, allow_remote_images=True, remote_image_allowed_networks=["127.0.0.1"], remote_image_timeout_s=60.0)
    with image_host() as host:
        host.hold.add("/held.png")
        async with Runtime.open(msgspec.structs.replace(config, server=server)) as rt:
            # Few threads for the whole process (the default is 40): the held fetches would take them all.
            anyio.to_thread.current_default_thread_limiter().total_tokens = 3
            held: list[BaseException | None] = []

            async def ask_held() -> None:
                try:
                    await collect(rt.generate(GenerateRequest(messages=image_message(f"{host.url}/held.png"), max_tokens=2)))
                    held.append(None)
                except InvalidRequestError as exc:
                    held.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(ask_held)
                with anyio.fail_after(30):
                    while len(host.hosts) < 3:  # all three fetches are waiting on the host
                        await anyio.sleep(0.02)
                text = await collect(rt.generate(GenerateRequest(prompt="Hello", max_tokens=3, sampling=SamplingParams(temperature=0))))
                image = await collect(rt.generate(GenerateRequest(messages=image_message(png(4)), max_tokens=3)))
                assert held == []  # both finished while the held fetches were still waiting
                host.release.set()
        assert len(text.tokens) == 3 and len(image.tokens) == 3
        assert len(held) == 3 and all(isinstance(exc, InvalidRequestError) and "HTTP 404" in str(exc) for exc in held)


def test_allowed_networks_are_checked_when_the_config_is_read():
    from protocols.errors import ConfigError
    from runtime.config import RuntimeConfig
    from runtime.remote_images import fetch_settings

    toml = '[model]\npath = "builtin:tiny"\n[server]\nremote_image_allowed_networks = [{}]\n'
    assert fetch_settings(RuntimeConfig.from_toml(toml.format('"10.0.0.0/8", "::1"')).server).allowed_networks == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("::1"),
    )
    for bad in ('"localhost"', '"*"', '"10.0.0.0/8 "'):
        with pytest.raises(ConfigError, match="remote_image_allowed_networks"):
            RuntimeConfig.from_toml(toml.format(bad))
    with pytest.raises(ConfigError, match="not an IP address or network"):
        fetch_settings(RuntimeConfig.from_toml(toml.format('"999.1.1.1"')).server)


def test_https_goes_to_the_checked_address_too(guard):
    with image_host() as host:  # (a plain HTTP host: the TLS handshake fails, as a typed error)
        with pytest.raises(InvalidRequestError, match="could not be fetched"):
            fetch(host.url.replace("http://", "https://") + "/cat.png", allowed=LOOPBACK)
        assert guard.connects == [("127.0.0.1", int(host.url.rsplit(":", 1)[1]))]
