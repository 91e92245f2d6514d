"""Wake-up primitives: how a caller in this process learns, without polling, that a journal
entry changed (:class:`Waiters`) or that an attempt was marked lost (:class:`Bell`). The
backends ring them on their own writes and on what they hear from other processes (NOTIFY,
pub/sub); a lost notification costs a poll, never a hang.
"""

from __future__ import annotations

import asyncio

# The word the postgres and redis stores broadcast on their channel when an attempt is
# marked lost; never a kid (those are hex), so it needs no channel of its own.
RUN_LOST = "run-lost"


class Bell:
    """Rung when an attempt is marked lost, by this process or (heard through NOTIFY or
    pub/sub) another one; a supervisor waiting on it ticks at once. It stays rung until
    someone has waited on it, so a ring during a tick is not lost."""

    def __init__(self) -> None:
        self._rung = asyncio.Event()

    def ring(self) -> None:
        self._rung.set()

    async def wait(self, timeout: float) -> bool:
        """True once rung (and unrung again), False after ``timeout``."""
        try:
            await asyncio.wait_for(self._rung.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        self._rung.clear()
        return True



class Waiters:
    """Callers waiting in this process for a journal entry to change.

    A backend calls :meth:`wake` when it learns of a change (its own write, a NOTIFY, a
    pub/sub message); :meth:`wait` also returns after ``poll_s``, so a lost notification
    costs a poll, never a hang. An event lives only while someone waits on it.
    """

    def __init__(self, poll_s: float):
        self.poll_s = poll_s
        self._events: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}

    def wake(self, kid: str) -> None:
        event = self._events.pop(kid, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def wait(self, kid: str, timeout: float) -> None:
        event = self._events.get(kid)
        if event is None:
            event = self._events[kid] = asyncio.Event()
        self._waiting[kid] = self._waiting.get(kid, 0) + 1
        try:
            await asyncio.wait_for(event.wait(), min(timeout, self.poll_s))
        except asyncio.TimeoutError:
            pass
        finally:
            left = self._waiting.pop(kid) - 1
            if left:
                self._waiting[kid] = left
            elif self._events.get(kid) is event:
                del self._events[kid]
