"""Talking to upstreams: their connection pools, header hygiene, and failure classification."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging

from typing import Callable
from urllib.parse import urlsplit

from multidict import CIMultiDictProxy

from .config import UpstreamSettings, keepalive_timeout
from .forwarded import FORWARDING
from .upstream.egress import FROM_ENVIRONMENT, Egress, choose_proxy, tls_context
from .upstream.errors import NotSent, UpstreamTimeout
from .upstream.pool import UpstreamPool

log = logging.getLogger("idemproxy.proxy")

# RFC 9110 §7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "te", "trailer",
                        "transfer-encoding", "upgrade", "proxy-authenticate", "proxy-authorization"})
# Recomputed for the next hop, or ours.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
OUR_HEADERS = ("idem-run", "idem-run-token", "idem-epoch", "idem-policy", "idem-replay", "idem-process")
NEVER_STORED = frozenset({"set-cookie", "set-cookie2", "content-length", "date"})


def _dropped(headers: CIMultiDictProxy[str], always: frozenset[str]) -> frozenset[str]:
    """``always``, plus the headers this message's ``Connection`` names as hop-by-hop."""
    values = headers.getall("Connection", ())
    if not values:
        return always
    return always | _connection_tokens(tuple(values))


@functools.lru_cache(maxsize=64)
def _connection_tokens(values: tuple[str, ...]) -> frozenset[str]:
    """Header names a ``Connection`` field lists. Nearly every upstream answer says
    ``keep-alive``: parsed once, not once per answer."""
    return frozenset(t.strip().lower() for value in values for t in value.split(","))


@functools.lru_cache(maxsize=8)
def _not_forwarded(tenant_header: str) -> frozenset[str]:
    return NOT_FORWARDED | FORWARDING | {tenant_header.lower(), *OUR_HEADERS}


def request_headers(incoming: CIMultiDictProxy[str], upstream: UpstreamSettings,
                    tenant_header: str, forwarded_key: str | None,
                    forwarding: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """What the upstream sees: the agent's headers minus hop-by-hop and ours, then
    ``forwarding`` (X-Forwarded-For and friends, worked out in forwarded.py), then config."""
    drop = _dropped(incoming, _not_forwarded(tenant_header))
    if not upstream.set_headers and not (upstream.idempotency_header and forwarded_key):
        return [(k, v) for k, v in incoming.items() if k.lower() not in drop] + forwarding
    added = [(name, str(value)) for name, value in upstream.set_headers.items()]
    if upstream.idempotency_header and forwarded_key:
        added.append((upstream.idempotency_header, forwarded_key))
    if added:  # configured headers replace the agent's, and ours
        configured = {name.lower() for name, _ in added}
        drop = drop | configured
        forwarding = [(k, v) for k, v in forwarding if k.lower() not in configured]
    return [(k, v) for k, v in incoming.items() if k.lower() not in drop] + forwarding + added


def response_headers(incoming: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """What the agent sees of the upstream's answer."""
    drop = _dropped(incoming, NOT_FORWARDED)
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


def make_pool(upstream: UpstreamSettings, on_request: Callable[[list], list] | None = None) -> UpstreamPool:
    """The upstream's connections; ``on_request`` sees every request's headers (tracing)."""
    return UpstreamPool(upstream.url, max_connections=upstream.max_connections,
                        connect_timeout=upstream.connect_timeout, read_timeout=upstream.read_timeout,
                        on_request=on_request, keepalive_timeout=keepalive_timeout(upstream),
                        max_head_bytes=upstream.max_head_bytes, max_head_fields=upstream.max_head_fields,
                        egress=make_egress(upstream))


def make_egress(upstream: UpstreamSettings) -> Egress:
    """How the upstream is reached: its ``proxy`` option or the process environment's
    HTTP(S)_PROXY and NO_PROXY, read once here; its TLS files (proxy/upstream/egress.py)."""
    https = urlsplit(upstream.url).scheme == "https"
    tls = tls_context(upstream.ca_file, upstream.client_cert, upstream.client_key) if https else None
    egress = Egress(upstream.url, proxy=choose_proxy(upstream.url, upstream.proxy), tls=tls)
    if egress.proxy is not None:  # which proxy, once: "why can't I reach it" starts here (masked)
        log.info("upstream %s goes through the egress proxy %r (%s)", upstream.name, egress.proxy,
                 "the environment" if upstream.proxy == FROM_ENVIRONMENT else "its proxy option")
    return egress


def never_sent(exc: BaseException) -> bool:
    """True when the request failed before a byte of it was written, so the upstream cannot
    have acted: no connection (refused, DNS, TLS), or none within ``connect_timeout`` (a full
    listen backlog, or a pool whose connections all stayed busy). Anything later (a read
    timeout, a broken connection) is "sent, outcome unknown"."""
    return isinstance(exc, NotSent)


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.TimeoutError, UpstreamTimeout))


def failure_slug(exc: BaseException) -> str:
    """The problem type of a failed exchange with an upstream."""
    return "upstream-timeout" if is_timeout(exc) else "upstream-unavailable"
