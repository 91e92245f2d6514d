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
from .calls import GIVEN_BACK, Call
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
from .routing import Route, parse_route, upstream_url
from .store import Store, StoreUnavailable
from .store.base import Claim, Entry, EntryState, Run, Scope

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
    _epoch_reads: dict[tuple, asyncio.Future] = field(default_factory=dict)  # shared fence reads

    def __post_init__(self) -> None:
        self.on_ambiguous = {name: policy.on_ambiguous(up) for name, up in self.settings.upstreams.items()}

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
            if ident.run:
                await self._fence(ident, fail_open=chosen is Policy.PASSTHROUGH)
            if chosen is Policy.PASSTHROUGH:
                request[OUTCOME] = Outcome.PASSTHROUGH
                return await self._passthrough(request, route, body, started)
            return await self._record(request, route, ident, body, started)
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
                      started: float) -> web.StreamResponse:
        upstream = route.upstream
        fp = fingerprint(request.method, upstream.name, route.path_qs, body,
                         request.headers.get("Content-Type", ""),
                         policy.ignored_fields(upstream, request.method, route.path))
        tenant = self.tenants.tenant(request.headers, ident.namespace)
        if ident.key is not None:
            scope = Scope.of_key(tenant, ident.run, upstream.name, ident.key)
        elif ident.run is not None:
            n = await self.store.journal.next_occurrence(ident.namespace, ident.run, ident.epoch, fp,
                                                 self.settings.store.retention)
            scope = Scope(tenant, ident.run, upstream.name, f"derived:{fp}:{n}")
        else:  # `Idem-Policy: record` with neither key nor run: the request is its own key
            scope = Scope(tenant, None, upstream.name, f"fingerprint:{fp}")
        kid = scope.kid
        deadline = time.monotonic() + self.settings.server.in_flight_wait
        paced = request.headers.get("Idem-Replay", "").lower() == "paced"
        while True:
            call = self.calls.get(kid)
            if call is not None and call.result is not None and call.result.fate in GIVEN_BACK:
                call = None  # it ended and gave the key back: claim it like any retry
            if call is not None:  # in flight here: join it
                if call.fingerprint != fp:
                    raise Problem("key-reused", "this Idempotency-Key is in use with a different "
                                  "request (method, path or body)")
                await self._until_joinable(call, deadline)
                if call.result is not None and call.result.fate in GIVEN_BACK:
                    continue
                request[OUTCOME] = Outcome.JOINED
                return await listen(request, call, started, replayed=True)
            # a store whose claim answers a taken key with its entry is asked that alone
            entry = None if self.store.journal.claim_reads else await self.store.journal.get(kid)
            if entry is None or (entry.state == EntryState.IN_FLIGHT and entry.lease_until < time.time()):
                claim = Claim(scope, fp, os.urandom(16).hex(), self.settings.store.lease,
                              self.settings.store.retention, request.method, route.path, ident.epoch,
                              self.on_ambiguous[upstream.name], ident.namespace)
                result = await self.store.journal.claim(claim)
                if result.stale_epoch is not None:
                    raise Problem("stale-epoch", f"run {ident.run} is at epoch {result.stale_epoch}",
                                  epoch=result.stale_epoch)
                if result.won:
                    request[OUTCOME] = Outcome.RECORDED
                    call = self._start(request, route, result.entry, body, ident.namespace)
                    try:
                        return await listen(request, call, started, replayed=False)
                    finally:
                        request[UPSTREAM_S] = call.upstream_s if call.status else None
                entry = result.entry
            if entry.fingerprint != fp:
                raise Problem("key-reused", "this Idempotency-Key was first used with a different "
                              "request (method, path or body)")
            if entry.state == EntryState.COMPLETE:
                request[OUTCOME] = Outcome.REPLAYED
                self.replays[kid] = self.replays.get(kid, 0) + 1
                self.metrics.saved(upstream, kid, entry.response)
                return await send_record(request, entry.response, started, paced)
            if entry.state == EntryState.UNKNOWN:
                raise Problem("outcome-unknown", "the first call's outcome is unknown (" +
                              (entry.detail or "ambiguous") + "); an operator must resolve the key")
            if entry.state == EntryState.UNRECORDABLE:
                raise Problem("not-replayable", entry.detail or "the response was too large to record")
            joined = await join_remote(request, self.store, kid, started)
            if joined is not None:
                request[OUTCOME] = Outcome.JOINED
                return joined
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Problem("in-flight", "the first request with this key has not finished",
                              headers={"Retry-After": "1"})
            await self.store.journal.wait(kid, remaining)

    @staticmethod
    async def _until_joinable(call: Call, deadline: float) -> None:
        """A duplicate of a call in flight here waits, within ``in_flight_wait``, for its
        outcome, or for its stream to begin (then it joins the stream live)."""
        async def joinable() -> None:
            await call.headers_ready()
            if not call.streamed:
                await call.finished()
        try:
            await asyncio.wait_for(joinable(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise Problem("in-flight", "the first request with this key has not finished",
                          headers={"Retry-After": "1"}) from None

    def _start(self, request: web.Request, route: Route, entry: Entry, body: bytes,
               namespace: str) -> Call:
        upstream: UpstreamSettings = route.upstream
        call = Call(entry.kid, entry.owner, entry.fingerprint, upstream, self.on_ambiguous[upstream.name],
                    self.settings.server.max_record_bytes)
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
