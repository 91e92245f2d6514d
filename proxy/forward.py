"""Talking to upstreams: pooled sessions, header hygiene, and failure classification."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

from .config import UpstreamSettings

# RFC 9110 §7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "te", "trailer",
                        "transfer-encoding", "upgrade", "proxy-authenticate", "proxy-authorization"})
# Recomputed for the next hop, or ours.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
OUR_HEADERS = ("idem-run", "idem-epoch", "idem-policy", "idem-replay")
NEVER_STORED = frozenset({"set-cookie", "set-cookie2", "content-length", "date"})


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    tokens = set()
    for value in headers.getall("Connection", ()):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def request_headers(incoming: CIMultiDictProxy[str], upstream: UpstreamSettings,
                    tenant_header: str, forwarded_key: str | None) -> CIMultiDict[str]:
    """What the upstream sees: the agent's headers minus hop-by-hop and ours, plus config."""
    drop = NOT_FORWARDED | _connection_tokens(incoming) | {tenant_header.lower(), *OUR_HEADERS}
    out = CIMultiDict((k, v) for k, v in incoming.items() if k.lower() not in drop)
    for name, value in upstream.set_headers.items():
        out[name] = str(value)
    if upstream.idempotency_header and forwarded_key:
        out[upstream.idempotency_header] = forwarded_key
    return out


def response_headers(incoming: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """What the agent sees of the upstream's answer."""
    drop = NOT_FORWARDED | _connection_tokens(incoming)
    return [(k, v) for k, v in incoming.items() if k.lower() not in drop]


def storable_headers(headers: list[tuple[str, str]], upstream: UpstreamSettings) -> list[tuple[str, str]]:
    """Response headers as kept in the journal: no cookies, no configured secrets."""
    redact = NEVER_STORED | {h.lower() for h in upstream.redact_headers}
    return [(k, v) for k, v in headers if k.lower() not in redact]


def forwarded_key(kid: str) -> str:
    """The key we send a provider that deduplicates too: stable per journal entry."""
    return "idem-" + hashlib.sha256(b"upstream-key\0" + kid.encode()).hexdigest()[:40]


def is_stream(headers: CIMultiDictProxy[str]) -> bool:
    """A body we pass chunk by chunk: SSE, or no length announced."""
    ctype = headers.get("Content-Type", "")
    return ctype.startswith("text/event-stream") or "Content-Length" not in headers


def make_session(upstream: UpstreamSettings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=upstream.max_connections, limit_per_host=0,
                                     keepalive_timeout=30, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, connect=upstream.connect_timeout,
                                    sock_read=upstream.read_timeout)
    # auto_decompress=False: bytes pass, and are recorded, exactly as the upstream sent them.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                                 cookie_jar=aiohttp.DummyCookieJar())


def never_sent(exc: BaseException) -> bool:
    """True when the request cannot have reached the upstream (so nothing happened)."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.InvalidURL))


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError))
