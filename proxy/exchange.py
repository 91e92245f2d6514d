"""One proxied request as the proxy learns it, under one request key (``EXCHANGE``).

The handler makes it first thing; each step of the request path fills in what it learns
(the route, who the caller is and, once needed, whose tenant; the body; the call's facts)
and what the proxy did (its outcome, the upstream's time, the answer under way). Everything
that looks at a proxied request afterwards reads it here: the error boundary (errors.py)
and its metrics, the access log and the trace span (observability/). A request the proxy
handler never took has none, unless the error boundary refused it with an outcome
(``started`` is then None: metrics count only what the handler took).

Invariant: ``stream`` is set once an answer's head is sent; from then on a failure can only
cut that answer short (replay.cut_short), never answer anew.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from aiohttp import web

from .identity import Identity
from .observability.facts import Facts
from .outcomes import Outcome
from .problems import Problem
from .routing import Route
from .upstream.connection import UpstreamResponse


class Readdress(Protocol):
    """Addresses an answer recorded for one caller to another (proxy/mcp/readdress.py: the
    caller's JSON-RPC id); replays and joins go through it."""

    def body(self, data: bytes) -> bytes: ...
    def chunk(self, data: bytes) -> bytes: ...  # may keep back an unfinished event
    def end(self) -> bytes: ...


class Refusable(Protocol):
    """A run's call, told when the proxy refuses it (proxy/runs/refusals.py)."""

    async def refused(self, problem: Problem) -> None: ...


@dataclass(slots=True, eq=False)
class Exchange:
    started: float | None  # time.perf_counter() when the proxy handler took it
    outcome: Outcome = Outcome.REJECTED  # what the proxy did: metrics and the access log
    route: Route | None = None
    ident: Identity | None = None
    tenant: str | None = None  # whose entries and connections: resolved once, when first needed
    body: bytes = b""  # as received: what is forwarded
    content: bytes = b""  # decoded per its Content-Encoding: what is fingerprinted
    facts: Facts | None = None  # for the log line and span, once the upstream is known
    upstream_s: float | None = None  # the upstream's time to its answer's head, when forwarded
    stream: web.StreamResponse | None = None  # the answer, once its head is sent
    relaying: UpstreamResponse | None = None  # a passthrough's answer, closed if the client leaves
    run_call: Refusable | None = None  # the run a refusal is counted on
    readdress: Readdress | None = None  # an MCP caller's address for replays and joins
    render_problem: Callable[[dict], bytes] | None = None  # a refusal's body for a non-HTTP client (MCP)
    tool: str | None = None  # the tool an MCP tools/call names, for its journal entry's path


EXCHANGE = web.RequestKey("exchange", Exchange)
