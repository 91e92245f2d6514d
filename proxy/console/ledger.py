"""What each recorded answer cost, and so what its replays saved, for the console.

Nothing about a step's model or tokens is stored apart from its answer: they are read from
the recorded body when a page first needs them (the same ``usage`` fields and prices that
``idemproxy_tokens_saved_total`` counts), then remembered per entry. A recorded body never
changes, so the cache needs no invalidation beyond the entry's identity (kid and creation
time: an expired key claimed again is another entry).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from ..config import Settings
from ..observability.metrics import spend
from ..problems import Problem
from ..runs import RunsService
from ..store.model import Entry, EntryState

CACHE_SIZE = 20_000  # entries whose spend is remembered


@dataclass(frozen=True, slots=True)
class Spend:
    model: str | None
    input_tokens: int
    output_tokens: int
    cost: float | None  # USD at the upstream's configured prices; None: no price configured

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


NOTHING = Spend(None, 0, 0, None)


@dataclass(frozen=True, slots=True)
class Saved:
    """What replays saved: tokens and, where prices are known, dollars."""
    tokens: int = 0
    cost: float = 0.0

    def plus(self, spent: Spend, times: int) -> "Saved":
        return Saved(self.tokens + spent.tokens * times, self.cost + (spent.cost or 0.0) * times)


class Ledger:
    def __init__(self, service: RunsService, settings: Settings):
        self._service = service
        self._settings = settings
        self._known: OrderedDict[tuple[str, float], Spend] = OrderedDict()

    async def spends(self, entries: list[Entry]) -> dict[str, Spend]:
        """The spend of each recorded entry (by kid); bodies are read once per entry."""
        missing = [e for e in entries if e.state == EntryState.COMPLETE and (e.kid, e.created_at) not in self._known]
        await asyncio.gather(*(self._learn(e) for e in missing))
        return {e.kid: self._known.get((e.kid, e.created_at), NOTHING) for e in entries}

    async def saved(self, entries: list[Entry]) -> Saved:
        """What the replays of ``entries`` saved."""
        replayed = [e for e in entries if e.replays]
        spends = await self.spends(replayed)
        total = Saved()
        for entry in replayed:
            total = total.plus(spends[entry.kid], entry.replays)
        return total

    async def _learn(self, listed: Entry) -> None:
        try:
            entry = await self._service.entry(listed.kid)
        except Problem:  # expired or resolved meanwhile: nothing to learn
            return
        if entry.response is None:
            return
        upstream = self._settings.upstreams.get(entry.upstream)
        spent = NOTHING
        if upstream is not None:
            model, tokens, cost = spend(upstream, entry.response)
            spent = Spend(None if model == "unknown" else model,
                          tokens.get("prompt_tokens", tokens.get("input_tokens", 0)),
                          tokens.get("completion_tokens", tokens.get("output_tokens", 0)),
                          cost or None)
        self._known[listed.kid, listed.created_at] = spent
        while len(self._known) > CACHE_SIZE:
            self._known.popitem(last=False)
