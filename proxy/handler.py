"""The request path: route, identify, decide, then pass through, record or replay."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from . import policy
from .calls import Call
from .config import Settings, UpstreamSettings
from .errors import OUTCOME, STARTED, UPSTREAM_S
from .fingerprint import fingerprint
from .forward import forwarded_key, is_stream, request_headers, response_headers
from .heartbeats import Heartbeats
from .identity import Identity, TenantResolver, parse_epoch, parse_key, parse_policy, parse_run
from .metrics import Metrics
from .outcomes import Outcome
from .policy import OnAmbiguous, Policy
from .problems import Problem
from .replay import STREAM, join_remote, listen, send_record, server_timing, start_stream
from .replaycache import CachedAttempt, ReplayCache
from .routing import Route, parse_route, upstream_url
from .store import Store, StoreUnavailable
from .store.base import Claim, ClaimResult, Entry, EntryState, Run, Scope

log = logging.getLogger("idemproxy.proxy")


@dataclass
class Proxy:
    settings: Settings
    store: Store
    tenants: TenantResolver
    heartbeats: Heartbeats
    metrics: Metrics
    sessions: dict[str, aiohttp.ClientSession] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)  # recorded calls in flight here
    tasks: set[asyncio.Task] = field(default_factory=set)
    replays: dict[str, int] = field(default_factory=dict)  # replay counts not yet stored
    on_ambiguous: dict[str, OnAmbiguous] = field(init=False)  # per upstream, worked out once
    replay_cache: ReplayCache = field(init=False)  # restarted attempts' journals, in memory
    _epoch_reads: dict[tuple, asyncio.Future] = field(default_factory=dict)  # shared fence reads

    def __post_init__(self) -> None:
        self.on_ambiguous = {name: policy.on_ambiguous(up) for name, up in self.settings.upstreams.items()}
        store = self.settings.store
        self.replay_cache = ReplayCache(self.store.journal, store.replay_cache_bytes, store.replay_cache_ttl)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Refusals and store failures are raised: ``errors.problem_middleware`` answers them
        and counts the request, once its outcome is final."""
        started = request[STARTED] = time.perf_counter()
        request[OUTCOME] = Outcome.REJECTED
        try:
            route = parse_route(request.raw_path, self.settings.upstreams)
            ident = self._identify(request, route)
            body = await self._read_body(request)
            upstream = route.upstream
            chosen = policy.decide(upstream, request.method, route.path, override=ident.policy,
                                   has_key=ident.key is not None, has_run=ident.run is not None)
            attempt = None
            if ident.run:
                attempt = await self._fence_or_preloaded(ident, chosen)
            if chosen is Policy.PASSTHROUGH:
                request[OUTCOME] = Outcome.PASSTHROUGH
                return await self._passthrough(request, route, body, started)
            return await self._record(request, route, ident, body, started, attempt)
        except ConnectionResetError:  # the agent went away; a recorded call goes on without it
            request[OUTCOME] = Outcome.DISCONNECTED
            return request.get(STREAM) or web.Response(status=499)

    # -- identity -------------------------------------------------------------------------

    def _identify(self, request: web.Request, route: Route) -> Identity:
        headers = request.headers
        run = route.run or parse_run(headers.get("Idem-Run"))
        epoch = route.epoch if route.epoch is not None else parse_epoch(headers.get("Idem-Epoch"))
        if epoch is not None and run is None:
            raise Problem("invalid-header", "Idem-Epoch needs a run (Idem-Run or /runs/{run_id}/...)")
        return Identity(key=parse_key(headers.getall("Idempotency-Key", ())), run=run, epoch=epoch,
                        policy=parse_policy(headers.get("Idem-Policy")),
                        namespace=self.tenants.namespace(headers, request.remote))

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.server.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
        if not request.body_exists:
            return b""
        if request.content_length is not None:  # bounded above: read it in one go
            return await request.read()
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise Problem("too-large", f"request body over {limit} bytes", max_request_bytes=limit)
        return bytes(body)

    async def _fence(self, ident: Identity, fail_open: bool) -> None:
        """Refuse a superseded attempt (a zombie) before anything is forwarded.

        A passthrough request records nothing, so when the store is down it goes on
        unfenced (SPEC §7: passthrough still works); a record request fails closed.
        """
        runs = self.settings.runs
        defaults = Run(ident.namespace, ident.run, timeout_s=runs.timeout_s, grace_s=runs.grace_s,
                       max_restarts=runs.max_restarts, hook=runs.hook)
        try:
            current = await self._observe_epoch(ident, defaults)
        except StoreUnavailable:
            if not fail_open:
                raise
            log.warning("store unavailable: passthrough for run %s forwarded unfenced", ident.run)
            return
        if ident.epoch is not None and ident.epoch < current:
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {current}; this attempt "
                          f"(epoch {ident.epoch}) has been superseded", epoch=current)
        self.heartbeats.beat(ident.namespace, ident.run)  # a fenced zombie is no sign of life

    async def _fence_or_preloaded(self, ident: Identity, chosen: Policy) -> CachedAttempt | None:
        """Fence the request; for a recorded call, also find its attempt's journal in memory,
        loaded on the attempt's first request here. A derived key in a preloaded attempt is
        fenced later, with its occurrence (_scope): one store round trip for both."""
        if chosen is Policy.PASSTHROUGH:
            await self._fence(ident, fail_open=True)
            return None
        cache = self.replay_cache
        attempt = cache.get(ident.namespace, ident.run, ident.epoch)
        if attempt is None or ident.key is not None:
            await self._fence(ident, fail_open=False)
        if attempt is None and cache.wanted(ident.namespace, ident.run, ident.epoch):
            attempt = await cache.load(ident.namespace, ident.run, ident.epoch)
        return attempt

    async def _observe_epoch(self, ident: Identity, defaults: Run) -> int:
        """The run's current epoch. Requests of one attempt that arrive together share one
        store call (in flight for a round trip), so a busy run costs the store one read per
        round trip, not one per request."""
        key = (ident.namespace, ident.run, ident.epoch)
        shared = self._epoch_reads.get(key)
        if shared is None:
            shared = self._epoch_reads[key] = asyncio.ensure_future(self.store.runs.observe_epoch(
                ident.namespace, ident.run, ident.epoch, defaults, time.time()))
            shared.add_done_callback(lambda _: self._epoch_reads.pop(key, None))
        return await asyncio.shield(shared)

    # -- passthrough ----------------------------------------------------------------------

    async def _passthrough(self, request: web.Request, route: Route, body: bytes,
                           started: float) -> web.StreamResponse:
        upstream = route.upstream
        headers = request_headers(request.headers, upstream, self.settings.tenants.header, None)
        session = self.sessions[upstream.name]
        sent = time.perf_counter()
        try:
            async with session.request(request.method, upstream_url(upstream, route), headers=headers,
                                       data=body, allow_redirects=False) as resp:
                upstream_s = request[UPSTREAM_S] = time.perf_counter() - sent
                out = response_headers(resp.headers)
                out.append(("Server-Timing", server_timing(time.perf_counter() - started - upstream_s,
                                                           upstream_s)))
                if not is_stream(resp.headers):
                    return web.Response(status=resp.status, body=await resp.read(), headers=out)
                stream = await start_stream(request, resp.status, out)
                async for chunk in resp.content.iter_any():
                    await stream.write(chunk)
                await stream.write_eof()
                return stream
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            slug = "upstream-timeout" if isinstance(exc, asyncio.TimeoutError) else "upstream-unavailable"
            raise Problem(slug, f"{type(exc).__name__} talking to {upstream.name}") from None

    # -- record and replay ----------------------------------------------------------------

    async def _record(self, request: web.Request, route: Route, ident: Identity, body: bytes,
                      started: float, attempt: CachedAttempt | None = None) -> web.StreamResponse:
        """Claim the key and make the call, or answer from whoever holds it: the attempt's
        journal in memory, a call in flight here, the journal, or a stream another proxy is
        recording. While the key is in flight elsewhere and its stream has not begun, wait
        for it and look again."""
        upstream = route.upstream
        fp = fingerprint(request.method, upstream.name, route.path_qs, body,
                         request.headers.get("Content-Type", ""),
                         policy.ignored_fields(upstream, request.method, route.path))
        scope = await self._scope(request, route, ident, fp, attempt)
        kid = scope.kid
        recorded = attempt.entry(kid) if attempt is not None else None
        if recorded is not None:
            answer = await self._from_journal(request, upstream, recorded, fp, started)
            self.metrics.replayed_from_memory += 1
            return answer
        deadline = time.monotonic() + self.settings.server.in_flight_wait
        while True:
            call = self.calls.get(kid)
            if call is not None and not call.gave_back:  # in flight here: join it
                if await self._joinable(call, fp, deadline):
                    request[OUTCOME] = Outcome.JOINED
                    return await listen(request, call, started, replayed=True)
                continue  # it gave the key back meanwhile: claim it like any retry
            # a store whose claim answers a taken key with its entry is asked that alone
            entry = None if self.store.journal.claim_reads else await self.store.journal.get(kid)
            if entry is None or _lapsed(entry):
                result = await self._claim(request, route, ident, scope, fp)
                if result.won:
                    if attempt is not None:  # the attempt goes live: its replays are over
                        self.replay_cache.drop(attempt)
                    return await self._call(request, route, result.entry, body, ident.namespace, started)
                entry = result.entry
            answer = await self._from_journal(request, upstream, entry, fp, started)
            if answer is not None:
                return answer
            await self._wait(kid, deadline)

    async def _scope(self, request: web.Request, route: Route, ident: Identity, fp: str,
                     attempt: CachedAttempt | None) -> Scope:
        """Where the request's journal entry lives: under the agent's key, its derived key in
        the run (SPEC §2), or its own fingerprint."""
        tenant = self.tenants.tenant(request.headers, ident.namespace)
        upstream = route.upstream.name
        if ident.key is not None:
            return Scope.of_key(tenant, ident.run, upstream, ident.key)
        if ident.run is not None:
            n = await self._occurrence(ident, fp, attempt)
            return Scope(tenant, ident.run, upstream, f"derived:{fp}:{n}")
        # `Idem-Policy: record` with neither key nor run: the request is its own key
        return Scope(tenant, None, upstream, f"fingerprint:{fp}")

    async def _occurrence(self, ident: Identity, fp: str, attempt: CachedAttempt | None) -> int:
        """The derived key's occurrence number; in a preloaded attempt, fenced in the same step."""
        journal, retention = self.store.journal, self.settings.store.retention
        if attempt is not None:
            n = await journal.replay_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention)
            if n is not None:
                self.heartbeats.beat(ident.namespace, ident.run)
                return n
            # the run is no longer at this epoch: the fence says how (412 for a superseded attempt)
            self.replay_cache.drop(attempt)
            await self._fence(ident, fail_open=False)
        return await journal.next_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention)

    @staticmethod
    async def _joinable(call: Call, fp: str, deadline: float) -> bool:
        """Whether a duplicate may join a call in flight here. It waits, within
        ``in_flight_wait``, for the call's outcome, or for its stream to begin (then it joins
        the stream live). False: the call gave the key back meanwhile."""
        if call.fingerprint != fp:
            raise _key_reused("is in use")

        async def joinable() -> None:
            await call.headers_ready()
            if not call.streamed:
                await call.finished()
        try:
            await asyncio.wait_for(joinable(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise _in_flight() from None
        return not call.gave_back

    async def _claim(self, request: web.Request, route: Route, ident: Identity, scope: Scope,
                     fp: str) -> ClaimResult:
        store = self.settings.store
        result = await self.store.journal.claim(Claim(
            scope=scope, fingerprint=fp, owner=os.urandom(16).hex(), lease_s=store.lease,
            retention_s=store.retention, method=request.method, path=route.path, epoch=ident.epoch,
            on_expired=self.on_ambiguous[route.upstream.name], namespace=ident.namespace))
        if result.stale_epoch is not None:  # a restart moved the run on since the fence
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {result.stale_epoch}",
                          epoch=result.stale_epoch)
        return result

    async def _call(self, request: web.Request, route: Route, entry: Entry, body: bytes,
                    namespace: str, started: float) -> web.StreamResponse:
        """The key is ours: make the call, and answer as it goes."""
        request[OUTCOME] = Outcome.RECORDED
        call = self._start(request, route, entry, body, namespace)
        try:
            return await listen(request, call, started, replayed=False)
        finally:
            request[UPSTREAM_S] = call.upstream_s if call.status else None

    async def _from_journal(self, request: web.Request, upstream: UpstreamSettings, entry: Entry,
                            fp: str, started: float) -> web.StreamResponse | None:
        """Answer from a key someone else claimed: its replay, a refusal, or the stream
        another proxy is recording. None: in flight, and its stream has not begun."""
        if entry.fingerprint != fp:
            raise _key_reused("was first used")
        state = entry.state
        if state == EntryState.COMPLETE:
            request[OUTCOME] = Outcome.REPLAYED
            self.replays[entry.kid] = self.replays.get(entry.kid, 0) + 1
            self.metrics.saved(upstream, entry.kid, entry.response)
            paced = request.headers.get("Idem-Replay", "").lower() == "paced"
            return await send_record(request, entry.response, started, paced)
        if state == EntryState.UNKNOWN:
            raise Problem("outcome-unknown", "the first call's outcome is unknown (" +
                          (entry.detail or "ambiguous") + "); an operator must resolve the key")
        if state == EntryState.UNRECORDABLE:
            raise Problem("not-replayable", entry.detail or "the response was too large to record")
        joined = await join_remote(request, self.store, entry.kid, started)
        if joined is not None:
            request[OUTCOME] = Outcome.JOINED
        return joined

    async def _wait(self, kid: str, deadline: float) -> None:
        """Until the key changes in the store, within ``in_flight_wait``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _in_flight()
        await self.store.journal.wait(kid, remaining)

    def _start(self, request: web.Request, route: Route, entry: Entry, body: bytes,
               namespace: str) -> Call:
        upstream: UpstreamSettings = route.upstream
        call = Call(kid=entry.kid, owner=entry.owner, fingerprint=entry.fingerprint, upstream=upstream,
                    on_ambiguous=self.on_ambiguous[upstream.name],
                    max_record_bytes=self.settings.server.max_record_bytes)
        headers = request_headers(request.headers, upstream, self.settings.tenants.header,
                                  forwarded_key(entry.kid) if upstream.idempotency_header else None)
        beat = (lambda: self.heartbeats.beat(namespace, entry.run)) if entry.run else (lambda: None)
        task = asyncio.create_task(call.run(self.sessions[upstream.name], self.store, request.method,
                                            upstream_url(upstream, route), headers, body, beat))
        self.calls[entry.kid] = call
        self.tasks.add(task)

        def done(_):
            self.tasks.discard(task)
            self.calls.pop(entry.kid, None)
        task.add_done_callback(done)
        return call

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


def _lapsed(entry: Entry) -> bool:
    """An in-flight entry whose proxy stopped renewing its lease: claimable again."""
    return entry.state == EntryState.IN_FLIGHT and entry.lease_until < time.time()


def _key_reused(how: str) -> Problem:
    return Problem("key-reused", f"this Idempotency-Key {how} with a different request "
                   "(method, path or body)")


def _in_flight() -> Problem:
    return Problem("in-flight", "the first request with this key has not finished",
                   headers={"Retry-After": "1"})
