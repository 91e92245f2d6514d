"""SQLite store: the embedded default (``sqlite:///path/to/file.db``).

Durability: WAL with ``synchronous=FULL``, so a commit is fsynced before it returns.
All writes go through one writer thread that commits whatever has queued up in one
transaction (group commit): 32 concurrent records cost one fsync, not 32. Reads run
on the event loop's thread on their own connection: a WAL reader never waits for the
writer, and a primary-key lookup in the page cache is cheaper than a thread hop.
Several processes (``--workers``) share the file; SQLite's lock orders their writers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
import time
from typing import Any, Callable

import orjson

from .base import Claim, ClaimResult, Entry, EntryState, Recorded, StoreUnavailable, Waiters
from .sqlite_runs import SQLiteRuns

log = logging.getLogger("idemproxy.store")

LOCK_RETRY_S = 0.0002  # how often the writer tries for a write lock another worker holds

SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    kid TEXT PRIMARY KEY, tenant TEXT NOT NULL, run TEXT, epoch INTEGER,
    upstream TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    method TEXT NOT NULL DEFAULT '', path TEXT NOT NULL DEFAULT '', namespace TEXT NOT NULL,
    state TEXT NOT NULL, owner TEXT, lease_until REAL NOT NULL DEFAULT 0,
    status INTEGER, headers BLOB, body BLOB, streamed INTEGER NOT NULL DEFAULT 0, timing BLOB,
    detail TEXT, created_at REAL NOT NULL, completed_at REAL, expires_at REAL NOT NULL,
    replays INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS journal_by_run ON journal (namespace, run, created_at);
CREATE INDEX IF NOT EXISTS journal_by_expiry ON journal (expires_at);
CREATE TABLE IF NOT EXISTS partials (
    kid TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (kid, seq));
CREATE TABLE IF NOT EXISTS occurrences (
    tenant TEXT NOT NULL, run TEXT NOT NULL, epoch INTEGER NOT NULL, fingerprint TEXT NOT NULL,
    n INTEGER NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (tenant, run, epoch, fingerprint));
CREATE TABLE IF NOT EXISTS runs (
    tenant TEXT NOT NULL, run_id TEXT NOT NULL, state TEXT NOT NULL, epoch INTEGER NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0, last_seen REAL NOT NULL, started_at REAL NOT NULL,
    timeout_s REAL NOT NULL, grace_s REAL NOT NULL, max_restarts INTEGER NOT NULL, hook TEXT,
    metadata BLOB, created_at REAL NOT NULL, ended_at REAL, next_restart_at REAL NOT NULL DEFAULT 0,
    history BLOB, restart_times BLOB, PRIMARY KEY (tenant, run_id));
CREATE INDEX IF NOT EXISTS runs_by_state ON runs (state, last_seen);
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value BLOB NOT NULL);
"""
# What takes a file made by version N-1 to version N (SCHEMA above is already the latest).
UPGRADES = {2: "ALTER TABLE runs ADD COLUMN restart_times BLOB"}
ENTRY_COLUMNS = ("kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, "
                 "created_at, completed_at, expires_at, replays, detail, method, path, namespace")
POLL_S = 0.05  # how often a waiter looks for another process's writes


def _entry(row: sqlite3.Row, response: Recorded | None = None) -> Entry:
    return Entry(*row[:18], response=response)


def _recorded(row: sqlite3.Row) -> Recorded | None:
    if row["status"] is None:
        return None
    return Recorded(row["status"], [tuple(h) for h in orjson.loads(row["headers"] or b"[]")],
                    row["body"] or b"", bool(row["streamed"]),
                    [tuple(t) for t in orjson.loads(row["timing"] or b"[]")])


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring the file to SCHEMA_VERSION. In one write transaction: workers opening the same
    file together queue here, and the first one's work is what the others find done."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            statements = SCHEMA.split(";")
        else:
            statements = [UPGRADES[v] for v in range(version + 1, SCHEMA_VERSION + 1)]
        for statement in statements:
            if statement.strip():
                conn.execute(statement)
        if version < SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SQLiteStore(SQLiteRuns):
    def __init__(self, path: str, timeout: float = 5.0):
        self.journal = self.runs = self  # one object plays both parts until the split into packages
        self.path = path
        self.timeout = timeout
        self.durability = "SQLite WAL with synchronous=FULL: every answer is fsynced first"
        self.claim_reads = False  # claims queue for the one writer; reads do not
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._handover = threading.Lock()  # decides, per write, writer-took-it vs caller-gave-up
        self._writer: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._waiters = Waiters(POLL_S)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # -- connections ----------------------------------------------------------------------

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
        try:
            writer = self._connect()
            if writer.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                _migrate(writer)
            # The writer waits for the write lock itself (_begin), not by SQLite's busy handler
            writer.execute("PRAGMA busy_timeout=0")
            self._reader = self._connect()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"cannot open {self.path}: {exc}") from exc
        self._writer = threading.Thread(target=self._write_loop, args=(writer,),
                                        name="idemproxy-sqlite-writer", daemon=True)
        self._writer.start()

    async def aclose(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._writer.join)
            self._writer = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

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

    def _commit(self, conn: sqlite3.Connection, batch: list) -> None:
        results: list[tuple[Any, BaseException | None]] = []
        try:
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
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            failure = StoreUnavailable(f"sqlite write failed: {exc}")
            results = [(None, failure)] * len(batch)
        for op, (value, exc) in zip(batch, results):
            self._loop.call_soon_threadsafe(_settle, op.future, value, exc)

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

    async def _write(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._writer is None:
            raise StoreUnavailable("store is closed")
        op = _Write(fn, self._loop.create_future())
        self._queue.put(op)
        try:
            return await asyncio.wait_for(asyncio.shield(op.future), self.timeout)
        except asyncio.TimeoutError:
            with self._handover:
                op.abandoned = not op.taken
            if op.abandoned:
                raise StoreUnavailable(f"sqlite write took longer than {self.timeout}s") from None
        # The writer took it before we gave up: its outcome, committed or not, is the truth.
        # (This second bound only guards against a disk that never returns.)
        try:
            return await asyncio.wait_for(asyncio.shield(op.future), self.timeout)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"sqlite commit took longer than {self.timeout}s") from None

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        if self._reader is None:
            raise StoreUnavailable("store is closed")
        try:
            return self._reader.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"sqlite read failed: {exc}") from exc

    def _notify(self, kid: str) -> None:
        self._waiters.wake(kid)

    async def ping(self) -> None:
        self._read("SELECT 1")
        await self._write(lambda c: c.execute("SELECT 1").fetchone())

    async def secret(self, name: str, generate: bytes) -> bytes:
        def op(c):
            c.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, generate))
            return c.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0]
        return await self._write(op)

    # -- journal --------------------------------------------------------------------------

    async def get(self, kid: str) -> Entry | None:
        rows = self._read(f"SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing "
                          "FROM journal WHERE kid = ? AND expires_at > ?", (kid, time.time()))
        return _entry(rows[0], _recorded(rows[0])) if rows else None

    async def claim(self, claim: Claim) -> ClaimResult:
        scope = claim.scope
        kid = scope.kid

        def op(c: sqlite3.Connection) -> ClaimResult:
            now = time.time()
            if scope.run and claim.epoch is not None:
                run = c.execute("SELECT epoch FROM runs WHERE tenant = ? AND run_id = ?",
                                (claim.namespace, scope.run)).fetchone()
                if run and run[0] > claim.epoch:
                    return ClaimResult(False, None, stale_epoch=run[0])
            row = c.execute(f"SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing "
                            "FROM journal WHERE kid = ?", (kid,)).fetchone()
            if row is not None and row["expires_at"] > now:
                existing = _entry(row, _recorded(row))
                if (existing.state != EntryState.IN_FLIGHT or existing.lease_until > now
                        or existing.fingerprint != claim.fingerprint):
                    return ClaimResult(False, existing)
                if claim.on_expired == "quarantine":  # its proxy died mid-call: outcome unknown
                    c.execute("UPDATE journal SET state = ?, owner = NULL, detail = ? WHERE kid = ?",
                              (EntryState.UNKNOWN, "the proxy holding the claim stopped mid-call", kid))
                    existing.state, existing.owner = EntryState.UNKNOWN, None
                    return ClaimResult(False, existing)
            # a new claim, or a takeover: bytes a dead call left behind must not be joined
            c.execute("DELETE FROM partials WHERE kid = ?", (kid,))
            c.execute(
                "INSERT OR REPLACE INTO journal (kid, tenant, run, epoch, upstream, key, fingerprint, "
                "method, path, namespace, state, owner, lease_until, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kid, scope.tenant, scope.run, claim.epoch, scope.upstream, scope.key,
                 claim.fingerprint, claim.method, claim.path, claim.namespace, EntryState.IN_FLIGHT, claim.owner,
                 now + claim.lease_s, now, now + claim.retention_s))
            return ClaimResult(True, claim.entry(now))
        return await self._write(op)

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float) -> int:
        def op(c):
            row = c.execute(
                "INSERT INTO occurrences (tenant, run, epoch, fingerprint, n, expires_at) "
                "VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT DO UPDATE SET n = n + 1, "
                "expires_at = excluded.expires_at RETURNING n",
                (namespace, run, -1 if epoch is None else epoch, fingerprint,
                 time.time() + retention_s)).fetchone()
            return row[0] - 1
        return await self._write(op)

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        def op(c):
            return c.execute("UPDATE journal SET lease_until = ? WHERE kid = ? AND owner = ? "
                             "AND state = ?", (time.time() + lease_s, kid, owner, EntryState.IN_FLIGHT)).rowcount == 1
        return await self._write(op)

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        headers, timing = orjson.dumps(recorded.headers), orjson.dumps(recorded.timing)

        def op(c):
            done = c.execute(
                "UPDATE journal SET state = ?, owner = NULL, status = ?, headers = ?, body = ?, "
                "streamed = ?, timing = ?, completed_at = ? WHERE kid = ? AND owner = ? AND state = ?",
                (EntryState.COMPLETE, recorded.status, headers, recorded.body, int(recorded.streamed), timing,
                 time.time(), kid, owner, EntryState.IN_FLIGHT)).rowcount == 1
            c.execute("DELETE FROM partials WHERE kid = ?", (kid,))
            return done
        try:
            return await self._write(op)
        finally:
            self._notify(kid)

    async def release(self, kid: str, owner: str) -> None:
        def op(c):
            row = c.execute("DELETE FROM journal WHERE kid = ? AND owner = ? RETURNING namespace, run, "
                            "epoch, fingerprint, key", (kid, owner)).fetchone()
            c.execute("DELETE FROM partials WHERE kid = ?", (kid,))
            if row is not None and row["key"].startswith("derived:"):
                # give the occurrence number back, so the caller's retry maps onto this slot
                n = int(row["key"].rsplit(":", 1)[1])
                c.execute("UPDATE occurrences SET n = n - 1 WHERE tenant = ? AND run = ? AND epoch = ? "
                          "AND fingerprint = ? AND n = ?",
                          (row["namespace"], row["run"], -1 if row["epoch"] is None else row["epoch"],
                           row["fingerprint"], n + 1))
        try:
            await self._write(op)
        finally:
            self._notify(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str) -> None:
        def op(c):
            c.execute("UPDATE journal SET state = ?, owner = NULL, detail = ? WHERE kid = ? "
                      "AND (? IS NULL OR owner = ?)", (state, detail, kid, owner, owner))
            c.execute("DELETE FROM partials WHERE kid = ?", (kid,))
        try:
            await self._write(op)
        finally:
            self._notify(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        def op(c):
            if recorded is None:
                return c.execute("DELETE FROM journal WHERE kid = ? AND state = ?",
                                 (kid, EntryState.UNKNOWN)).rowcount == 1
            return c.execute(
                "UPDATE journal SET state = ?, status = ?, headers = ?, body = ?, streamed = 0, "
                "completed_at = ?, detail = 'resolved by operator' WHERE kid = ? AND state = ?",
                (EntryState.COMPLETE, recorded.status, orjson.dumps(recorded.headers), recorded.body,
                 time.time(), kid, EntryState.UNKNOWN)).rowcount == 1
        try:
            return await self._write(op)
        finally:
            self._notify(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._write(lambda c: c.execute(
            "INSERT OR IGNORE INTO partials (kid, seq, data) VALUES (?, ?, ?)", (kid, seq, data)))
        self._notify(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        rows = self._read("SELECT seq, data FROM partials WHERE kid = ? AND seq > ? ORDER BY seq",
                          (kid, after_seq))
        return [(r[0], r[1]) for r in rows]

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        await self._write(lambda c: c.executemany(
            "UPDATE journal SET replays = replays + ? WHERE kid = ?",
            [(n, kid) for kid, n in counts.items()]))

    async def purge(self, now: float, batch: int = 1000) -> int:
        def op(c):
            kids = [r[0] for r in c.execute(
                "SELECT kid FROM journal WHERE expires_at <= ? LIMIT ?", (now, batch))]
            c.executemany("DELETE FROM journal WHERE kid = ?", [(k,) for k in kids])
            c.executemany("DELETE FROM partials WHERE kid = ?", [(k,) for k in kids])
            c.execute("DELETE FROM occurrences WHERE expires_at <= ?", (now,))
            return len(kids)
        total = 0
        while True:  # short transactions: never hold the write lock for a whole purge
            n = await self._write(op)
            total += n
            if n < batch:
                return total

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        rows = self._read(f"SELECT {ENTRY_COLUMNS}, status FROM journal WHERE namespace = ? AND run = ? "
                          "ORDER BY created_at", (namespace, run))
        out = []
        for row in rows:
            entry = _entry(row)
            if row["status"] is not None:
                entry.response = Recorded(row["status"], [], b"")
            out.append(entry)
        return out

    async def delete_run(self, namespace: str, run: str) -> int:
        def op(c):
            c.execute("DELETE FROM partials WHERE kid IN (SELECT kid FROM journal WHERE namespace = ? "
                      "AND run = ?)", (namespace, run))
            c.execute("DELETE FROM occurrences WHERE tenant = ? AND run = ?", (namespace, run))
            return c.execute("DELETE FROM journal WHERE namespace = ? AND run = ?",
                             (namespace, run)).rowcount
        return await self._write(op)


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
