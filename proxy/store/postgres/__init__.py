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

from ..composed import Store
from .audit import PostgresAudit
from .connection import PostgresConnection
from .journal import PostgresJournal
from .partitions import Partitions
from .runs import PostgresRuns

__all__ = ["postgres_store"]


def postgres_store(url: str, timeout: float = 5.0, partition_interval: float = 86400.0,
                   retention: float = 7 * 86400.0) -> Store:
    """The journal, the runs and the secrets in PostgreSQL; see the module docstring."""
    connection = PostgresConnection(url, timeout)
    journal = PostgresJournal(connection, Partitions(connection, partition_interval, retention))
    return Store(connection, journal, PostgresRuns(connection), PostgresAudit(connection))
