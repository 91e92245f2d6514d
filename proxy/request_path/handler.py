"""The proxy handler: every proxied request takes the steps of this package in order (see
its __init__), whatever its upstream's kind; an MCP upstream's requests take them with what
mcp/ works out of their JSON-RPC."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from aiohttp import web

from .. import policy
from ..answercache import AnswerCache
from ..calls import Call
from ..config import Settings
from ..exchange import EXCHANGE, Exchange
from ..forwarded import Forwarding
from ..freshness import Freshness
from ..heartbeats import Heartbeats
from ..identity import Identity, TenantResolver
from ..mcp import McpUpstreams
from ..observability.metrics import Metrics
from ..outcomes import Outcome
from ..policy import OnAmbiguous, Policy
from ..replaycache import ReplayCache
from ..routing import Route
from ..runs.refusals import Refusals, RunCall
from ..store import Store
from ..upstream.pool import UpstreamPool
from .fence import Fence
from .intake import fingerprint_of, identify, note, read_body, route_of, tenant_of
from .lookup import Lookup
from .passthrough import Passthrough
from .record import Recorder


@dataclass
class Proxy:
    settings: Settings
    store: Store
    tenants: TenantResolver
    heartbeats: Heartbeats
    metrics: Metrics
    pools: dict[str, UpstreamPool] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)  # recorded calls in flight here
    on_ambiguous: dict[str, OnAmbiguous] = field(init=False)  # per upstream, worked out once
    forwarding: Forwarding = field(init=False)
    freshness: Freshness = field(init=False)  # when the two caches below may answer
    answers: AnswerCache = field(init=False)  # complete entries recorded or read here, in memory
    replay_cache: ReplayCache = field(init=False)  # restarted attempts' journals, in memory
    fence: Fence = field(init=False)  # superseded attempts refused, and where
    refusals: Refusals = field(init=False)  # what runs' calls were refused, counted per run
    passthrough: Passthrough = field(init=False)
    recorder: Recorder = field(init=False)
    lookup: Lookup = field(init=False)
    mcp: McpUpstreams = field(default_factory=McpUpstreams)  # kind = "mcp" upstreams' state
    _max_body: int = field(init=False)  # [server] max_request_bytes

    def __post_init__(self) -> None:
        settings, store = self.settings, self.store
        self._max_body = settings.server.max_request_bytes
        self.on_ambiguous = {name: policy.on_ambiguous(up) for name, up in settings.upstreams.items()}
        self.forwarding = Forwarding(settings.server.trusted_proxies)
        self.refusals = Refusals(store, settings.store.retention)
        self.freshness = Freshness(store.journal, settings.store.cache_lease)
        self.answers = AnswerCache(self.freshness, settings.store.answer_cache_bytes)
        self.replay_cache = ReplayCache(store.journal, self.freshness, settings.store.replay_cache_bytes,
                                        settings.store.replay_cache_ttl)
        self.fence = Fence(settings, store, self.heartbeats, self.replay_cache)
        self.passthrough = Passthrough(settings, self.tenants, self.pools, self.forwarding)
        self.recorder = Recorder(settings, store, self.pools, self.heartbeats, self.forwarding, self.answers,
                                 self.on_ambiguous, self.calls)
        self.lookup = Lookup(settings, store, self.tenants, self.fence, self.replay_cache, self.answers,
                             self.freshness, self.metrics, self.recorder, self.on_ambiguous)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Refusals and store failures are raised: ``errors.problem_middleware`` answers them
        and counts the request, once its outcome is final."""
        exchange = request[EXCHANGE] = Exchange(time.perf_counter())
        try:
            route = exchange.route = route_of(request, self.settings.upstreams)
            if route.upstream.kind == "mcp":
                return await self._mcp(request, exchange, route)
            ident, chosen = identify(self.tenants, request, route)
            self._enter(request, exchange, route, ident)
            body, content = exchange.body, exchange.content = await read_body(request, self._max_body)
            facts = note(exchange, route, ident, content)
            recorded = chosen is Policy.RECORD
            if recorded:  # before the fence: a refused call changes nothing
                self.tenants.check_recordable(tenant_of(self.tenants, request, exchange), route.upstream.name)
            attempt = await self.fence.enter(request, ident, recorded, facts) if ident.run else None
            if not recorded:
                exchange.outcome = Outcome.PASSTHROUGH
                return await self.passthrough.forward(request, exchange, route, body)
            fp = fingerprint_of(request, route, content)
            return await self.lookup.answer(request, exchange, route, ident, body, fp, attempt=attempt)
        except ConnectionResetError:  # the agent went away; a recorded call goes on without it
            exchange.outcome = Outcome.DISCONNECTED
            return exchange.stream or web.Response(status=499)

    def _enter(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity) -> None:
        """The request's identity, kept; a run's call has its refusals counted on its run
        (errors.problem_middleware)."""
        exchange.ident = ident
        if ident.run is not None:
            exchange.run_call = RunCall(self.refusals, ident.namespace, ident.run, ident.epoch,
                                        route.upstream.name, request.method, route.path)

    async def _mcp(self, request: web.Request, exchange: Exchange, route: Route) -> web.StreamResponse:
        """A ``kind = "mcp"`` upstream (docs/mcp.md): a tools/call is recorded under what it means
        and replayed under the caller's JSON-RPC id; everything else passes through."""
        ident = identify(self.tenants, request, route, decide=False)[0]
        self._enter(request, exchange, route, ident)
        body, content = exchange.body, exchange.content = await read_body(request, self._max_body)
        facts = note(exchange, route, ident, content)
        plan = self.mcp.plan(request, route.upstream, route.path_qs, ident,
                             lambda: tenant_of(self.tenants, request, exchange), content)
        if plan.call is not None:  # a tools/call is recorded: as for any call, not without a credential
            self.tenants.check_recordable(tenant_of(self.tenants, request, exchange), route.upstream.name)
        attempt = None
        if ident.run:
            attempt = await self.fence.enter_mcp(request, ident, plan.ident if plan.call is not None else None,
                                                 facts)
        if plan.call is None:
            exchange.outcome = Outcome.PASSTHROUGH
            return await self.passthrough.forward(request, exchange, route, body, plan.tap)
        counted = functools.partial(self.mcp.occurrence, plan) if plan.site else None
        resp = await self.lookup.answer(request, exchange, route, plan.ident, body, plan.fp, counted, attempt)
        return self.mcp.deliver(request, plan, resp) if plan.site is not None else resp

    # -- background work ------------------------------------------------------------------

    async def renew_leases(self) -> None:
        """Keep this proxy's claims alive while their calls are in flight."""
        await self.recorder.renew_leases()

    async def flush_replay_counts(self) -> None:
        await self.lookup.flush_replay_counts()

    async def drain(self, timeout: float) -> None:
        """On shutdown: let recorded calls in flight finish and record."""
        await self.recorder.drain(timeout)
