"""The whole store: each part's hot path (:mod:`.hot_path`) and administration
(:mod:`.administration`) together, and :class:`Store`, which composes a backend's parts.

A backend package gives only its parts, over one connection of its own; the store is the
same for all three (``sqlite_store``, ``postgres_store``, ``redis_store`` build it). Every
backend passes the one contract suite in ``tests/store/test_store_contract.py``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .administration import Audit, JournalAdmin, RunsAdmin
from .hot_path import JournalPath, RunsPath


@runtime_checkable
class Journal(JournalPath, JournalAdmin, Protocol):
    """Journal entries: claimed, completed or quarantined, replayed, decided, purged."""

    async def opened(self, migrate: bool) -> None:
        """Once the connection is open: what the journal prepares before its first call
        (``migrate=False``: reads only)."""
    async def aclose(self) -> None: """Send what is queued; the connection is still open."""


@runtime_checkable
class RunRegistry(RunsPath, RunsAdmin, Protocol):
    """Runs: epochs, heartbeats, attempts and ends (docs/restarts.md)."""


@runtime_checkable
class Connection(Protocol):
    """A backend's connection (a file, a pool, a client), shared by its journal, runs and audit."""

    durability: str  # one sentence: how durable an acknowledged record is

    async def open(self, migrate: bool) -> None: """See :meth:`Store.open`."""
    async def aclose(self) -> None: """Write what is queued, and close."""
    async def ping(self) -> None: """Raise StoreUnavailable unless the store answers."""
    async def secret(self, name: str, generate: bytes) -> bytes: """Get, or set once, a named secret."""


class Store:
    """A durable store: a backend's connection, and its journal, runs and audit over it."""

    def __init__(self, connection: Connection, journal: Journal, runs: RunRegistry, audit: Audit):
        self.connection = connection
        self.journal = journal
        self.runs = runs
        self.audit = audit

    def __repr__(self) -> str:
        return f"Store({self.connection!r})"

    @property
    def durability(self) -> str:
        """One sentence: how durable an acknowledged record is (known once open)."""
        return self.connection.durability

    async def open(self, *, migrate: bool = True) -> None:
        """Connect, and bring the schema up to date; ``migrate=False`` writes nothing and
        raises SchemaNotCurrent where the schema is missing or older. Permanent refusals
        raise StoreMisconfigured, everything else that is not reachable StoreUnavailable."""
        await self.connection.open(migrate)
        await self.journal.opened(migrate)

    async def aclose(self) -> None:
        """Flush pending work and close: the journal's queued records before the connection."""
        await self.journal.aclose()
        await self.connection.aclose()

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers."""
        await self.connection.ping()

    async def secret(self, name: str, generate: bytes) -> bytes:
        """Get, or set once, a named secret."""
        return await self.connection.secret(name, generate)
