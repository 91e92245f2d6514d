"""The request path: route, identify, decide, then pass through, record or replay."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import hdrs, web

from . import policy
from .answercache import AnswerCache
from .calls import Call, Fate
from .codings import decoded
from .config import Settings, UpstreamSettings
from .errors import client_gone
from .exchange import EXCHANGE, Exchange
from .fencing import Fence
from .fingerprint import fingerprint
from .forward import failure_slug, forwarded_key, is_stream, request_headers, response_headers
from .forwarded import Forwarding
from .freshness import Freshness
from .heartbeats import Heartbeats
from .identity import Identity, TenantResolver, parse_epoch, parse_key, parse_policy, parse_run
from .mcp import McpUpstreams, ToolAnswer, journaled_path
from .observability.facts import Facts, key_kind
from .observability.metrics import Metrics
from .outcomes import Outcome
from .policy import OnAmbiguous, Policy
from .problems import Problem
from .replay import (in_flight, join_remote, key_reused, listen, outcome_unknown, send_record,
                     server_timing, start_stream, whole_record)
from .replaycache import CachedAttempt, ReplayCache
from .routing import Route, origin_form, parse_route
from .runs.refusals import Refusals, RunCall
from .store import Store, StoreUnavailable
from .store.base import Claim, ClaimResult, Entry, EntryState, Scope
from .upstream.errors import UpstreamError
from .upstream.pool import UpstreamPool
from .upstream.wire import Answer

log = logging.getLogger("idemproxy.proxy")

# Counts a derived key's occurrence, given the store's count of it (see Proxy._scope)
Occurrence = Callable[[Callable[[], Awaitable[int]]], Awaitable[int]]

PASSED_WHOLE_BYTES = 1 << 20  # passthrough bodies up to this size go in one write; larger ones stream


@dataclass
class Proxy:
    settings: Settings
    store: Store
    tenants: TenantResolver
    heartbeats: Heartbeats
    metrics: Metrics
    pools: dict[str, UpstreamPool] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)  # recorded calls in flight here
    tasks: set[asyncio.Task] = field(default_factory=set)
    replays: dict[str, int] = field(default_factory=dict)  # replay counts not yet stored
    on_ambiguous: dict[str, OnAmbiguous] = field(init=False)  # per upstream, worked out once
    forwarding: Forwarding = field(init=False)
    fence: Fence = field(init=False)  # superseded attempts refused
    refusals: Refusals = field(init=False)  # what runs' calls were refused, counted per run
    freshness: Freshness = field(init=False)  # when the two caches below may answer
    answers: AnswerCache = field(init=False)  # complete entries recorded or read here, in memory
    replay_cache: ReplayCache = field(init=False)  # restarted attempts' journals, in memory
    mcp: McpUpstreams = field(default_factory=McpUpstreams)  # kind = "mcp" upstreams' state
    # A claim's owner: this process's random prefix and a count (os.urandom per claim was a
    # syscall per record). Made with the Proxy, in the process that serves: workers differ.
    _owner: str = field(init=False, default_factory=lambda: os.urandom(12).hex() + "-")
    _claims: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.on_ambiguous = {name: policy.on_ambiguous(up) for name, up in self.settings.upstreams.items()}
        self.forwarding = Forwarding(self.settings.server.trusted_proxies)
        self.fence = Fence(self.settings, self.store, self.heartbeats)
        self.refusals = Refusals(self.store, self.settings.store.retention)
        store, journal = self.settings.store, self.store.journal
        self.freshness = Freshness(journal, store.cache_lease)
        self.answers = AnswerCache(self.freshness, store.answer_cache_bytes)
        self.replay_cache = ReplayCache(journal, self.freshness, store.replay_cache_bytes, store.replay_cache_ttl)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Refusals and store failures are raised: ``errors.problem_middleware`` answers them
        and counts the request, once its outcome is final."""
        exchange = request[EXCHANGE] = Exchange(time.perf_counter())
        try:
            target = request.raw_path
            if not target.startswith("/"):  # absolute-form: taken when it names us (routing.py)
                target = origin_form(target, request.headers.getall(hdrs.HOST, ()))
            route = parse_route(target, self.settings.upstreams)
            if "websocket" in request.headers.get(hdrs.UPGRADE, "").lower():
                # Frames on a WebSocket are no requests the journal could key, record or replay
                # (the OpenAI Agents SDK's opt-in Responses transport): refused, never tunnelled unjournaled.
                raise Problem("websocket-refused", "idemproxy journals HTTP requests and cannot journal a "
                              "WebSocket: use the client's HTTP transport (for the OpenAI Agents SDK, the "
                              "default, set_default_openai_responses_transport(\"http\"))")
            if route.upstream.kind == "mcp":
                return await self._mcp(request, exchange, route)
            ident, chosen = self._identify_and_decide(request, route)
            self._of_run(request, exchange, route, ident)
            body, content = await self._read_body(request)
            facts = self._note(exchange, route, ident, content)
            upstream = route.upstream
            if chosen is Policy.RECORD:  # before the fence: a refused call changes nothing
                self.tenants.check_recordable(self._tenant(request, exchange), upstream.name)
            attempt = None
            if ident.run:
                since = time.perf_counter()
                attempt = await self._fence_or_preloaded(ident, chosen)
                facts.timed(since)
                self.heartbeats.hold(request, ident)  # open, its run is alive (docs/restarts.md)
            if chosen is Policy.PASSTHROUGH:
                exchange.outcome = Outcome.PASSTHROUGH
                return await self._passthrough(request, exchange, route, ident, body)
            fp = self._fingerprint(request, route, content)
            return await self._record(request, exchange, route, ident, body, fp, attempt=attempt)
        except ConnectionResetError:  # the agent went away; a recorded call goes on without it
            exchange.outcome = Outcome.DISCONNECTED
            return exchange.stream or web.Response(status=499)

    # -- identity -------------------------------------------------------------------------

    def _identify(self, request: web.Request, route: Route) -> Identity:
        return self._identify_and_decide(request, route, decide=False)[0]

    def _identify_and_decide(self, request: web.Request, route: Route,
                             decide: bool = True) -> tuple[Identity, Policy | None]:
        """Who the request is and, with ``decide``, whether it is recorded. A passthrough
        outside a run uses no namespace, so it is not derived (TenantResolver.namespace)."""
        headers = request.headers
        run = route.run or parse_run(headers.get("Idem-Run"))
        epoch = route.epoch if route.epoch is not None else parse_epoch(headers.get("Idem-Epoch"))
        if epoch is not None and run is None:
            raise Problem("invalid-header", "Idem-Epoch needs a run (Idem-Run or /runs/{run_id}/...)")
        key = parse_key(headers.getall("Idempotency-Key", ()))
        override = parse_policy(headers.get("Idem-Policy"))
        chosen = None
        if decide:
            chosen = policy.decide(route.upstream, request.method, route.path, override=override,
                                   has_key=key is not None, has_run=run is not None)
        derive = chosen is not Policy.PASSTHROUGH or run is not None
        return Identity(key=key, run=run, epoch=epoch, policy=override,
                        namespace=self.tenants.namespace(headers, request.remote, derive=derive, run=run,
                                                         token=route.token)), chosen

    def _tenant(self, request: web.Request, exchange: Exchange) -> str:
        """Whose entries and connections the request's are (TenantResolver.tenant): resolved
        once per request, when first asked, from its namespace."""
        tenant = exchange.tenant
        if tenant is None:
            tenant = exchange.tenant = self.tenants.tenant(request.headers, exchange.ident.namespace)
        return tenant

    def _of_run(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity) -> None:
        """A run's call: its refusals are counted on the run (errors.problem_middleware)."""
        exchange.ident = ident
        if ident.run is not None:
            exchange.run_call = RunCall(self.refusals, ident.namespace, ident.run, ident.epoch,
                                        route.upstream.name, request.method, route.path)

    @staticmethod
    def _note(exchange: Exchange, route: Route, ident: Identity, body: bytes) -> Facts:
        """Start the call's facts for its access-log line and trace span (proxy/observability/facts.py);
        the steps below add the key, store time and answer as they learn them."""
        facts = exchange.facts = Facts(route.upstream.name, ident.run, ident.epoch, body=body)
        return facts

    def _fingerprint(self, request: web.Request, route: Route, content: bytes) -> str:
        """What makes two calls the same (docs/concepts.md): read from the body's decoded content, so a
        body sent compressed is the same call as the same content sent plain."""
        upstream = route.upstream
        return fingerprint(request.method, upstream.name, route.path_qs, content,
                           request.headers.get("Content-Type", ""),
                           policy.ignored_fields(upstream, request.method, route.path),
                           policy.unordered_fields(upstream, request.method, route.path))

    async def _read_body(self, request: web.Request) -> tuple[bytes, bytes]:
        """The body as received, which is forwarded, and its content decoded per its
        Content-Encoding, which the proxy reads (codings.py). Both are held to
        ``max_request_bytes``."""
        limit = self.settings.server.max_request_bytes
        length = request.content_length  # parsed anew at every look: look once
        if length is not None and length > limit:
            raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
        if not request.body_exists:
            return b"", b""
        content = request.content
        if content.is_eof():  # all of it came with the head: taken as it lies, no read loop (3-5 µs)
            body = content.read_nowait()
        elif length is not None:  # bounded above: read it in one go
            body = await request.read()
        else:
            body = bytearray()
            async for chunk in content.iter_any():
                body += chunk
                if len(body) > limit:
                    break
            body = bytes(body)
        if len(body) > limit:  # chunked: no length said so beforehand
            raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
        return body, decoded(body, request.headers, limit)

    async def _fence_or_preloaded(self, ident: Identity, chosen: Policy) -> CachedAttempt | None:
        """Fence the request; for a recorded call, also find its attempt's journal in memory,
        loaded on the attempt's first request here. A derived key in a preloaded attempt is
        fenced later, with its occurrence (_scope): one store round trip for both."""
        if chosen is Policy.PASSTHROUGH:
            await self.fence.check(ident, fail_open=True)
            return None
        attempt = self.replay_cache.get(ident.namespace, ident.run, ident.epoch)
        if attempt is None or ident.key is not None:
            await self.fence.check(ident, fail_open=False)
        return attempt if attempt is not None else await self._load_attempt(ident)

    async def _preloaded(self, ident: Identity) -> CachedAttempt | None:
        """The attempt's journal in memory, loaded here by its first request that wants it."""
        attempt = self.replay_cache.get(ident.namespace, ident.run, ident.epoch)
        return attempt if attempt is not None else await self._load_attempt(ident)

    async def _load_attempt(self, ident: Identity) -> CachedAttempt | None:
        """Load the attempt's journal, if this request should (ReplayCache.wanted): none held yet."""
        cache = self.replay_cache
        if not cache.wanted(ident.namespace, ident.run, ident.epoch):
            return None
        return await cache.load(ident.namespace, ident.run, ident.epoch)

    # -- passthrough ----------------------------------------------------------------------

    async def _passthrough(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity,
                           body: bytes, tap: Callable[[bytes], None] | None = None) -> web.StreamResponse:
        """Forward, record nothing; ``tap`` sees the answer's bytes as they pass."""
        upstream = route.upstream
        headers = request_headers(request.headers, upstream, self.settings.tenants.header, None,
                                  self.forwarding.headers(request.headers, request.remote))
        sent = time.perf_counter()
        try:
            resp = await self.pools[upstream.name].request(
                request.method, route.path_qs, headers, body,
                tenant=self._connection_tenant(request, exchange), may_resend=True)
        except UpstreamError as exc:
            raise _upstream_failed(upstream, exc) from None
        try:
            upstream_s = exchange.upstream_s = time.perf_counter() - sent
            out = response_headers(resp.headers)
            out.append(("Server-Timing", server_timing(time.perf_counter() - exchange.started - upstream_s,
                                                       upstream_s)))
            length = resp.content_length
            bodiless = request.method == "HEAD"
            if bodiless and length is not None:  # the length a GET would get (RFC 9110 §9.3.2):
                out.append(("Content-Length", str(length)))  # aiohttp writes none for a HEAD
            if bodiless or not is_stream(resp.headers) and length <= PASSED_WHOLE_BYTES:
                answer = await resp.read()
                if tap is not None:
                    tap(answer)
                return Answer(status=resp.status, body=answer, headers=out)
            if length is not None:  # streamed as it comes, still with its length
                out.append(("Content-Length", str(length)))
            exchange.relaying = resp  # from here on, the client's going away closes it (connections.py)
            stream = await start_stream(request, resp.status, out)
            while chunk := await resp.readany():
                if tap is not None:
                    tap(chunk)
                await stream.write(chunk)
            await stream.write_eof()
            return stream
        except (UpstreamError, ConnectionError) as exc:
            # The client left (we then closed its upstream, or a write to it failed: aiohttp wakes
            # a write waiting on a gone client with a bare ConnectionError): not the upstream's fault.
            if client_gone(request):
                raise ConnectionResetError("the client went away") from None
            if not isinstance(exc, UpstreamError):
                raise
            raise _upstream_failed(upstream, exc) from None
        finally:
            resp.release()

    def _connection_tenant(self, request: web.Request, exchange: Exchange) -> str:
        """Whose upstream connections the request may use: its tenant's (docs/guarantees.md, the
        upstream boundary), so that nothing an upstream sends on a connection can reach another
        tenant. A passthrough outside a run has no namespace: its credential itself keys them."""
        return self._tenant(request, exchange) if exchange.ident.namespace else \
            self.tenants.connection_key(request.headers)

    # -- record and replay ----------------------------------------------------------------

    async def _record(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity,
                      body: bytes, fp: str, occurrence: Occurrence | None = None,
                      attempt: CachedAttempt | None = None) -> web.StreamResponse:
        """Claim the key and make the call, or answer from whoever holds it: the attempt's
        journal in memory, the entries answered here before (answercache.py), a call in
        flight here, the journal, or a stream another proxy is recording. While the key is in flight elsewhere and its stream has not begun, wait
        for it and look again.

        ``fp``: the request's fingerprint (_fingerprint), or the one an upstream kind that knows
        better what makes two calls the same gives (MCP), with how a derived key's occurrence
        is counted."""
        upstream = route.upstream
        facts: Facts = exchange.facts
        since = time.perf_counter()
        scope = await self._scope(request, exchange, route, ident, fp, occurrence, attempt)
        kid = facts.kid = scope.kid
        facts.key_kind = key_kind(scope.key)
        facts.timed(since)
        recorded = attempt.entry(kid) if attempt is not None else None
        if recorded is not None:  # the facts above and _from_journal's answer make its log line
            answer = await self._from_journal(request, exchange, upstream, recorded, fp)
            self.metrics.replayed_from_memory += 1
            return answer
        recorded = self.answers.get(kid)
        if recorded is not None:
            answer = await self._from_journal(request, exchange, upstream, recorded, fp)
            self.metrics.replayed_from_cache += 1
            return answer
        deadline = time.monotonic() + self.settings.server.in_flight_wait
        while True:
            call = self.calls.get(kid)
            if call is not None and not call.gave_back:  # in flight here: join it
                if await self._joinable(call, fp, deadline):
                    exchange.outcome = Outcome.JOINED
                    return await listen(request, call, replayed=True)
                continue  # it gave the key back meanwhile: claim it like any retry
            # the claim answers a taken key with its entry: one store call either way
            since = time.perf_counter()
            noted = self.freshness.generation  # before the store call: what it gives may be kept
            result = await self._claim(request, route, ident, scope, fp)
            facts.timed(since)
            if result.won:
                if attempt is not None:  # the attempt goes live: its replays are over
                    self.replay_cache.drop(attempt)
                return await self._call(request, exchange, route, result.entry, body, ident.namespace, noted)
            entry = result.entry
            self.answers.put(entry, noted)
            answer = await self._from_journal(request, exchange, upstream, entry, fp, deadline)
            if answer is not None:
                return answer
            await self._wait(kid, deadline)

    async def _scope(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity, fp: str,
                     occurrence: Occurrence | None = None, attempt: CachedAttempt | None = None) -> Scope:
        """Where the request's journal entry lives: under the agent's key, its derived key in
        the run (docs/concepts.md, The fingerprint), or its own fingerprint."""
        tenant = self._tenant(request, exchange)
        upstream = route.upstream.name
        if ident.key is not None:
            return Scope.of_key(tenant, ident.run, upstream, ident.key)
        if ident.run is not None:  # counted per tenant: another credential's calls shift nothing
            def count() -> Awaitable[int]:
                return self._occurrence(ident, fp, tenant, attempt)
            n = await (count() if occurrence is None else occurrence(count))
            return Scope(tenant, ident.run, upstream, f"derived:{fp}:{n}")
        # `Idem-Policy: record` with neither key nor run: the request is its own key
        return Scope(tenant, None, upstream, f"fingerprint:{fp}")

    async def _occurrence(self, ident: Identity, fp: str, tenant: str, attempt: CachedAttempt | None) -> int:
        """The derived key's occurrence number among ``tenant``'s calls alike; in a preloaded
        attempt, fenced in the same step."""
        journal, retention = self.store.journal, self.settings.store.retention
        if attempt is not None:
            n = await journal.replay_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention,
                                                tenant=tenant)
            if n is not None:
                self.heartbeats.beat(ident.namespace, ident.run, ident.epoch)
                return n
            # the run is no longer at this epoch: the fence says how (412 for a superseded attempt)
            self.replay_cache.drop(attempt)
            await self.fence.check(ident, fail_open=False)
        return await journal.next_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention, tenant=tenant)

    @staticmethod
    async def _joinable(call: Call, fp: str, deadline: float) -> bool:
        """Whether a duplicate may join a call in flight here. It waits, within
        ``in_flight_wait``, for the call's outcome, or for its stream to begin (then it joins
        the stream live). False: the call gave the key back meanwhile."""
        if call.fingerprint != fp:
            raise key_reused("is in use")

        async def joinable() -> None:
            await call.headers_ready()
            if not call.streamed:
                await call.finished()
        try:
            await asyncio.wait_for(joinable(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise in_flight() from None
        return not call.gave_back

    async def _claim(self, request: web.Request, route: Route, ident: Identity, scope: Scope,
                     fp: str) -> ClaimResult:
        store = self.settings.store
        result = await self.store.journal.claim(Claim(
            scope=scope, fingerprint=fp, owner=f"{self._owner}{next(self._claims)}", lease_s=store.lease,
            retention_s=store.retention, method=request.method, path=journaled_path(request, route.path),
            epoch=ident.epoch,
            on_expired=self.on_ambiguous[route.upstream.name], namespace=ident.namespace))
        if result.stale_epoch is not None:  # a restart moved the run on since the fence
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {result.stale_epoch}",
                          epoch=result.stale_epoch)
        return result

    async def _call(self, request: web.Request, exchange: Exchange, route: Route, entry: Entry, body: bytes,
                    namespace: str, noted: int | None) -> web.StreamResponse:
        """The key is ours: make the call, and answer as it goes. ``noted``: the journal's
        generation before the claim, under which its record may be kept in memory."""
        exchange.outcome = Outcome.RECORDED
        call = self._start(request, route, entry, body, namespace, noted)
        try:
            return await listen(request, call, replayed=False)
        finally:
            exchange.upstream_s = call.upstream_s if call.status else None
            exchange.facts.answer = call.answer

    async def _from_journal(self, request: web.Request, exchange: Exchange, upstream: UpstreamSettings,
                            entry: Entry, fp: str, deadline: float = 0.0) -> web.StreamResponse | None:
        """Answer from a key someone else claimed: its replay, a refusal, or the stream
        another proxy is recording, once that proxy shows it is alive (join_remote; until
        ``deadline``). None: in flight, and its stream has not begun or its lease ran out."""
        if entry.fingerprint != fp:
            raise key_reused("was first used")
        state = entry.state
        if state == EntryState.COMPLETE:
            exchange.outcome = Outcome.REPLAYED
            self.replays[entry.kid] = self.replays.get(entry.kid, 0) + 1
            self.metrics.saved(upstream, entry.kid, entry.response)
            recorded = exchange.facts.answer = entry.response
            if not recorded.streamed:
                return whole_record(request, recorded)
            paced = request.headers.get("Idem-Replay", "").lower() == "paced"
            return await send_record(request, recorded, paced)
        if state == EntryState.UNKNOWN:
            raise outcome_unknown(entry)
        if state == EntryState.UNRECORDABLE:
            raise Problem("not-replayable", entry.detail or "the response was too large to record")
        joined = await join_remote(request, self.store, entry, deadline)
        if joined is not None:
            exchange.outcome = Outcome.JOINED
        return joined

    async def _wait(self, kid: str, deadline: float) -> None:
        """Until the key changes in the store, within ``in_flight_wait``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise in_flight()
        await self.store.journal.wait(kid, remaining)

    def _start(self, request: web.Request, route: Route, entry: Entry, body: bytes,
               namespace: str, noted: int | None) -> Call:
        upstream: UpstreamSettings = route.upstream
        call = Call(kid=entry.kid, owner=entry.owner, fingerprint=entry.fingerprint, upstream=upstream,
                    on_ambiguous=self.on_ambiguous[upstream.name],
                    max_record_bytes=self.settings.server.max_record_bytes,
                    max_record_seconds=self.settings.server.max_record_seconds,
                    max_evidence_bytes=self.settings.server.max_evidence_bytes,
                    credential_headers=self.settings.tenants.credential_headers,
                    reader=ToolAnswer() if upstream.kind == "mcp" else None)
        headers = request_headers(request.headers, upstream, self.settings.tenants.header,
                                  forwarded_key(entry.kid) if upstream.idempotency_header else None,
                                  self.forwarding.headers(request.headers, request.remote))
        beat = (lambda: self.heartbeats.beat(namespace, entry.run, entry.epoch)) if entry.run else (lambda: None)
        # the entry's tenant, worked out once for its key (_scope), is whose connections it uses
        task = asyncio.create_task(call.run(self.pools[upstream.name], entry.tenant, self.store, request.method,
                                            route.path_qs, headers, body, beat))
        self.calls[entry.kid] = call
        self.tasks.add(task)

        def done(_):
            self.tasks.discard(task)
            self.calls.pop(entry.kid, None)
            if call.result is not None and call.result.fate is Fate.RECORDED:  # committed: as the store has it
                # the claim's entry is this call's alone: made complete in place, not copied
                # (dataclasses.replace cost a record 3 µs)
                entry.state, entry.owner, entry.response = EntryState.COMPLETE, None, call.answer
                entry.completed_at = time.time()
                self.answers.put(entry, noted)
        task.add_done_callback(done)
        return call

    # -- MCP upstreams --------------------------------------------------------------------

    async def _mcp(self, request: web.Request, exchange: Exchange, route: Route) -> web.StreamResponse:
        """A ``kind = "mcp"`` upstream (docs/mcp.md): a tools/call is recorded under what it means
        and replayed under the caller's JSON-RPC id; everything else passes through."""
        ident = self._identify(request, route)
        self._of_run(request, exchange, route, ident)
        body, content = await self._read_body(request)
        facts = self._note(exchange, route, ident, content)
        plan = self.mcp.plan(request, route.upstream, route.path_qs, ident,
                             lambda: self._tenant(request, exchange), content)
        if plan.call is not None:  # a tools/call is recorded: as for any call, not without a credential
            self.tenants.check_recordable(self._tenant(request, exchange), route.upstream.name)
        attempt = None
        if ident.run:
            since = time.perf_counter()
            # fenced first, always: a re-issued call takes its occurrence without the store
            # (mcp/occurrences.py), so the occurrence's round trip cannot be the fence
            await self.fence.check(ident, fail_open=plan.call is None)
            self.heartbeats.hold(request, ident)
            if plan.call is not None:  # a restarted attempt's replays come from its journal in memory
                attempt = await self._preloaded(plan.ident)
            facts.timed(since)
        if plan.call is None:
            exchange.outcome = Outcome.PASSTHROUGH
            return await self._passthrough(request, exchange, route, ident, body, plan.tap)
        counted = functools.partial(self.mcp.occurrence, plan) if plan.site else None
        resp = await self._record(request, exchange, route, plan.ident, body, plan.fp, counted, attempt)
        return self.mcp.deliver(request, plan, resp) if plan.site is not None else resp

    # -- background work ------------------------------------------------------------------

    async def renew_leases(self) -> None:
        """Keep this proxy's claims alive while their calls are in flight."""
        interval = self.settings.store.lease / 3
        while True:
            await asyncio.sleep(interval)
            for call in list(self.calls.values()):
                try:
                    if not await self.store.journal.renew(call.kid, call.owner, self.settings.store.lease):
                        log.warning("lost the lease on %s", call.kid[:12])
                except StoreUnavailable as exc:
                    log.warning("lease renewal failed: %s", exc)
                except Exception:  # noqa: BLE001 - a dead renewer would let claims lapse mid-call
                    log.exception("lease renewal of %s failed", call.kid[:12])

    async def flush_replay_counts(self) -> None:
        if self.replays:
            counts, self.replays = self.replays, {}
            await self.store.journal.count_replays(counts)

    async def drain(self, timeout: float) -> None:
        """On shutdown: let recorded calls in flight finish and record."""
        if self.tasks:
            log.info("waiting up to %.0fs for %d call(s) in flight", timeout, len(self.tasks))
            await asyncio.wait(list(self.tasks), timeout=timeout)


def _upstream_failed(upstream: UpstreamSettings, exc: UpstreamError) -> Problem:
    """A passthrough's failed exchange with its upstream, as the agent's problem."""
    return Problem(failure_slug(exc), f"{type(exc).__name__} talking to {upstream.name}: {exc}")
