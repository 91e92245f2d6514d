"""PostgreSQL store: the production store of record (``postgresql://user@host/db``).

Our own URL parameters, removed before the DSN reaches asyncpg: ``schema=NAME`` keeps
the tables in that schema (created if missing; default ``public``) and ``pool_size=N``
caps the connection pool (default 32: fewer connections than concurrent requests made
requests queue for a connection, with p99 in seconds at 32 concurrent in bench/).

- :mod:`.connection`: the pool, the connections kept for batches and the LISTEN
  connection, shared by the journal and the runs; driver errors become StoreUnavailable.
- :mod:`.schema`: numbered migrations, recorded in ``schema_migrations``; they run at
  start in one transaction under ``pg_advisory_xact_lock``, so many replicas can start
  at once.
- :mod:`.sql`: the statements; :mod:`.journal`, :mod:`.runs`: the two halves of the
  store contract over the connection; :mod:`.audit`: operator actions.
- :mod:`.partitioned`, :mod:`.partitions`: the journal partitioned by expiry, its ranges
  created ahead and dropped whole (``[store] partition_interval``).
"""

from __future__ import annotations

import time

from ...config import mask_url
from . import sql
from .audit import PostgresAudit
from .connection import PostgresConnection
from .journal import PostgresJournal
from .partitions import Partitions
from .runs import PostgresRuns

__all__ = ["PostgresStore"]


class PostgresStore:
    """The journal, the runs and the secrets in PostgreSQL; see the module docstring."""

    def __init__(self, url: str, timeout: float = 5.0, partition_interval: float = 86400.0,
                 retention: float = 7 * 86400.0):
        self.url = url
        self.connection = PostgresConnection(url, timeout)
        self.journal = PostgresJournal(self.connection, Partitions(self.connection, partition_interval, retention))
        self.runs = PostgresRuns(self.connection)
        self.audit = PostgresAudit(self.connection)

    def __repr__(self) -> str:
        return f"PostgresStore({mask_url(self.url)!r})"

    @property
    def durability(self) -> str:
        return self.connection.durability

    async def open(self, *, migrate: bool = True) -> None:
        await self.connection.open(migrate)
        if migrate:  # the ranges the next claims need; told not to migrate, the store writes nothing
            await self.journal.partitions.prepare(time.time())
        else:
            await self.journal.partitions.refresh()

    async def aclose(self) -> None:
        await self.journal.aclose()
        await self.connection.aclose()

    async def ping(self) -> None:
        await self.connection.use("ping", lambda c: c.fetchval("SELECT 1"))

    async def secret(self, name: str, generate: bytes) -> bytes:
        return (await self.connection.fetchrow("secret", sql.SECRET, name, generate))[0]
