"""How the proxy reaches one upstream origin: directly or through an egress proxy, over TLS
when the origin is https, and across every address its name has (happy eyeballs).

What the pool needs from here (pool.py): ``Egress.connect(protocol)``, the
request-target prefix (absolute-form through a proxy) and extra header lines.

- Which proxy: the upstream's ``proxy`` option when set (``""``: direct), else the
  environment as curl, urllib and httpx read it: ``HTTPS_PROXY`` for https origins,
  ``HTTP_PROXY`` for http ones, lowercase names before uppercase, ``NO_PROXY`` (host
  suffixes, ``host:port``, IP networks, ``*``) to go direct. Loopback upstreams
  (``localhost``, 127.0.0.0/8, ::1) never take the environment's proxy, as Go's
  ProxyFromEnvironment rules: a proxy's loopback is not ours, and a sidecar tool server
  must not break when the machine has a proxy set.
- https through a proxy: ``CONNECT host:port``, then TLS inside the tunnel, with the real
  host's SNI and certificate check (the proxy sees names, never content).
- http through a proxy: absolute-form request targets (RFC 9112 §3.2.2), the proxy's
  credentials in a ``Proxy-Authorization`` line on every request.
- A proxy that refuses CONNECT (403, 407, ...) raises ``ProxyRefused``, an OSError: the
  pool treats it as any failed connection, nothing reached the upstream.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
import socket
import ssl
from typing import Mapping
from urllib.parse import unquote, urlsplit
from urllib.request import proxy_bypass_environment

import aiohappyeyeballs

FROM_ENVIRONMENT = "env"  # [upstreams.X] proxy: read HTTP(S)_PROXY and NO_PROXY
# RFC 8305 §8's recommended Connection Attempt Delay (aiohttp's too): a blackholed first
# address costs this, not connect_timeout.
HAPPY_EYEBALLS_DELAY = 0.25
MAX_CONNECT_HEAD = 16 * 1024  # a proxy's answer to CONNECT; past it, not a proxy we understand


class ProxyRefused(ConnectionError):
    """The egress proxy would not open a tunnel (or answered nonsense): nothing reached the upstream."""


class ProxyURL:
    """An http:// egress proxy; its credentials become a Basic ``Proxy-Authorization``."""

    __slots__ = ("host", "port", "authorization")

    def __init__(self, url: str):
        if "://" not in url:
            url = "http://" + url  # "proxy:3128", as curl and urllib take it
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an egress proxy must be an http:// URL with a host, got {parts.scheme}://")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.authorization = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self.authorization = "Basic " + base64.b64encode(pair).decode()

    def __repr__(self) -> str:  # never the credentials: they are a secret like any other
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"ProxyURL('http://{'***@' if self.authorization else ''}{shown}:{self.port}')"


def environment_proxies(env: Mapping[str, str]) -> dict[str, str]:
    """``{"http": ..., "https": ..., "no": ...}`` as urllib's getproxies_environment reads
    them, from ``env`` rather than the process: a lowercase name wins over its uppercase
    twin, and a lowercase one set empty unsets it."""
    found: dict[str, str] = {}
    for lowercase_only in (False, True):
        for name, value in env.items():
            if not name.lower().endswith("_proxy") or (lowercase_only and name != name.lower()):
                continue
            scheme = name[:-6].lower()
            if value:
                found[scheme] = value
            elif lowercase_only:
                found.pop(scheme, None)
    return found


def bypasses(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``NO_PROXY`` sends ``host`` direct: urllib's rules (``*``, a name or any name
    under it, ``host:port``) and, as curl does, IP networks (``10.0.0.0/8``)."""
    if not no_proxy:
        return False
    if proxy_bypass_environment(f"{host}:{port}", {"no": no_proxy}):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        try:
            if address in ipaddress.ip_network(entry.strip().strip("[]"), strict=False):
                return True
        except ValueError:
            continue
    return False


def choose_proxy(url: str, option: str = FROM_ENVIRONMENT, env: Mapping[str, str] | None = None) -> ProxyURL | None:
    """The egress proxy for upstream ``url``: ``option`` when it names one, none when it is
    ``""``, else what the environment says for the URL's scheme and host."""
    if option != FROM_ENVIRONMENT:
        return ProxyURL(option) if option else None
    parts = urlsplit(url)
    proxies = environment_proxies(os.environ if env is None else env)
    chosen = proxies.get(parts.scheme)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if not chosen or _loopback(host) or bypasses(host, port, proxies.get("no", "")):
        return None
    try:
        return ProxyURL(chosen)
    except ValueError as exc:  # refused, not ignored: going direct could bypass a mandatory proxy
        raise ValueError(f"{parts.scheme.upper()}_PROXY: {exc}") from None


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(ca_file: str | None = None, client_cert: str | None = None,
                client_key: str | None = None) -> ssl.SSLContext:
    """Verification always on (the system's trust store, or only ``ca_file`` when given, as
    curl's --cacert); ``client_cert``/``client_key`` for servers that require mTLS."""
    context = ssl.create_default_context(cafile=ca_file)
    if client_cert:
        # an empty password: an encrypted key fails here instead of OpenSSL prompting on a tty
        context.load_cert_chain(client_cert, client_key or None, password=b"")
    return context


class Egress:
    """How connections to one origin are opened, and what that changes in each request."""

    def __init__(self, url: str, *, proxy: ProxyURL | None = None, tls: ssl.SSLContext | None = None):
        parts = urlsplit(url)
        self.host = parts.hostname or ""
        self.tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.proxy = proxy
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = f"{shown}:{self.port}"
        self.tunnel = proxy is not None and self.tls is not None
        forwarded = proxy is not None and self.tls is None
        # The request line's target starts with this (absolute-form for a forward proxy)
        self.target_prefix = f"http://{self.authority}" if forwarded else ""
        # Header lines each request carries besides the pool's own
        self.header_lines: tuple[str, ...] = ()
        if forwarded and proxy.authorization:
            self.header_lines = (f"Proxy-Authorization: {proxy.authorization}",)

    def __repr__(self) -> str:
        via = f" via {self.proxy!r}" if self.proxy else ""
        return f"Egress({'https' if self.tls else 'http'}://{self.authority}{via})"

    async def connect(self, protocol: asyncio.Protocol) -> None:
        """Open one connection and hand it to ``protocol`` (``connection_made``), TLS done.
        OSError (refused, DNS, TLS, a proxy's refusal) when nothing could reach the origin;
        the caller bounds the time (connect_timeout)."""
        loop = asyncio.get_running_loop()
        if self.proxy is None:
            sock = await _open_socket(loop, self.host, self.port)
            await _wrap(loop, sock, lambda: protocol, self.tls, self.host)
        elif not self.tunnel:
            sock = await _open_socket(loop, self.proxy.host, self.proxy.port)
            await _wrap(loop, sock, lambda: protocol, None, None)
        else:
            await self._through_tunnel(loop, protocol)

    async def _through_tunnel(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol) -> None:
        sock = await _open_socket(loop, self.proxy.host, self.proxy.port)
        tunnel = _Tunnel(loop.create_future())
        transport, _ = await _wrap(loop, sock, lambda: tunnel, None, None)
        try:
            lines = [f"CONNECT {self.authority} HTTP/1.1", f"Host: {self.authority}"]
            if self.proxy.authorization:
                lines.append(f"Proxy-Authorization: {self.proxy.authorization}")
            transport.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            status, reason = await tunnel.answer
            where = f"the egress proxy {self.proxy.host}:{self.proxy.port}"
            if not 200 <= status < 300:
                raise ProxyRefused(f"{where} refused CONNECT {self.authority}: {status} {reason}")
            if tunnel.extra:  # the origin speaks second in TLS: these bytes are the proxy's
                raise ProxyRefused(f"{where} sent bytes after its answer to CONNECT")
            tls_transport = await loop.start_tls(transport, protocol, self.tls, server_hostname=self.host)
        except BaseException:
            transport.abort()
            raise
        protocol.connection_made(tls_transport)  # start_tls leaves that to its caller


async def _open_socket(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected socket to one of ``host``'s addresses, tried as RFC 8305 says: the next one
    250 ms after the last, address families interleaved. aiohappyeyeballs, not
    create_connection(happy_eyeballs_delay=...): uvloop's create_connection has no such argument."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return await aiohappyeyeballs.start_connection(infos, happy_eyeballs_delay=HAPPY_EYEBALLS_DELAY,
                                                   interleave=1, loop=loop)


async def _wrap(loop: asyncio.AbstractEventLoop, sock: socket.socket, factory, tls: ssl.SSLContext | None,
                server_hostname: str | None):
    try:
        return await loop.create_connection(factory, sock=sock, ssl=tls,
                                            server_hostname=server_hostname if tls else None)
    except BaseException:
        sock.close()
        raise


class _Tunnel(asyncio.Protocol):
    """Reads an egress proxy's answer to CONNECT: its status, then it steps aside for TLS."""

    def __init__(self, answer: asyncio.Future):
        self.answer = answer  # (status, reason)
        self.buffer = b""
        self.extra = b""  # anything after the answer's head

    def data_received(self, data: bytes) -> None:
        if self.answer.done():
            self.extra += data
            return
        self.buffer += data
        head, found, rest = self.buffer.partition(b"\r\n\r\n")
        if not found:
            if len(self.buffer) > MAX_CONNECT_HEAD:
                self.answer.set_exception(ProxyRefused("the egress proxy's answer to CONNECT is too long"))
            return
        self.extra = rest
        version, _, status_reason = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        status, _, reason = status_reason.partition(" ")
        if not version.startswith("HTTP/1.") or not status.isdigit():
            self.answer.set_exception(ProxyRefused(f"the egress proxy answered CONNECT with {head[:80]!r}"))
        else:
            self.answer.set_result((int(status), reason))

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.answer.done():
            self.answer.set_exception(ProxyRefused(f"the egress proxy closed the connection before "
                                                   f"answering CONNECT: {exc or 'EOF'}"))
