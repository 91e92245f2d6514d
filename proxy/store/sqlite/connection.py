"""The SQLite store's connection to its file: a reader, and one group-committing writer.

All writes go through one writer thread that commits whatever has queued up in one
transaction (group commit): 32 concurrent records cost one fsync, not 32. Reads run
on the event loop's thread on their own connection: a WAL reader never waits for the
writer, and a primary-key lookup in the page cache is cheaper than a thread hop. So do
writes that need not reach the disk, while the write lock is free (``durable=False``).
Several processes (``--workers``) share the file; SQLite's lock orders their writers.
sqlite3's errors become :class:`StoreUnavailable` in one place, :class:`translated`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sqlite3
import stat
import threading
import time
from typing import Any, Callable

from ..base import Bell, StoreUnavailable, Waiters
from .schema import SCHEMA_VERSION, migrate

log = logging.getLogger("idemproxy.store")

LOCK_RETRY_S = 0.0002  # how often the writer tries for a write lock another worker holds
POLL_S = 0.05  # how often a waiter looks for another process's writes


class translated:
    """``with translated(what):`` sqlite3's errors become StoreUnavailable, saying ``what`` failed.

    A class, not @contextmanager: every read goes through it, and a generator costs
    ~1 µs per use, as much as a read from the page cache (this costs 0.3 µs; measured).
    """
    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, sqlite3.Error):
            raise StoreUnavailable(f"{self.what}: {exc}") from exc


class SQLiteConnection:
    """One file: ``read`` on the loop's thread, ``write`` group-committed on the writer thread."""

    durability = "SQLite WAL with synchronous=FULL: every answer is fsynced first"

    def __init__(self, path: str, timeout: float):
        self.path = path
        self.timeout = timeout
        self.waiters = Waiters(POLL_S)  # woken by our own writes; other processes' by the poll
        self.lost = Bell()  # rung by our own writes only: other processes' supervisors tick on
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._handover = threading.Lock()  # decides, per write, writer-took-it vs caller-gave-up
        self._writer: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._relaxed: sqlite3.Connection | None = None  # writes that need not reach the disk
        self._loop: asyncio.AbstractEventLoop | None = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=self.timeout)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        return conn

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        make_private(self.path)
        with translated(f"cannot open {self.path}"):
            writer = self._connect()
            if writer.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                migrate(writer)
            # The writer waits for the write lock itself (_begin), not by SQLite's busy handler
            writer.execute("PRAGMA busy_timeout=0")
            self._reader = self._connect()
            self._relaxed = self._connect()
            # committed without an fsync; never waits for the lock (the writer thread does);
            # never checkpoints on the loop's thread (the writer's commits do)
            for pragma in ("synchronous=NORMAL", "busy_timeout=0", "wal_autocheckpoint=0"):
                self._relaxed.execute(f"PRAGMA {pragma}")
        self._writer = threading.Thread(target=self._write_loop, args=(writer,),
                                        name="idemproxy-sqlite-writer", daemon=True)
        self._writer.start()

    async def aclose(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._writer.join)
            self._writer = None
        for conn in (self._reader, self._relaxed):
            if conn is not None:
                conn.close()
        self._reader = self._relaxed = None

    def read(self, sql: str, args: tuple | dict = ()) -> list[sqlite3.Row]:
        if self._reader is None:
            raise StoreUnavailable("store is closed")
        with translated("sqlite read failed"):
            return self._reader.execute(sql, args).fetchall()

    async def write(self, fn: Callable[[sqlite3.Connection], Any], durable: bool = True) -> Any:
        """``fn(conn)`` in the writer's next transaction; its result once that has committed.

        ``durable=False``: a write that every reader must see at once but that need not be
        forced to disk (a power cut or an OS crash may lose it; a crash of this process
        does not). It runs here, on the loop's thread, when the write lock is free: 22-35 µs,
        where the hop to the writer thread and back costs 125-200 µs (measured). Otherwise
        it queues for the writer like any other.
        """
        if self._writer is None:
            raise StoreUnavailable("store is closed")
        if not durable:
            done, result = self._write_here(fn)
            if done:
                return result
        op = _Write(fn, self._loop.create_future())
        self._queue.put(op)
        try:
            return await asyncio.wait_for(asyncio.shield(op.future), self.timeout)
        except asyncio.TimeoutError:
            with self._handover:
                op.abandoned = not op.taken
            if op.abandoned:
                # nobody awaits the future now: retrieve its outcome when it comes, so asyncio
                # does not log "Future exception was never retrieved"
                op.future.add_done_callback(_retrieve)
                raise StoreUnavailable(f"sqlite write took longer than {self.timeout}s") from None
        # The writer took it before we gave up: its outcome, committed or not, is the truth.
        # (This second bound only guards against a disk that never returns.)
        try:
            return await asyncio.wait_for(asyncio.shield(op.future), self.timeout)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"sqlite commit took longer than {self.timeout}s") from None

    def _write_here(self, fn: Callable[[sqlite3.Connection], Any]) -> tuple[bool, Any]:
        """(True, ``fn``'s result) once committed on the relaxed connection; (False, None)
        when another writer holds the lock."""
        conn = self._relaxed
        with translated("sqlite write failed"):
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    return False, None
                raise
            try:
                result = fn(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return True, result

    # -- the writer thread ----------------------------------------------------------------

    def _write_loop(self, conn: sqlite3.Connection) -> None:
        """Group commit: run every queued write in one transaction, one fsync for all."""
        closing = False
        while not closing:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                closing = True
                batch = [item for item in batch if item is not None]
            if batch:
                self._commit(conn, batch)
        conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[_Write]) -> None:
        try:
            with translated("sqlite write failed"):
                results = self._transaction(conn, batch)
        except StoreUnavailable as failure:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            results = [(None, failure)] * len(batch)
        for op, (value, exc) in zip(batch, results):
            self._loop.call_soon_threadsafe(_settle, op.future, value, exc)

    def _transaction(self, conn: sqlite3.Connection,
                     batch: list[_Write]) -> list[tuple[Any, BaseException | None]]:
        """Each write in a savepoint of its own, all in one transaction. A write's own error
        goes back to its caller; a sqlite3 error is raised, for the caller to roll back."""
        results: list[tuple[Any, BaseException | None]] = []
        self._begin(conn)
        for op in batch:
            with self._handover:
                op.taken = not op.abandoned
            if not op.taken:  # its caller already answered store-unavailable
                results.append((None, None))
                continue
            conn.execute("SAVEPOINT op")
            try:
                results.append((op.fn(conn), None))
                conn.execute("RELEASE op")
            except sqlite3.Error:
                raise
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                results.append((None, exc))
        conn.execute("COMMIT")
        return results

    def _begin(self, conn: sqlite3.Connection) -> None:
        """Take the write lock, which another worker on the same file may hold.

        SQLite's busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries: with two workers
        writing, each would often sleep through several of the other's commits (measured:
        two workers recorded less than one, with a p99 over a second). Trying every
        ``LOCK_RETRY_S`` instead takes the lock about as soon as it is free.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(LOCK_RETRY_S)


def make_private(path: str) -> None:
    """Create the database file 0600 before SQLite opens it: it holds every tenant's bodies
    and the tenant HMAC key. SQLite would create it 0644 (less the umask); its -wal and
    -shm files take the database file's mode when SQLite creates them, so they are 0600 too.

    A file that already exists keeps its owner and group bits but loses any for others,
    as do its -wal and -shm: a group (a backup job's, say) may be meant to read it; the
    world never is.
    """
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreUnavailable(f"cannot open {path}: {exc}") from exc
    for name in (path, path + "-wal", path + "-shm"):
        _close_to_others(name)


def _close_to_others(name: str) -> None:
    try:
        st = os.stat(name)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISREG(st.st_mode) and mode & 0o007:
            os.chmod(name, mode & ~0o007)
            log.warning("%s was open to every user (mode %o); now %o", name, mode, mode & ~0o007)
    except FileNotFoundError:
        pass
    except OSError as exc:  # not ours to change: say so, and go on
        log.warning("cannot take the permissions of others from %s: %s", name, exc)


class _Write:
    """A queued write: taken by the writer or abandoned by its caller, never both, so a
    write whose caller already answered 503 cannot commit later (a claim nobody owns)."""
    __slots__ = ("fn", "future", "taken", "abandoned")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any], future: asyncio.Future):
        self.fn, self.future = fn, future
        self.taken = self.abandoned = False


def _settle(future: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
