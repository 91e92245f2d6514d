"""What only the SQLite store does: writes that need not reach the disk, on the loop's thread,
and group commits whose writes that changed nothing are answered before the commit."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import make_store
from idemproxy.proxy.store.errors import StoreUnavailable
from idemproxy.proxy.store.model import Claim, Run, Scope
from idemproxy.proxy.store.sqlite.disk import DiskThread


async def test_a_relaxed_write_waits_for_another_writers_lock_then_commits(sqlite_url):
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    try:
        await store.runs.observe_epoch("ns", "run-1", 1, Run("ns", "run-1"), time.time())
        assert await store.journal.replay_occurrence("ns", "run-1", 1, "fp", 3600, tenant="t") == 0  # on the loop's thread
        blocker = sqlite3.connect(sqlite_url[len("sqlite:///"):], isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another worker is writing
        try:
            counted = asyncio.create_task(store.journal.replay_occurrence("ns", "run-1", 1, "fp", 3600, tenant="t"))
            await asyncio.sleep(0.2)
            assert not counted.done()  # queued for the writer, whose thread waits for the lock
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        assert await asyncio.wait_for(counted, 2.0) == 1
        assert await store.journal.next_occurrence("ns", "run-1", 1, "fp", 3600, tenant="t") == 2
    finally:
        await store.aclose()


def _insert(n: int):
    return lambda c: c.execute("INSERT INTO secrets (name, value) VALUES (?, ?)", (f"s{n}", b"v")).rowcount


def _count(c) -> int:
    return c.execute("SELECT count(*) FROM secrets WHERE name LIKE 's%'").fetchone()[0]


async def test_a_write_that_changed_nothing_is_answered_before_the_commit(sqlite_url):
    """A write that changed nothing, in a transaction where nothing changed before it, read only
    what was committed: its caller need not wait for the fsync, nor for the long write after it."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    db = store.connection
    try:
        def slow(c):  # a long write: on the writer's thread, while the loop goes on
            time.sleep(0.3)
            return _insert(1)(c)
        read = asyncio.create_task(db.write(_count))
        written = asyncio.create_task(db.write(slow, long=True))  # the same turn: the same transaction
        assert await asyncio.wait_for(read, 0.25) == 0
        assert not written.done()
        assert await written == 1
        assert await db.write(_count) == 1
    finally:
        await store.aclose()


async def test_a_write_after_a_change_in_its_transaction_waits_for_the_commit(sqlite_url):
    """Once a write in the transaction changed something, what a later one read may never be
    committed (a replay of an answer the journal does not hold): it is answered after the commit."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    db = store.connection
    try:
        written = asyncio.create_task(db.write(_insert(2)))
        read = asyncio.create_task(db.write(_count))  # sees the uncommitted row
        assert await read == 1
        assert written.done()  # answered together, once committed
    finally:
        await store.aclose()


async def test_a_write_that_raises_fails_alone(sqlite_url):
    """Writes share a transaction without a savepoint each; one that raises is undone alone: the
    batch runs again with a savepoint per write, and the others commit."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    db = store.connection
    try:
        def broken(c):
            _insert(3)(c)
            raise ValueError("a write's own error")
        first, bad, last = (asyncio.create_task(db.write(fn)) for fn in (_insert(4), broken, _insert(5)))
        assert await first == 1 and await last == 1
        try:
            await bad
        except ValueError as exc:
            assert "own error" in str(exc)
        else:
            raise AssertionError("the broken write succeeded")
        names = {r[0] for r in db.read("SELECT name FROM secrets WHERE name LIKE 's%'")}
        assert names == {"s4", "s5"}
    finally:
        await store.aclose()


async def test_a_caller_that_leaves_during_a_long_write_does_not_stall_the_others(sqlite_url):
    """A long write (on the writer's thread) whose caller is cancelled meanwhile, and which then
    changed nothing: the writes beside it in the transaction are still answered at once."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    db = store.connection
    try:
        def slow_read(c):
            time.sleep(0.3)
            return _count(c)
        leaving = asyncio.create_task(db.write(slow_read, long=True))
        staying = asyncio.create_task(db.write(_insert(6)))  # the same turn: the same transaction
        await asyncio.sleep(0.1)
        leaving.cancel()
        assert await asyncio.wait_for(staying, 2.0) == 1
        assert await db.write(_count) == 1
    finally:
        await store.aclose()


async def test_a_write_not_begun_by_its_deadline_fails_and_one_begun_gets_a_second_bound(tmp_path):
    """The watchdog's two bounds (SQLiteConnection._overdue): a write still queued at its
    deadline never runs; a write whose transaction began is given as long again, since its
    outcome is the truth, and only a commit that outlasts that too is failed."""
    store = make_store(StoreSettings(url=f"sqlite:///{tmp_path / 'j.db'}", timeout=0.3))
    await store.open()
    db = store.connection
    try:
        def slow(seconds):
            def op(c):
                time.sleep(seconds)
                return _count(c)
            return op
        began = time.monotonic()
        busy = asyncio.create_task(db.write(slow(0.45), long=True))  # begun: 0.45 s is within 0.3 + 0.3
        await asyncio.sleep(0.05)
        with pytest.raises(StoreUnavailable, match="took longer than 0.3s"):
            await db.write(_insert(7))  # queued behind it past its deadline
        assert await busy == 0
        assert 0.4 <= time.monotonic() - began < 1.0
        assert await db.write(_count) == 0  # the write that gave up never ran
        stuck = asyncio.create_task(db.write(slow(0.9), long=True))  # begun, past both bounds
        with pytest.raises(StoreUnavailable, match="commit took longer than its bound"):
            await stuck
    finally:
        await store.aclose()


def _claim(key: str, on_expired: str) -> Claim:
    return Claim(scope=Scope.of_key("tenant", None, "openai", key), fingerprint="fp", owner=f"owner-{key}",
                 lease_s=30, retention_s=3600, on_expired=on_expired)


async def test_a_claim_under_retry_is_answered_before_its_commit_and_under_quarantine_after(sqlite_url):
    """Under on_ambiguous = retry a claim is answered once written in its transaction
    (journal.py, ``early``); the commit follows. Under quarantine it must outlive a crash, so
    it waits for the commit. A slow write beside it in the same transaction holds that commit."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()
    db, journal = store.connection, store.journal

    def slow(c):
        time.sleep(0.4)
        return _count(c)
    try:
        for on_expired, answered_before_commit in (("retry", True), ("quarantine", False)):
            began = time.monotonic()
            claimed = asyncio.create_task(journal.claim(_claim(on_expired, on_expired)))
            held = asyncio.create_task(db.write(slow, long=True))  # the same turn: the same transaction
            result = await claimed
            took = time.monotonic() - began
            assert result.won
            assert (took < 0.3) is answered_before_commit, (on_expired, took)
            await held
            entry = await journal.get(result.entry.kid)  # committed: the reader sees it
            assert entry is not None and entry.owner == f"owner-{on_expired}"
    finally:
        await store.aclose()


async def test_an_early_claim_still_lands_when_a_write_beside_it_fails(sqlite_url):
    """A write that raises undoes its transaction, and the others run again one by one
    (SQLiteConnection._commit). A claim already answered is among them: its caller acted on it."""
    store = make_store(StoreSettings(url=sqlite_url))
    await store.open()

    def broken(c):
        _insert(9)(c)
        raise ValueError("this write's own error")
    try:
        claimed = asyncio.create_task(store.journal.claim(_claim("k1", "retry")))
        failed = asyncio.create_task(store.connection.write(broken))
        result = await claimed
        with pytest.raises(ValueError, match="own error"):
            await failed
        assert result.won
        entry = await store.journal.get(result.entry.kid)
        assert entry is not None and entry.state == "in_flight" and entry.owner == "owner-k1"
        assert await store.connection.write(_count) == 0  # the failed write left nothing
    finally:
        await store.aclose()


def test_parameters_registered_as_themselves_are_stored_as_before():
    """connection.py registers bytes, None and the state enums with sqlite3 as themselves
    (a cheaper look-up); each must still be stored as a BLOB, a NULL and TEXT."""
    from idemproxy.proxy.store.model import EntryState, RunState
    from idemproxy.proxy.store.sqlite import connection  # noqa: F401 - registers them
    conn = sqlite3.connect(":memory:")
    row = conn.execute("SELECT typeof(?), ?, typeof(?), typeof(?), ?, typeof(?), ?",
                       (b"\x00body", b"\x00body", None, EntryState.COMPLETE, EntryState.COMPLETE,
                        RunState.DEAD, RunState.DEAD)).fetchone()
    assert row == ("blob", b"\x00body", "null", "text", "complete", "text", "dead")
    assert type(row[4]) is str


async def test_the_disk_thread_runs_in_order_hands_back_errors_and_finishes_its_queue():
    """The writer's thread (proxy/store/sqlite/disk.py): its jobs run one at a time in the
    order asked, a job's exception reaches its caller alone, and close() runs what is queued."""
    disk = DiskThread("test-disk")
    ran: list[int] = []

    def job(n: int) -> int:
        time.sleep(0.01)
        ran.append(n)
        return n * 10

    def broken() -> None:
        raise ValueError("a job's own error")
    try:
        futures = [disk.run(job, 1), disk.run(broken), disk.run(job, 2)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert results[0] == 10 and results[2] == 20 and isinstance(results[1], ValueError)
        assert ran == [1, 2]
        last = disk.run(job, 3)  # queued, then the thread is closed: it runs first
    finally:
        disk.close()
    assert ran == [1, 2, 3]
    assert await asyncio.wait_for(last, 1.0) == 30  # its answer was handed to the loop before the close
