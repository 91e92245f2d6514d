"""The SQLite store's connection to its file: a reader, and one group-committing writer.

Writes queue, and whatever has queued up while the last commit was on its way to the
disk runs in one transaction (group commit): 32 concurrent records cost one fsync, not
32. The statements run on the event loop's thread; the commit's fsync, and a write
lock held by another process, are waited for on the writer's own thread. Reads run on
the loop's thread on their own connection: a WAL reader never waits for the writer. So
do writes that need not reach the disk, while the write lock is free (``durable=False``).
Several processes (``--workers``) share the file; SQLite's lock orders their writers.
sqlite3's errors become :class:`StoreUnavailable` in one place, :class:`translated`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any, Callable

from ..batching import Watchdog
from ..errors import StoreUnavailable
from ..model import EntryState, RunState
from ..waking import Bell, Waiters
from .disk import DiskThread
from .files import check_schema, make_private, opening
from .schema import SCHEMA_VERSION, migrate

# sqlite3 binds an exact int, float, str or bytearray as it is. For any other parameter it
# looks for an adapter, and where none is registered the look-up raises and swallows an
# AttributeError or two for each bytes, None and state bound, eight per record. Registered
# as what they already are, each is found in the adapters' table at half the cost, and is
# stored as before.
for _kind, _as_itself in ((bytes, bytes), (type(None), lambda _: None), (EntryState, str), (RunState, str)):
    sqlite3.register_adapter(_kind, _as_itself)

LOCK_RETRY_S = 0.0002  # how often the writer tries for a write lock another worker holds
POLL_S = 0.05  # how often a waiter looks for another process's writes


class translated:
    """``with translated(what):`` sqlite3's errors become StoreUnavailable, saying ``what`` failed.

    A class, not @contextmanager: every read goes through it, and a generator costs
    as much per use as a read from the page cache (this costs a third of that).
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
    """One file: ``read`` on the loop's thread, ``write`` group-committed (see the module docstring)."""

    durability = "SQLite WAL with synchronous=FULL: every answer is fsynced first"

    def __init__(self, path: str, timeout: float):
        self.path = path
        self.timeout = timeout
        self.waiters = Waiters(POLL_S)  # woken by our own writes; other processes' by the poll
        self.lost = Bell()  # rung by our own writes only: other processes' supervisors tick on
        self._queued: list[_Write] = []
        self._batch: list[_Write] = []  # the transaction being written
        self._sender: asyncio.Task | None = None
        self._watchdog = Watchdog(self._overdue)
        # set while writes answered before their commit (``early``) wait for it: see settled()
        self._unsettled: asyncio.Future | None = None
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._relaxed: sqlite3.Connection | None = None  # writes that need not reach the disk
        # the writer's waits: the fsync of a commit, a write lock another process holds
        self._disk: DiskThread | None = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=self.timeout)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        return conn

    async def open(self, migrate_schema: bool = True) -> None:
        with opening(self.path):
            if migrate_schema:
                make_private(self.path)
            else:
                check_schema(self.path, self.timeout)
            writer = self._connect()
            if migrate_schema and writer.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                migrate(writer)
            # The writer waits for the write lock itself (_begin), not by SQLite's busy handler
            writer.execute("PRAGMA busy_timeout=0")
            self._reader = self._connect()
            self._relaxed = self._connect()
            # committed without an fsync; never waits for the lock (the writer does);
            # never checkpoints on the loop's thread (the writer's commits do, on its thread)
            for pragma in ("synchronous=NORMAL", "busy_timeout=0", "wal_autocheckpoint=0"):
                self._relaxed.execute(f"PRAGMA {pragma}")
        self._writer = writer
        self._disk = DiskThread("idemproxy-sqlite-commit")

    async def aclose(self) -> None:
        if self._sender is not None:  # what is queued is written first; never cut off mid-commit
            await asyncio.gather(asyncio.shield(self._sender), return_exceptions=True)
            self._sender = None
        self._watchdog.disarm()
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        for conn in (self._writer, self._reader, self._relaxed):
            if conn is not None:
                conn.close()
        self._writer = self._reader = self._relaxed = None

    def __repr__(self) -> str:
        return f"SQLiteConnection({self.path!r})"

    async def ping(self) -> None:
        self.read("SELECT 1")
        await self.write(lambda c: c.execute("SELECT 1").fetchone())

    async def secret(self, name: str, generate: bytes) -> bytes:
        def op(c):
            c.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, generate))
            return c.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0]
        return await self.write(op)

    def read(self, sql: str, args: tuple | dict = ()) -> list[sqlite3.Row]:
        if self._reader is None:
            raise StoreUnavailable("store is closed")
        with translated("sqlite read failed"):
            return self._reader.execute(sql, args).fetchall()

    async def write(self, fn: Callable[[sqlite3.Connection], Any], durable: bool = True,
                    long: bool = False, early: bool = False) -> Any:
        """``fn(conn)`` in the writer's next transaction; its result once that has committed.

        ``durable=False``: a write that every reader must see at once but that need not be
        forced to disk (a power cut or an OS crash may lose it; a crash of this process
        does not). It runs at once on the relaxed connection when the write lock is free,
        and otherwise queues like any other. ``long``: a write that may take milliseconds
        (many rows), run on the writer's thread so that the loop goes on meanwhile.
        ``early``: answered as soon as it has run in its transaction, before the commit (see
        ``_run``); a crash, or a commit that fails, then loses it after its caller acted on it.

        A write whose caller gives up (``timeout``) before its transaction began never
        runs; one already running is waited for once more, and its outcome is the truth.
        """
        if self._writer is None:
            raise StoreUnavailable("store is closed")
        if not durable:
            done, result = self._write_here(fn)
            if done:
                return result
        loop = asyncio.get_running_loop()
        op = _Write(fn, loop.create_future(), long, loop.time() + self.timeout, early)
        self._queued.append(op)
        if self._sender is None or self._sender.done():
            self._sender = loop.create_task(self._drain(), name="idemproxy-sqlite-writes")
        self._watchdog.arm(loop, op.deadline)
        return await op.future

    async def settled(self) -> None:
        """Return once every write answered early has committed, or failed: a read after this
        sees what this process told its callers."""
        if self._unsettled is not None:
            await asyncio.shield(self._unsettled)

    def _overdue(self, now: float) -> float | None:
        """The watchdog's round: a write not begun by its deadline never will be; one begun
        gets as long again (its outcome, committed or not, is the truth: this second bound
        is for a disk that never returns)."""
        waiting = [op for op in (*self._queued, *self._batch) if not op.future.done()]
        for op in waiting:
            if op.deadline > now:
                continue
            if op.state == _QUEUED:
                op.future.set_exception(StoreUnavailable(f"sqlite write took longer than {self.timeout}s"))
            elif op.state == _BEGUN:
                op.state, op.deadline = _OVERDUE, now + self.timeout
            else:
                op.future.set_exception(StoreUnavailable("sqlite commit took longer than its bound"))
        return min((op.deadline for op in waiting if not op.future.done()), default=None)

    def _write_here(self, fn: Callable[[sqlite3.Connection], Any]) -> tuple[bool, Any]:
        """(True, ``fn``'s result) once committed on the relaxed connection; (False, None)
        when another writer holds the lock."""
        conn = self._relaxed
        with translated("sqlite write failed"):
            if not _took_lock(conn):
                return False, None
            try:
                result = fn(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return True, result

    # -- group commit -----------------------------------------------------------------------

    async def _drain(self) -> None:
        """Run every queued write in one transaction, one fsync for all.

        The writes themselves run here, on the loop's thread: a write's statements take
        tens of microseconds, where handing each to another thread cost a GIL handover per
        statement and a wake-up per write (nearly three times the statements' own CPU).
        Only the waits go to the
        writer's thread: the commit's fsync, a lock another process holds, a long write.
        """
        while self._queued:
            # One turn of the loop first, so that callers answered by the last commit queue
            # their next write in time to share this one.
            await asyncio.sleep(0)
            batch = self._batch = [op for op in self._queued if not op.future.done()]
            self._queued = []
            if not batch:
                continue
            try:
                await self._commit(batch)
            except asyncio.CancelledError:  # the loop is closing: nobody waits for a timeout
                for op in batch + self._queued:
                    if not op.future.done():
                        op.future.set_exception(StoreUnavailable("sqlite store is closing"))
                raise
            finally:
                self._batch = []
                unsettled, self._unsettled = self._unsettled, None
                if unsettled is not None:  # committed or not, it is what readers will find
                    unsettled.set_result(None)

    async def _commit(self, batch: list[_Write]) -> None:
        conn = self._writer
        try:
            with translated("sqlite write failed"):
                try:
                    await self._begin(conn)
                    if not await self._run(conn, batch, isolated=False):
                        # a write raised: undo the lot, and run each in a savepoint of its own,
                        # so that only that write fails (a savepoint per write costs every
                        # record two statements more; writes that raise are rare)
                        conn.execute("ROLLBACK")
                        await self._begin(conn)
                        await self._run(conn, batch, isolated=True)
                    await self._on_disk_thread(conn.execute, "COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
        except StoreUnavailable as failure:
            for op in batch:
                op.outcome = (None, failure)
        for op in batch:
            if not op.future.done():
                value, exc = op.outcome
                if exc is not None:
                    op.future.set_exception(exc)
                else:
                    op.future.set_result(value)

    async def _run(self, conn: sqlite3.Connection, batch: list[_Write], isolated: bool) -> bool:
        """Each write of ``batch`` whose caller still waits; False as soon as one raises
        (other than a sqlite3 error, which is raised) unless ``isolated``.

        Until a write changes something, the transaction has read only what is committed:
        a write that changed nothing (a claim that found its key taken, a renewal of a
        lease already lost) is answered at once, without waiting for the commit. So is an
        ``early`` write: the write lock orders every other writer behind this transaction,
        so what it found is what they will find once it commits.

        An early write answered in the first pass runs again in the isolated one: its caller
        acts on it. (Between the two the lock is let go: another process may take its key
        meanwhile, and the caller's record then finds it lost, as after a lapsed lease.)"""
        unchanged = conn.total_changes
        for op in batch:
            answered = op.early and op.state != _QUEUED
            if op.future.done() and not answered:  # its caller left before the transaction began
                continue
            op.state = max(op.state, _BEGUN)  # an overdue one stays overdue (the isolated rerun)
            if op.long:
                op.outcome = await self._on_disk_thread(_written, conn, op.fn, isolated)
            else:
                op.outcome = _written(conn, op.fn, isolated)
            value, exc = op.outcome
            if exc is not None:
                if not isolated:
                    return False
            elif op.future.done():
                continue
            elif conn.total_changes == unchanged:
                op.future.set_result(value)
            elif op.early:
                if self._unsettled is None:
                    self._unsettled = asyncio.get_running_loop().create_future()
                op.future.set_result(value)
        return True

    async def _begin(self, conn: sqlite3.Connection) -> None:
        """Take the write lock: at once when it is free, else on the writer's thread, since
        another worker on the same file may hold it for a while."""
        if not _took_lock(conn):
            await self._on_disk_thread(self._wait_for_lock, conn)

    async def _on_disk_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the writer's thread. Cancelled meanwhile, this still waits for
        ``fn`` to return before it lets the cancel through: the writer's connection is never
        used by two threads at once (the caller rolls back on its way out)."""
        future = self._disk.run(fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    def _wait_for_lock(self, conn: sqlite3.Connection) -> None:
        """SQLite's busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries: with two workers
        writing, each would often sleep through several of the other's commits (measured:
        two workers recorded less than one, with a p99 over a second). Trying every
        ``LOCK_RETRY_S`` instead takes the lock about as soon as it is free.
        """
        deadline = time.monotonic() + self.timeout
        while not _took_lock(conn):
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError("database is locked")
            time.sleep(LOCK_RETRY_S)


def _took_lock(conn: sqlite3.Connection) -> bool:
    """Begin a write transaction on ``conn``: True once it holds the write lock, False when
    another connection holds it (any other error is raised)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
        return True
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return False
        raise


_QUEUED, _BEGUN, _OVERDUE = 0, 1, 2  # _OVERDUE: begun, and past its first deadline


class _Write:
    """A queued write: run in a transaction, or given up by its caller before that began,
    never both, so a write whose caller already answered 503 cannot commit later (a claim
    nobody owns)."""
    __slots__ = ("fn", "future", "long", "deadline", "early", "state", "outcome")

    def __init__(self, fn: Callable[[sqlite3.Connection], Any], future: asyncio.Future, long: bool,
                 deadline: float, early: bool = False):
        self.fn, self.future, self.long, self.deadline, self.early = fn, future, long, deadline, early
        self.state = _QUEUED
        self.outcome: tuple[Any, BaseException | None] = (None, None)


def _written(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], Any],
             isolated: bool) -> tuple[Any, Exception | None]:
    """``fn(conn)``, in a savepoint of its own if ``isolated``: its own error is handed
    back, for its caller alone; a sqlite3 error is raised, for the whole transaction."""
    if isolated:
        conn.execute("SAVEPOINT op")
    try:
        result = fn(conn)
    except sqlite3.Error:
        raise
    except Exception as exc:  # noqa: BLE001 - handed back to the caller
        if isolated:
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
        return None, exc
    if isolated:
        conn.execute("RELEASE op")
    return result, None
