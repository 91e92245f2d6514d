"""The answer lookup chain of a recorded call: where its journal entry lives (its scope), then
who answers it, first found first: the attempt's journal in memory (replaycache.py), the
complete entries held here (answercache.py), a call in flight in this process (joined), and
the claim, which either wins the key (record.py makes the call) or returns the entry someone
else recorded or is recording. While the key is in flight elsewhere and its stream has not
begun, the request waits for it and looks again, within ``in_flight_wait``."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Awaitable, Callable

from aiohttp import web

from ..answercache import AnswerCache
from ..calls import Call
from ..config import Settings, UpstreamSettings
from ..exchange import Exchange
from ..freshness import Freshness
from ..identity import Identity, TenantResolver
from ..mcp import journaled_path
from ..observability.facts import key_kind
from ..observability.metrics import Metrics
from ..outcomes import Outcome
from ..policy import OnAmbiguous
from ..problems import Problem
from ..replay import in_flight, join_remote, key_reused, listen, outcome_unknown, send_record, whole_record
from ..replaycache import CachedAttempt, ReplayCache
from ..routing import Route
from ..store import Store
from ..store.model import Claim, ClaimResult, Entry, EntryState, Scope
from .fence import Fence
from .intake import tenant_of
from .record import Recorder

# Counts a derived key's occurrence, given the store's count of it (see Lookup.scope)
Occurrence = Callable[[Callable[[], Awaitable[int]]], Awaitable[int]]


class Lookup:
    def __init__(self, settings: Settings, store: Store, tenants: TenantResolver, fence: Fence,
                 replay_cache: ReplayCache, answers: AnswerCache, freshness: Freshness, metrics: Metrics,
                 recorder: Recorder, on_ambiguous: dict[str, OnAmbiguous]):
        self._settings, self._store, self._tenants, self._fence = settings, store, tenants, fence
        self._replay_cache, self._answers, self._freshness = replay_cache, answers, freshness
        self._metrics, self._recorder, self._on_ambiguous = metrics, recorder, on_ambiguous
        self.replays: dict[str, int] = {}  # replay counts not yet stored
        # A claim's owner: this process's random prefix and a count (os.urandom per claim was a
        # syscall per record). Made with the Proxy, in the process that serves: workers differ.
        self._owner = os.urandom(12).hex() + "-"
        self._claims = itertools.count()

    async def answer(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity,
                     body: bytes, fp: str, occurrence: Occurrence | None = None,
                     attempt: CachedAttempt | None = None) -> web.StreamResponse:
        """Claim the key and make the call, or answer from whoever holds it (see above).

        ``fp``: the request's fingerprint (intake.fingerprint_of), or the one an upstream kind
        that knows better what makes two calls the same gives (MCP), with how a derived key's
        occurrence is counted."""
        upstream = route.upstream
        facts = exchange.facts
        since = time.perf_counter()
        scope = await self._scope(request, exchange, route, ident, fp, occurrence, attempt)
        kid = facts.kid = scope.kid
        facts.key_kind = key_kind(scope.key)
        facts.timed(since)
        recorded = attempt.entry(kid) if attempt is not None else None
        if recorded is not None:  # the facts above and _from_journal's answer make its log line
            answer = await self._from_journal(request, exchange, upstream, recorded, fp)
            self._metrics.replayed_from_memory += 1
            return answer
        recorded = self._answers.get(kid)
        if recorded is not None:
            answer = await self._from_journal(request, exchange, upstream, recorded, fp)
            self._metrics.replayed_from_cache += 1
            return answer
        deadline = time.monotonic() + self._settings.server.in_flight_wait
        calls = self._recorder.calls
        while True:
            call = calls.get(kid)
            if call is not None and not call.gave_back:  # in flight here: join it
                if await self._joinable(call, fp, deadline):
                    exchange.outcome = Outcome.JOINED
                    return await listen(request, call, replayed=True)
                continue  # it gave the key back meanwhile: claim it like any retry
            # the claim answers a taken key with its entry: one store call either way
            since = time.perf_counter()
            noted = self._freshness.generation  # before the store call: what it gives may be kept
            result = self._fence.claimed(await self._claim(request, route, ident, scope, fp), ident)
            facts.timed(since)
            if result.won:
                if attempt is not None:  # the attempt goes live: its replays are over
                    self._replay_cache.drop(attempt)
                return await self._recorder.call(request, exchange, route, result.entry, body, noted)
            entry = result.entry
            self._answers.put(entry, noted)
            answer = await self._from_journal(request, exchange, upstream, entry, fp, deadline)
            if answer is not None:
                return answer
            await self._wait(kid, deadline)

    async def flush_replay_counts(self) -> None:
        if self.replays:
            counts, self.replays = self.replays, {}
            await self._store.journal.count_replays(counts)

    async def _scope(self, request: web.Request, exchange: Exchange, route: Route, ident: Identity, fp: str,
                     occurrence: Occurrence | None, attempt: CachedAttempt | None) -> Scope:
        """Where the request's journal entry lives: under the agent's key, its derived key in
        the run (docs/concepts.md, The fingerprint), or its own fingerprint."""
        tenant = tenant_of(self._tenants, request, exchange)
        upstream = route.upstream.name
        if ident.key is not None:
            return Scope.of_key(tenant, ident.run, upstream, ident.key)
        if ident.run is not None:  # counted per tenant: another credential's calls shift nothing
            def count() -> Awaitable[int]:
                return self._fence.occurrence(ident, fp, tenant, attempt)
            n = await (count() if occurrence is None else occurrence(count))
            return Scope(tenant, ident.run, upstream, f"derived:{fp}:{n}")
        # `Idem-Policy: record` with neither key nor run: the request is its own key
        return Scope(tenant, None, upstream, f"fingerprint:{fp}")

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
        store = self._settings.store
        return await self._store.journal.claim(Claim(
            scope=scope, fingerprint=fp, owner=f"{self._owner}{next(self._claims)}", lease_s=store.lease,
            retention_s=store.retention, method=request.method, path=journaled_path(request, route.path),
            epoch=ident.epoch,
            on_expired=self._on_ambiguous[route.upstream.name], namespace=ident.namespace))

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
            self._metrics.saved(upstream, entry.kid, entry.response)
            recorded = exchange.facts.answer = entry.response
            if not recorded.streamed:
                return whole_record(request, recorded)
            paced = request.headers.get("Idem-Replay", "").lower() == "paced"
            return await send_record(request, recorded, paced)
        if state == EntryState.UNKNOWN:
            raise outcome_unknown(entry)
        if state == EntryState.UNRECORDABLE:
            raise Problem("not-replayable", entry.detail or "the response was too large to record")
        joined = await join_remote(request, self._store, entry, deadline)
        if joined is not None:
            exchange.outcome = Outcome.JOINED
        return joined

    async def _wait(self, kid: str, deadline: float) -> None:
        """Until the key changes in the store, within ``in_flight_wait``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise in_flight()
        await self._store.journal.wait(kid, remaining)
