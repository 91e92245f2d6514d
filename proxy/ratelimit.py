"""How often one client may try: wrong admin tokens, and registrations of new runs.

Counted in each process's memory (every replica keeps its own counts), over a sliding
window, in bounded memory: a client is forgotten once its window has passed, and past
MAX_CLIENTS the ones seen longest ago go first. A refusal is 429 ``too-many-requests``
with ``Retry-After``.

A client is the socket's peer; behind ``[server] trusted_proxies`` it is the nearest
address in ``X-Forwarded-For`` that is not one of them (a load balancer's clients are not
one client).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import time
from collections import deque
from typing import Iterable

from multidict import CIMultiDictProxy

from .config import AdminSettings
from .problems import Problem

MAX_CLIENTS = 10_000  # clients remembered per counter
ANYONE = ""  # the key of a counter over every client


class Window:
    """At most ``limit`` events per key within ``window`` seconds."""

    def __init__(self, limit: int, window: float):
        self.limit, self.window = limit, window
        self._times: dict[str, deque[float]] = {}

    def wait(self, key: str, now: float) -> float:
        """Seconds until ``key`` may have another event; 0 now."""
        times = self._times.get(key)
        if times is None:
            return 0.0
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self._times[key]
            return 0.0
        return times[0] + self.window - now if len(times) >= self.limit else 0.0

    def seen(self, key: str, now: float) -> bool:
        """Whether ``key`` had an event within the window."""
        self.wait(key, now)
        return key in self._times

    def add(self, key: str, now: float) -> None:
        times = self._times.pop(key, None) or deque(maxlen=self.limit)
        times.append(now)
        self._times[key] = times  # last in the dict: the most recently seen
        if len(self._times) > MAX_CLIENTS:
            del self._times[next(iter(self._times))]


def too_many(what: str, wait: float) -> Problem:
    seconds = max(1, math.ceil(wait))
    return Problem("too-many-requests", f"{what}; try again in {seconds} s", headers={"Retry-After": str(seconds)},
                   retry_after=seconds)


class AuthGuard:
    """Wrong admin tokens, from the admin API and the console's login alike: a client past
    ``max_failures`` within ``failure_window`` gets 429 without its token being looked at;
    past ``max_failures_total`` from every client together, so does every client that sent
    a wrong one within the window. A client with no failure is never held up."""

    def __init__(self, settings: AdminSettings):
        self._clients = Window(settings.max_failures, settings.failure_window)
        self._everyone = Window(settings.max_failures_total, settings.failure_window)

    def admit(self, client: str) -> None:
        """Raise 429 before a token is compared, for a client that may not try now."""
        now = time.monotonic()
        wait = self._clients.wait(client, now)
        if not wait and self._clients.seen(client, now):
            wait = self._everyone.wait(ANYONE, now)
        if wait:
            raise too_many("too many wrong admin tokens", wait)

    def failed(self, client: str) -> None:
        now = time.monotonic()
        self._clients.add(client, now)
        self._everyone.add(ANYONE, now)


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
