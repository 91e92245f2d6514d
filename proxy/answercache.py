"""Replays from memory: complete journal entries this process recorded or read.

A replay otherwise costs a store round trip (a read, or on PostgreSQL a claim that answers
a taken key with its entry): most of what it costs, against a provider that answers fast.
This process keeps the complete entries it recorded, and those a store read or claim gave
it, and answers repeats of their keys from them.

Why an entry in memory answers as the store would:

- Only COMPLETE entries are held, with their response; never in-flight, quarantined or
  unrecordable ones. A complete entry never changes until it expires or is deleted: a
  resolve changes quarantined entries only, release and takeovers in-flight ones, and a
  takeover of an expired entry is an expiry. Expiry is checked against ``expires_at`` at
  each use.
- A delete is seen everywhere before it answers: proxy/freshness.py, whose lease this
  memory answers under.
- The answer goes through the same code as a store's entry (``Proxy._from_journal``): a
  different request under the key still gets 422, replays are still counted and priced.

Bounded by ``[store] answer_cache_bytes`` (bodies, headers and ENTRY_OVERHEAD each),
least recently used first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from .freshness import Freshness
from .store.model import Entry, EntryState

ENTRY_OVERHEAD = 512  # bytes an entry costs in memory besides its body and headers (its fields)


class AnswerCache:
    """Complete entries by kid, least recently used first; see the module docstring."""

    def __init__(self, freshness: Freshness, max_bytes: int):
        self._freshness = freshness
        self._max_bytes = max_bytes
        self._held: OrderedDict[str, tuple[Entry, int]] = OrderedDict()  # kid -> (entry, size)
        self.used = 0  # bytes held, as counted against max_bytes
        freshness.on_change(self.clear)

    def __len__(self) -> int:
        return len(self._held)

    def get(self, kid: str) -> Entry | None:
        """The complete entry ``kid``, while memory may answer and it has not expired."""
        held = self._held.get(kid)
        if held is None or not self._freshness.fresh():
            return None
        entry = held[0]
        if entry.expires_at <= time.time():
            self._drop(kid)
            return None
        self._held.move_to_end(kid)
        return entry

    def put(self, entry: Entry, noted: int | None) -> None:
        """Hold ``entry`` if it is complete and was read (or recorded) after the generation
        ``noted`` was, which is still current; evict the least recently used past the bound."""
        recorded = entry.response
        if entry.state != EntryState.COMPLETE or recorded is None or not self._freshness.current(noted):
            return
        size = ENTRY_OVERHEAD + len(recorded.body) + sum(len(k) + len(v) for k, v in recorded.headers)
        if size > self._max_bytes:
            return
        self._drop(entry.kid)
        self._held[entry.kid] = (entry, size)
        self.used += size
        while self.used > self._max_bytes:
            _, (_, evicted) = self._held.popitem(last=False)
            self.used -= evicted

    def clear(self) -> None:
        self._held.clear()
        self.used = 0

    def _drop(self, kid: str) -> None:
        held = self._held.pop(kid, None)
        if held is not None:
            self.used -= held[1]
