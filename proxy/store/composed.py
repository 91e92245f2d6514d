"""The whole store contract: each part's hot path (:mod:`.hot_path`) and administration
(:mod:`.administration`) together, and the store that holds them over one connection.

Every backend (sqlite, postgres, redis) implements :class:`Store` and passes the one
contract suite in ``tests/test_store_contract.py``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .administration import Audit, JournalAdmin, RunsAdmin
from .hot_path import JournalPath, RunsPath


@runtime_checkable
class Journal(JournalPath, JournalAdmin, Protocol):
    """Journal entries: claimed, completed or quarantined, replayed, decided, purged."""


@runtime_checkable
class RunRegistry(RunsPath, RunsAdmin, Protocol):
    """Runs: epochs, heartbeats, attempts and ends (SPEC §8)."""


@runtime_checkable
class Store(Protocol):
    """A durable store: its journal, its runs and its audit, sharing one connection."""

    durability: str  # one sentence: how durable an acknowledged record is
    journal: Journal
    runs: RunRegistry
    audit: Audit

    async def open(self, *, migrate: bool = True) -> None:
        """Connect, and bring the schema up to date; ``migrate=False`` writes nothing and
        raises SchemaNotCurrent where the schema is missing or older. Permanent refusals
        raise StoreMisconfigured, everything else that is not reachable StoreUnavailable."""
    async def aclose(self) -> None: """Flush pending work and close."""
    async def ping(self) -> None: """Raise StoreUnavailable unless the store answers."""
    async def secret(self, name: str, generate: bytes) -> bytes: """Get, or set once, a named secret."""
