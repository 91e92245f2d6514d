"""SQLite store: the embedded default (``sqlite:///path/to/file.db``).

Durability: WAL with ``synchronous=FULL``, so a commit is fsynced before it returns.

- :mod:`.connection`: the reader and the group-committing writer (its fsyncs waited for on
  a thread of its own, :mod:`.disk`), shared by the journal and the runs; sqlite3's errors
  become StoreUnavailable.
- :mod:`.schema`: the tables, and the upgrades of an older file, run at open.
- :mod:`.journal`, :mod:`.runs`: the two halves of the store contract over that connection;
  :mod:`.audit`: operator actions.
"""

from __future__ import annotations

from .audit import SQLiteAudit
from .connection import SQLiteConnection
from .journal import SQLiteJournal
from .runs import SQLiteRuns

__all__ = ["SQLiteStore"]


class SQLiteStore:
    """The journal, the runs and the secrets in one SQLite file; see the module docstring."""

    def __init__(self, path: str, timeout: float = 5.0):
        self.path = path
        self.connection = SQLiteConnection(path, timeout)
        self.journal = SQLiteJournal(self.connection)
        self.runs = SQLiteRuns(self.connection)
        self.audit = SQLiteAudit(self.connection)

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    @property
    def durability(self) -> str:
        return self.connection.durability

    async def open(self, *, migrate: bool = True) -> None:
        await self.connection.open(migrate)

    async def aclose(self) -> None:
        await self.connection.aclose()

    async def ping(self) -> None:
        self.connection.read("SELECT 1")
        await self.connection.write(lambda c: c.execute("SELECT 1").fetchone())

    async def secret(self, name: str, generate: bytes) -> bytes:
        def op(c):
            c.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, generate))
            return c.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0]
        return await self.connection.write(op)
