"""SQLite store: the embedded default (``sqlite:///path/to/file.db``).

Durability: WAL with ``synchronous=FULL``, so a commit is fsynced before it returns.

- :mod:`.connection`: the reader and the group-committing writer (its fsyncs waited for on
  a thread of its own, :mod:`.disk`), shared by the journal and the runs; sqlite3's errors
  become StoreUnavailable. :mod:`.files`: the file made private, opened, its schema checked.
- :mod:`.schema`: the tables, and the upgrades of an older file, run at open.
- :mod:`.journal`, :mod:`.runs`: the two halves of the store contract over that connection;
  :mod:`.audit`: operator actions.
"""

from __future__ import annotations

from ..composed import Store
from .audit import SQLiteAudit
from .connection import SQLiteConnection
from .journal import SQLiteJournal
from .runs import SQLiteRuns

__all__ = ["sqlite_store"]


def sqlite_store(path: str, timeout: float = 5.0) -> Store:
    """The journal, the runs and the secrets in one SQLite file; see the module docstring."""
    connection = SQLiteConnection(path, timeout)
    return Store(connection, SQLiteJournal(connection), SQLiteRuns(connection), SQLiteAudit(connection))
