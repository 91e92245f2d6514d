"""The MCP side of the request path (docs/mcp.md): what to do with one request to a
``kind = "mcp"`` upstream, and what follows once it is answered.

``proxy/request_path/handler.py`` (``Proxy._mcp``) drives it with the machinery every
upstream uses: the fence, passthrough, and the lookup chain's claim, record, replay and join.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web

from ..config import Policy, UpstreamSettings
from ..errors import client_gone
from ..exchange import EXCHANGE
from ..identity import Identity
from ..problems import Problem
from .catalog import Catalog
from .messages import TOOLS_LIST, ToolCall, named, read
from .occurrences import Occurrences, Site
from .readdress import Cuts, Readdress


MAX_TOOL_SHOWN = 128  # characters of a tool's name kept (MCP's own limit for names)


def journaled_path(request: web.Request, path: str) -> str:
    """The path a journal entry shows: a tools/call's names its tool after ``#``
    (``/mcp#send_email``), so operators see which tool a step called. A fragment is never
    sent, so this names no other resource; nothing else reads an entry's path."""
    tool = request[EXCHANGE].tool
    return path if tool is None else f"{path}#{tool}"


@dataclass(eq=False, slots=True)
class Plan:
    """What the proxy does with one MCP request: pass it through (``call`` None, maybe
    reading a tools/list answer with ``tap``), or record a tools/call under ``ident``'s key,
    or under its fingerprint ``fp`` counted at ``site``."""
    ident: Identity
    call: ToolCall | None = None
    tap: Callable[[bytes], None] | None = None
    fp: str | None = None
    site: Site | None = None
    occurrence: int | None = field(default=None, init=False)  # once counted


class McpUpstreams:
    """Tool annotations, undelivered occurrences and recorded answers' cuts of this process, and the
    steps that use them."""

    def __init__(self) -> None:
        self.catalog = Catalog()
        self.occurrences = Occurrences()
        self.cuts = Cuts()

    def plan(self, request: web.Request, upstream: UpstreamSettings, path_qs: str, ident: Identity,
             tenant: Callable[[], str], body: bytes) -> Plan:
        """Read the request and decide. Refusals (a batch with a tools/call, a bad `_meta` key)
        are raised, and answered as JSON-RPC errors. ``tenant`` is called once at most, when
        the decision needs it (not for most passthroughs)."""
        caller = Readdress(self.cuts)  # addressed to the caller's id once the body has named it
        exchange = request[EXCHANGE]
        exchange.render_problem = caller.problem
        named_method, named_tool = named(request.headers)
        whose = named_policy = None
        if named_tool is not None:
            whose = tenant()
            named_policy = self.catalog.policy(upstream, whose, named_tool)
            if named_policy is Policy.PASSTHROUGH and ident.policy is None:
                return Plan(ident)  # a read, named in the headers the server must check: its body is not read
        message = read(request.method, named_method, body)
        caller.request_id = message.request_id
        if not isinstance(message, ToolCall):
            tap = None
            if message.method == TOOLS_LIST:
                tap = self.catalog.listing(upstream.name, whose if whose is not None else tenant())
            return Plan(ident, tap=tap)
        if message.key is not None and ident.key not in (None, message.key):
            raise Problem("invalid-key", "the Idempotency-Key header and the _meta key differ")
        key = ident.key or message.key
        if whose is None:
            whose = tenant()
        chosen = ident.policy or (named_policy if named_tool == message.name else None) \
            or self.catalog.policy(upstream, whose, message.name)
        if chosen is Policy.PASSTHROUGH or (ident.policy is None and key is None and ident.run is None):
            return Plan(ident)  # without a key or a run there is nothing to replay into (docs/concepts.md)
        caller.progress_token = message.progress_token
        exchange.readdress = caller
        fp = message.fingerprint(upstream.name, path_qs, whose)
        if key != ident.key:  # the key came in `_meta`
            ident = Identity(key=key, run=ident.run, epoch=ident.epoch, policy=ident.policy,
                             namespace=ident.namespace)
        site = (whose, ident.namespace, ident.run, ident.epoch, fp) if key is None and ident.run else None
        exchange.tool = message.name[:MAX_TOOL_SHOWN]
        return Plan(ident, message, fp=fp, site=site)

    async def occurrence(self, plan: Plan, count: Callable[[], Awaitable[int]]) -> int:
        """The derived key's occurrence number: an undelivered identical call's, or the next."""
        assert plan.site is not None
        plan.occurrence = await self.occurrences.take(plan.site, count)
        return plan.occurrence

    def deliver(self, request: web.Request, plan: Plan, resp: web.StreamResponse) -> web.StreamResponse:
        """Note whether the answer reached the agent: until one has, an identical call is the same
        call (see occurrences.py). A stream has been written whole, or cut short (its connection
        closed); a JSON answer is written next, to a connection still open (the agent of a broken
        exchange has closed it by the time its answer is ready)."""
        if plan.site is None or plan.occurrence is None:
            return resp  # an explicit key: no occurrence to settle
        if not client_gone(request):
            self.occurrences.delivered(plan.site, plan.occurrence)
        return resp
