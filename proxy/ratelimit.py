"""How often one client may try: wrong admin tokens, and registrations of new runs.

Counted in the store (``Audit.count_events``), so the limits hold for every replica and
every worker over that store together: an attacker spreading tries over N replicas gets the
budget once, not N times. Each wrong token or new run costs one small write; a check before
a token is compared or a run registered costs one read; nothing else is counted. A window
is read back as the fixed buckets it overlaps (store/rules.py, EVENT_BUCKETS), so it may
reach up to a sixth of a window further back than ``window`` seconds. Counts expire with
their buckets; nothing is kept in memory. A refusal is 429 ``too-many-requests`` with
``Retry-After``.

A client is the socket's peer; behind ``[server] trusted_proxies`` it is the nearest
address in ``X-Forwarded-For`` that is not one of them (a load balancer's clients are not
one client).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import math
import time
from typing import AsyncIterator, Callable, Iterable

from multidict import CIMultiDictProxy

from .config import AdminSettings
from .problems import Problem
from .store.administration import Audit
from .store.rules import EVENT_BUCKETS

EVERYONE = "*"  # the name of a count over every client


class Counted:
    """At most ``limit`` events per name within ``window`` seconds, for every process.

    A count read and the event it lets through are written one name at a time in this
    process (:meth:`one_at_a_time`): tries sent at once would otherwise each be judged on
    counts that none of them has written yet, and all pass."""

    def __init__(self, audit: Audit, limit: int, window: float):
        self._audit, self.limit, self.window = audit, limit, window
        self._turns: dict[str, list] = {}  # name -> [its lock, callers holding or awaiting it]

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, names: list[str]) -> AsyncIterator[None]:
        """Each name's callers one after another (names locked in sorted order: no cycle); a
        name's lock is forgotten once nobody holds or awaits it, so memory follows the callers."""
        async with contextlib.AsyncExitStack() as stack:
            for name in sorted(set(names)):
                turn = self._turns.setdefault(name, [asyncio.Lock(), 0])
                turn[1] += 1
                stack.callback(self._leave, name, turn)
                await stack.enter_async_context(turn[0])
            yield

    def _leave(self, name: str, turn: list) -> None:
        turn[1] -= 1
        if not turn[1]:
            del self._turns[name]

    async def look(self, name: str, now: float) -> tuple[int, float]:
        """(events of ``name`` within the window, seconds until it may have another: 0 now)."""
        buckets = sorted(await self._audit.events(name, self.window, now))
        count = left = sum(n for _, n in buckets)
        for start, n in buckets:  # the oldest leave the window first
            if left < self.limit:
                break
            left -= n
            if left < self.limit:  # once this bucket has left the window (as events() reads it)
                return count, max(start + self.window * (1 + 1 / EVENT_BUCKETS) - now, 0.001)
        return count, 0.0

    async def add(self, names: list[str], now: float) -> None:
        await self._audit.count_events(names, self.window, now)


def too_many(what: str, wait: float) -> Problem:
    seconds = max(1, math.ceil(wait))
    return Problem("too-many-requests", f"{what}; try again in {seconds} s", headers={"Retry-After": str(seconds)},
                   retry_after=seconds)


class AuthGuard:
    """Wrong admin tokens, from the admin API and the console's login alike: a client past
    ``max_failures`` within ``failure_window`` gets 429 without its token being looked at;
    past ``max_failures_total`` from every client together, so does every client that sent
    a wrong one within the window. A client with no failure is never held up."""

    def __init__(self, settings: AdminSettings, audit: Audit):
        self._clients = Counted(audit, settings.max_failures, settings.failure_window)
        self._everyone = Counted(audit, settings.max_failures_total, settings.failure_window)

    async def check(self, client: str, matches: Callable[[], bool]) -> bool:
        """Whether the token ``matches()``; 429 before it is looked at, for a client that may
        not try now. A wrong one is counted before the client's next try is judged
        (Counted.one_at_a_time); the count over every client may lag by the tries in flight."""
        wrong = _wrong(client)
        async with self._clients.one_at_a_time([wrong]):
            now = time.time()
            failed, wait = await self._clients.look(wrong, now)
            if not wait and failed:
                wait = (await self._everyone.look(_wrong(EVERYONE), now))[1]
            if wait:
                raise too_many("too many wrong admin tokens", wait)
            if matches():
                return True
            await self._clients.add([wrong, _wrong(EVERYONE)], time.time())
            return False


def _wrong(client: str) -> str:
    return f"wrong-token {client}"


def same_token(given: str, token: str) -> bool:
    """In constant time, whatever the lengths: digests are compared, not the strings."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(token.encode()).digest())


class Clients:
    """Who a request's client is, as the counts here take it (see the module docstring)."""

    def __init__(self, trusted_proxies: Iterable[str]):
        self._networks = [ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies]

    def of(self, headers: CIMultiDictProxy[str], peer: str | None) -> str:
        if not self._networks or not _within(peer, self._networks):
            return peer or ""
        hops = [hop.strip() for value in headers.getall("X-Forwarded-For", ()) for hop in value.split(",")]
        for hop in reversed(hops):
            if not _within(hop, self._networks):
                return hop
        return peer or ""


def _within(address: str | None, networks: list) -> bool:
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False
    return any(ip in network for network in networks)
