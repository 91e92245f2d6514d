"""What only the SQLite store does: writes that need not reach the disk, on the loop's thread."""

from __future__ import annotations

import asyncio
import sqlite3
import time

from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import make_store
from idemproxy.proxy.store.base import Run


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
            assert not counted.done()  # queued for the writer thread, which waits for the lock
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        assert await asyncio.wait_for(counted, 2.0) == 1
        assert await store.journal.next_occurrence("ns", "run-1", 1, "fp", 3600, tenant="t") == 2
    finally:
        await store.aclose()
