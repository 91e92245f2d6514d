"""When entries held in memory may answer: the journal's generation, read under a lease.

A proxy keeps complete journal entries in memory (proxy/answercache.py, and a restarted
attempt's journal, proxy/replaycache.py). A complete entry changes only by expiring
(checked at each use) or by being deleted (``Journal.delete_run``: the admin API, the
console). Every replica and worker process must stop answering a deleted entry once the
delete has answered. The rule that makes it so:

- Every delete raises the journal's generation (a row in SQLite and PostgreSQL, a key in
  Redis) in the same transaction as the delete, then waits ``[store] cache_lease`` (W)
  before it answers (``RunsService.delete_journal``).
- Each process reads the generation every W/3 (:meth:`Freshness.run`). Its memory answers
  only while its last successful read *started* less than W ago (monotonic clock, taken
  before the read is sent), and only with entries filled under the generation that read
  saw: a new generation drops everything held (deletes are rare).
- A fill notes the generation before the store call that produced the entry, and is kept
  only if the generation is still the same (a delete in between raised it).

So after a delete has answered, a process answering from memory has read the generation
after the delete committed (its lease is younger than W), has seen the new generation and
dropped what it held, and every entry filled since was read after the delete. When the store
cannot be reached the reads fail, the lease lapses within W, and requests go to the store
(which answers 503 as it does without memory).

What it does not see: a change made in the store by hand (SQL, redis-cli) without raising
the generation, a store restored from a backup or a Redis that lost its data, and Redis
evicting keys under ``maxmemory`` (a journal must not be evicted anyway). docs/concepts.md
("Replays from memory") says how to raise the generation by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from .store import StoreUnavailable
from .store.hot_path import JournalPath

log = logging.getLogger("idemproxy.proxy")


class Freshness:
    """This process's view of the journal's generation, and how long it holds."""

    def __init__(self, journal: JournalPath, lease_s: float):
        self._journal = journal
        self.lease_s = lease_s
        self.generation: int | None = None  # None until the first read
        self._fresh_until = 0.0  # time.monotonic() when the last read's lease ends
        self._sent = float("-inf")  # time.monotonic() when the read that set it was sent
        self._on_change: list[Callable[[], None]] = []
        self._failing = False  # the last read failed (logged once per outage)

    def on_change(self, drop: Callable[[], None]) -> None:
        """Call ``drop`` when the generation changes: what was held may have been deleted."""
        self._on_change.append(drop)

    def fresh(self) -> bool:
        """Whether memory may answer now (see the module docstring)."""
        return time.monotonic() < self._fresh_until

    def current(self, noted: int | None) -> bool:
        """Whether an entry read after noting ``noted`` may be kept: nothing was deleted since."""
        return noted is not None and noted == self.generation

    async def look(self) -> None:
        """Read the generation; on a change, drop what is held before anything answers again."""
        started = time.monotonic()  # before the read is sent: the lease errs short, never long
        generation = await self._journal.generation()
        if started < self._sent:  # a look sent later has answered already: this one is older news
            return
        self._sent = started
        if generation != self.generation:
            if self.generation is not None:
                log.info("journal generation %d -> %d: entries held in memory dropped",
                         self.generation, generation)
            for drop in self._on_change:
                drop()
            self.generation = generation
        self._fresh_until = started + self.lease_s

    async def run(self) -> None:
        """Look every lease/3, so a slow or failed read or two leave the lease standing."""
        while True:
            try:
                await self.look()
                if self._failing:
                    log.info("journal generation readable again: memory answers again")
                self._failing = False
            except StoreUnavailable as exc:
                if not self._failing:
                    log.warning("journal generation not readable (%s): memory stops answering "
                                "within %.1fs", exc, self.lease_s)
                self._failing = True
            except Exception:  # noqa: BLE001 - a dead loop would only let the lease lapse for good
                log.exception("reading the journal generation failed")
            await asyncio.sleep(self.lease_s / 3)
