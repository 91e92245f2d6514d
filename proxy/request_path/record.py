"""A won claim's call: the upstream call runs as its own task, so that it outlives its agent
(calls.py); the agent and any duplicate that joins are its listeners. Its lease on the key is
renewed while it is in flight, and a proxy shutting down lets its calls finish and record."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from ..answercache import AnswerCache
from ..calls import Call, Fate
from ..config import Settings
from ..exchange import Exchange
from ..forward import forwarded_key, request_headers
from ..forwarded import Forwarding
from ..heartbeats import Heartbeats
from ..mcp import ToolAnswer
from ..outcomes import Outcome
from ..policy import OnAmbiguous
from ..replay import listen
from ..routing import Route
from ..store import Store, StoreUnavailable
from ..store.model import Entry, EntryState
from ..upstream.pool import UpstreamPool

log = logging.getLogger("idemproxy.proxy")


class Recorder:
    def __init__(self, settings: Settings, store: Store, pools: dict[str, UpstreamPool],
                 heartbeats: Heartbeats, forwarding: Forwarding, answers: AnswerCache,
                 on_ambiguous: dict[str, OnAmbiguous], calls: dict[str, Call]):
        self._settings, self._store, self._pools = settings, store, pools
        self._heartbeats, self._forwarding, self._answers = heartbeats, forwarding, answers
        self._on_ambiguous = on_ambiguous
        self.calls = calls  # recorded calls in flight here, by kid
        self.tasks: set[asyncio.Task] = set()

    async def call(self, request: web.Request, exchange: Exchange, route: Route, entry: Entry, body: bytes,
                   noted: int | None) -> web.StreamResponse:
        """The key is ours: make the call, and answer as it goes. ``noted``: the journal's
        generation before the claim, under which its record may be kept in memory."""
        exchange.outcome = Outcome.RECORDED
        call = self._start(request, route, entry, body, exchange.ident.namespace, noted)
        try:
            return await listen(request, call, replayed=False)
        finally:
            exchange.upstream_s = call.upstream_s if call.status else None
            exchange.facts.answer = call.answer

    def _start(self, request: web.Request, route: Route, entry: Entry, body: bytes,
               namespace: str, noted: int | None) -> Call:
        upstream = route.upstream
        settings = self._settings
        call = Call(kid=entry.kid, owner=entry.owner, fingerprint=entry.fingerprint, upstream=upstream,
                    on_ambiguous=self._on_ambiguous[upstream.name],
                    max_record_bytes=settings.server.max_record_bytes,
                    max_record_seconds=settings.server.max_record_seconds,
                    max_evidence_bytes=settings.server.max_evidence_bytes,
                    credential_headers=settings.tenants.credential_headers,
                    reader=ToolAnswer() if upstream.kind == "mcp" else None)
        headers = request_headers(request.headers, upstream, settings.tenants.header,
                                  forwarded_key(entry.kid) if upstream.idempotency_header else None,
                                  self._forwarding.headers(request.headers, request.remote))
        heartbeats = self._heartbeats
        beat = (lambda: heartbeats.beat(namespace, entry.run, entry.epoch)) if entry.run else (lambda: None)
        # the entry's tenant, worked out once for its key (lookup.py), is whose connections it uses
        task = asyncio.create_task(call.run(self._pools[upstream.name], entry.tenant, self._store, request.method,
                                            route.path_qs, headers, body, beat))
        self.calls[entry.kid] = call
        self.tasks.add(task)

        def done(_):
            self.tasks.discard(task)
            if self.calls.get(entry.kid) is call:  # not a later claim's call of the key it gave back
                del self.calls[entry.kid]
            if call.result is not None and call.result.fate is Fate.RECORDED:  # committed: as the store has it
                # the claim's entry is this call's alone: made complete in place, not copied
                entry.state, entry.owner, entry.response = EntryState.COMPLETE, None, call.answer
                entry.completed_at = time.time()
                self._answers.put(entry, noted)
        task.add_done_callback(done)
        return call

    async def renew_leases(self) -> None:
        """Keep this proxy's claims alive while their calls are in flight."""
        lease = self._settings.store.lease
        while True:
            await asyncio.sleep(lease / 3)
            for call in list(self.calls.values()):
                try:
                    if not await self._store.journal.renew(call.kid, call.owner, lease):
                        log.warning("lost the lease on %s", call.kid[:12])
                except StoreUnavailable as exc:
                    log.warning("lease renewal failed: %s", exc)
                except Exception:  # noqa: BLE001 - a dead renewer would let claims lapse mid-call
                    log.exception("lease renewal of %s failed", call.kid[:12])

    async def drain(self, timeout: float) -> None:
        """On shutdown: let recorded calls in flight finish and record."""
        if self.tasks:
            log.info("waiting up to %.0fs for %d call(s) in flight", timeout, len(self.tasks))
            await asyncio.wait(list(self.tasks), timeout=timeout)
