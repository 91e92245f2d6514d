"""Replay in one read: a restarted attempt's replays answered from memory.

A new attempt of a run (epoch > 0) usually begins by replaying what the attempt before it
did: hundreds of calls, each a store round trip or two. On the attempt's first recorded
request here, the proxy loads the run's complete journal entries in one read
(``Journal.recorded``) and answers the attempt's replays from them.

Why an entry in memory answers as the store would (what docs/concepts.md promises):

- Only COMPLETE entries are loaded, and a complete entry never changes until it expires
  or its run's journal is deleted: resolve changes quarantined entries only, release and
  takeovers in-flight ones. Expiry is checked against ``expires_at`` at each use.
- A deleted journal is seen everywhere before the delete answers: the attempts held
  answer under the lease of proxy/freshness.py, as the answer cache does, and are all
  dropped when the journal's generation changes.
- Fencing and derived keys' occurrence numbers still come from the store, one round trip
  per call (``Journal.replay_occurrence``): exact across replicas and workers. Counting
  them in memory would need the store to grant one process an attempt's counters, take
  them back when another process serves the same attempt (a lease and its revocation),
  and lose the attempt when a holder dies with counts it had not written; that round
  trip is most of what a replayed call costs on PostgreSQL and Redis (docs/concepts.md,
  "Replays from memory").

The memory is bounded by ``[store] replay_cache_bytes`` (recorded bodies, all attempts
together), and an attempt's entries are dropped when it goes live (its first call that
is claimed), after ``replay_cache_ttl``, or when the run moves to another epoch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from .freshness import Freshness
from .store import StoreUnavailable
from .store.hot_path import JournalPath
from .store.model import Entry

log = logging.getLogger("idemproxy.proxy")

SEEN_LIMIT = 50_000  # attempts remembered as loaded once already, so a live one is not loaded again

AttemptKey = tuple[str, str, int]  # (namespace, run, epoch)


@dataclass(slots=True)
class CachedAttempt:
    """The recorded entries of one attempt's run, loaded at ``loaded_at`` (monotonic)."""
    key: AttemptKey
    entries: dict[str, Entry]
    size: int
    loaded_at: float

    def entry(self, kid: str) -> Entry | None:
        """The recorded entry ``kid``, unless it has expired since it was loaded."""
        entry = self.entries.get(kid)
        return entry if entry is not None and entry.expires_at > time.time() else None


class ReplayCache:
    """Attempts' recorded entries in this process; see the module docstring."""

    def __init__(self, journal: JournalPath, freshness: Freshness, max_bytes: int, ttl_s: float):
        self._journal = journal
        self._freshness = freshness
        self._max_bytes = max_bytes
        self._ttl_s = ttl_s
        self._attempts: dict[AttemptKey, CachedAttempt] = {}
        self._loading: dict[AttemptKey, asyncio.Future] = {}
        self._seen: OrderedDict[AttemptKey, None] = OrderedDict()
        self._used = 0  # bytes of the bodies held
        self.loads = 0  # attempts loaded (for /metrics)
        freshness.on_change(self.clear)

    def get(self, namespace: str, run: str, epoch: int | None) -> CachedAttempt | None:
        """The attempt's entries while they are fresh and memory may answer (freshness.py); a
        dict lookup for every other request."""
        attempt = self._attempts.get((namespace, run, epoch))  # type: ignore[arg-type]
        if attempt is None or not self._freshness.fresh():
            return None
        if time.monotonic() - attempt.loaded_at > self._ttl_s:
            self.drop(attempt)
            return None
        return attempt

    def wanted(self, namespace: str, run: str, epoch: int | None) -> bool:
        """Whether a request of this attempt should load its entries: an attempt after the
        first, not loaded here before, while there is room."""
        return (epoch is not None and epoch > 0 and self._max_bytes > 0 and self._freshness.lease_s > 0
                and (namespace, run, epoch) not in self._seen)

    async def load(self, namespace: str, run: str, epoch: int) -> CachedAttempt | None:
        """Load the attempt's entries once (requests arriving together share the read)."""
        key = (namespace, run, epoch)
        loading = self._loading.get(key)
        if loading is None:
            loading = self._loading[key] = asyncio.ensure_future(self._load(key))
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(loading)

    async def _load(self, key: AttemptKey) -> CachedAttempt | None:
        self._sweep()
        room = self._max_bytes - self._used
        namespace, run, epoch = key
        if room <= 0:  # full: this attempt replays through the store
            self._remember(key)
            return None
        noted = self._freshness.generation
        if noted is None:  # no look at the generation yet (the store was down at start): later
            return None
        try:
            # the oldest entries that fit: a replay goes in order, the rest from the store
            entries, _ = await self._journal.recorded(namespace, run, room)
        except StoreUnavailable as exc:  # the request goes on through the store, which says how
            log.warning("recorded entries of run %s not loaded: %s", run, exc)
            return None
        if not self._freshness.current(noted):  # a journal deleted meanwhile: later
            return None
        self._remember(key)
        for other in [a for a in self._attempts.values() if a.key[:2] == key[:2] and a.key[2] < epoch]:
            self.drop(other)  # a superseded attempt of the same run
        if not entries:
            return None
        size = sum(len(e.response.body) for e in entries.values() if e.response is not None)
        attempt = self._attempts[key] = CachedAttempt(key, entries, size, time.monotonic())
        self._used += size
        self.loads += 1
        return attempt

    def drop(self, attempt: CachedAttempt) -> None:
        """Let go of an attempt's entries (it went live, or they are stale)."""
        if self._attempts.get(attempt.key) is attempt:
            del self._attempts[attempt.key]
            self._used -= attempt.size

    def clear(self) -> None:
        """A journal was deleted somewhere: let go of every attempt (an attempt seen already
        replays through the store from now on)."""
        self._attempts.clear()
        self._used = 0

    def _remember(self, key: AttemptKey) -> None:
        self._seen[key] = None
        if len(self._seen) > SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _sweep(self) -> None:
        """Drop stale attempts, so those no request comes back for free their room too."""
        now = time.monotonic()
        for attempt in [a for a in self._attempts.values() if now - a.loaded_at > self._ttl_s]:
            self.drop(attempt)
