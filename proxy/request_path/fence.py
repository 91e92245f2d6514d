"""Fencing: a request of a superseded attempt (a zombie) is refused before anything is forwarded.

A run-scoped request names its run and, usually, its attempt's epoch. The store keeps each
run's current epoch; a request of an older epoch gets 412 ``stale-epoch``, one further than
the next gets 409 ``epoch-ahead``, and the first request of a run registers it with the
``[runs]`` defaults. A request that passes is the run's heartbeat.

Where a request is fenced is decided here and nowhere else, once per request:

- a passthrough: before it is forwarded; when the store is down it goes on unfenced (it
  records nothing);
- a recorded call with the agent's own key, or in an attempt whose journal is not in memory:
  before its key is looked up (:meth:`Fence.enter`);
- a recorded call with a derived key in an attempt whose journal is in memory: with its
  occurrence, in the same store round trip (:meth:`Fence.occurrence`);
- a request to an MCP upstream: always first, since a re-issued tools/call takes its occurrence
  from memory, without the store (:meth:`Fence.enter_mcp`);
- and by the claim itself, which answers ``stale_epoch`` when a restart moved the run on
  between the fence and the claim (:meth:`Fence.claimed`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from ..config import Settings
from ..heartbeats import Heartbeats
from ..identity import Identity
from ..observability.facts import Facts
from ..problems import Problem
from ..replaycache import CachedAttempt, ReplayCache
from ..runs.endings import superseded_ending
from ..store import Store, StoreUnavailable
from ..store.model import ClaimResult, Run

log = logging.getLogger("idemproxy.proxy")


class Fence:
    def __init__(self, settings: Settings, store: Store, heartbeats: Heartbeats, replay_cache: ReplayCache):
        self._settings, self._store, self._heartbeats = settings, store, heartbeats
        self._replay_cache = replay_cache  # restarted attempts' journals, in memory
        self._epoch_reads: dict[tuple, asyncio.Future] = {}  # shared by the requests of one attempt

    # -- where: the request path asks here, at each of its steps ---------------------------------

    async def enter(self, request: web.Request, ident: Identity, recorded: bool,
                    facts: Facts) -> CachedAttempt | None:
        """A run's request, before anything else is done with it: fenced, unless it is a recorded
        call with a derived key in an attempt whose journal is in memory (fenced with its
        occurrence). For a recorded call, its attempt's journal in memory, loaded here by the
        attempt's first request that wants it. The request holds its run alive while open."""
        since = time.perf_counter()
        attempt = None
        if not recorded:
            await self.check(ident, fail_open=True)
        else:
            attempt = self._replay_cache.get(ident.namespace, ident.run, ident.epoch)
            if attempt is None or ident.key is not None:
                await self.check(ident, fail_open=False)
            if attempt is None:
                attempt = await self._load_attempt(ident)
        facts.timed(since)
        self._heartbeats.hold(request, ident)  # open, its run is alive (docs/restarts.md)
        return attempt

    async def enter_mcp(self, request: web.Request, ident: Identity, recorded: Identity | None,
                        facts: Facts) -> CachedAttempt | None:
        """An MCP upstream's request of a run: fenced first, always (a re-issued tools/call takes
        its occurrence without the store, mcp/occurrences.py, so that round trip cannot be the
        fence). ``recorded``: a tools/call's identity, whose attempt's journal in memory is
        returned."""
        since = time.perf_counter()
        await self.check(ident, fail_open=recorded is None)
        self._heartbeats.hold(request, ident)
        attempt = None
        if recorded is not None:  # a restarted attempt's replays come from its journal in memory
            attempt = self._replay_cache.get(recorded.namespace, recorded.run, recorded.epoch)
            if attempt is None:
                attempt = await self._load_attempt(recorded)
        facts.timed(since)
        return attempt

    async def occurrence(self, ident: Identity, fp: str, tenant: str, attempt: CachedAttempt | None) -> int:
        """The derived key's occurrence number among ``tenant``'s calls alike; in an attempt whose
        journal is in memory, fenced in the same step."""
        journal, retention = self._store.journal, self._settings.store.retention
        if attempt is not None:
            n = await journal.replay_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention,
                                                tenant=tenant)
            if n is not None:
                self._heartbeats.beat(ident.namespace, ident.run, ident.epoch)
                return n
            # the run is no longer at this epoch: the fence says how (412 for a superseded attempt)
            self._replay_cache.drop(attempt)
            await self.check(ident, fail_open=False)
        return await journal.next_occurrence(ident.namespace, ident.run, ident.epoch, fp, retention, tenant=tenant)

    @staticmethod
    def claimed(result: ClaimResult, ident: Identity) -> ClaimResult:
        """The claim's own fence: a restart moved the run on since the request was fenced."""
        if result.stale_epoch is not None:
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {result.stale_epoch}",
                          epoch=result.stale_epoch)
        return result

    async def _load_attempt(self, ident: Identity) -> CachedAttempt | None:
        """Load the attempt's journal, if this request should (ReplayCache.wanted): none held yet."""
        cache = self._replay_cache
        if not cache.wanted(ident.namespace, ident.run, ident.epoch):
            return None
        return await cache.load(ident.namespace, ident.run, ident.epoch)

    # -- how: the run's epoch in the store -------------------------------------------------------

    async def check(self, ident: Identity, fail_open: bool) -> None:
        """Refuse a superseded attempt, or one ahead of the run.

        A passthrough request records nothing, so when the store is down it goes on
        unfenced (``fail_open``; docs/guarantees.md, "Fail closed"); a record request fails
        closed.
        """
        try:
            current = await self._observe_epoch(ident)
        except StoreUnavailable:
            if not fail_open:
                raise
            log.warning("store unavailable: passthrough for run %s forwarded unfenced", ident.run)
            return
        if ident.epoch is not None and ident.epoch < current:
            raise Problem("stale-epoch", f"run {ident.run} is at epoch {current}; this attempt "
                          f"(epoch {ident.epoch}) has been superseded", epoch=current)
        if ident.epoch is not None and ident.epoch > current:  # the store raises it by one at most
            raise Problem("epoch-ahead", f"run {ident.run} is at epoch {current}; a request may start "
                          f"epoch {current + 1} at most, not {ident.epoch} (POST /runs/{ident.run}/attempts "
                          "starts the next attempt)", epoch=current)
        self._heartbeats.beat(ident.namespace, ident.run, ident.epoch)  # a fenced zombie is no sign of life

    async def _observe_epoch(self, ident: Identity) -> int:
        """The run's current epoch. Requests of one attempt that arrive together share one
        store call (in flight for a round trip), so a busy run costs the store one read per
        round trip, not one per request; only that call needs the run's defaults (a run
        seen first is registered with them)."""
        key = (ident.namespace, ident.run, ident.epoch)
        shared = self._epoch_reads.get(key)
        if shared is None:
            shared = self._epoch_reads[key] = asyncio.ensure_future(self._store.runs.observe_epoch(
                ident.namespace, ident.run, ident.epoch, self._defaults(ident), time.time(),
                ended=None if ident.epoch is None else superseded_ending(by_request=ident.epoch)))
            shared.add_done_callback(lambda _: self._epoch_reads.pop(key, None))
        return await asyncio.shield(shared)

    def _defaults(self, ident: Identity) -> Run:
        runs = self._settings.runs
        # traffic arms no hook by itself: the [runs] hook only where its tenants may (README)
        return Run(ident.namespace, ident.run, timeout_s=runs.timeout_s, grace_s=runs.grace_s,
                   max_restarts=runs.max_restarts, hook=self._settings.default_hook(ident.namespace))
