"""The journal's partitions: created ahead of the entries that need them, dropped whole.

The journal is range-partitioned by ``expires_at`` (:mod:`.partitioned` says why). Ranges
are ``[store] partition_interval`` long (a day by default), aligned to multiples of it
since the epoch, named ``journal_<start>``.

- Ahead: at open and at every purge, the ranges of now and of now + retention, and the
  next ones after each, are created: a claim's expiry lands in one of them. A claim whose
  expiry has no range yet (a longer retention of its own, or a short interval) creates
  its range first (:meth:`Partitions.cover`). There is no default partition: PostgreSQL
  refuses ``DETACH … CONCURRENTLY`` where there is one, and an insert that found no range
  is created its range and sent again, so none is needed.
- Created: ``CREATE TABLE … (LIKE journal)`` then ``ATTACH PARTITION``, which locks the
  journal only against other partition changes (SHARE UPDATE EXCLUSIVE), never against
  reads and writes; ``CREATE TABLE … PARTITION OF`` would lock it whole.
- Dropped: a range wholly before now holds only expired entries. It is detached
  ``CONCURRENTLY`` (reads and writes go on; a detach cut short is finished by the next
  purge) and dropped: no row is read, locked or written to the WAL; what is left of the
  time is the file system freeing the files (docs/sizing.md). Rows are never deleted for
  retention. The stream bytes (``partials``) of entries that expired mid-call are deleted
  first: that table only ever holds calls in flight.
- Counted: a purge reports the entries it dropped, exactly for a range under
  ``EXACT_COUNT_PAGES`` pages, else PostgreSQL's estimate (``reltuples``, kept by
  autovacuum's ANALYZE): counting a large range exactly would cost a scan of it (which
  is done only for a range never analyzed, having no estimate).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import re
from typing import Iterable

import asyncpg

from .connection import PostgresConnection

log = logging.getLogger("idemproxy.store")

EXACT_COUNT_PAGES = 1000  # ~8 MB: counted exactly below this, estimated above
RANGES = """
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending,
       pg_relation_size(c.oid) / current_setting('block_size')::int, c.reltuples
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'journal'::regclass"""
# ranges detached and not dropped: our names, no longer partitions
DETACHED = r"""
SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'
  AND NOT relispartition AND relname ~ '^journal_([0-9_]+|unpartitioned)$'"""
_BOUND = re.compile(r"FROM \((.+)\) TO \((.+)\)")
# $1 now: stream bytes no unexpired entry will read again
ORPHAN_PARTIALS = """
DELETE FROM partials p WHERE NOT EXISTS (
    SELECT 1 FROM journal j WHERE j.kid = p.kid AND j.expires_at > $1)"""


def _value(text: str) -> float:
    text = text.strip("'")
    return -math.inf if text == "MINVALUE" else math.inf if text == "MAXVALUE" else float(text)


def parse_bound(expr: str) -> tuple[float, float]:
    """``FOR VALUES FROM ('1') TO ('2')`` -> (1.0, 2.0); MINVALUE is -inf."""
    found = _BOUND.search(expr)
    if found is None:
        raise ValueError(f"not a range partition bound: {expr!r}")
    return _value(found.group(1)), _value(found.group(2))


def is_no_partition(exc: BaseException) -> bool:
    """The insert found no range for its row (SQLSTATE 23514, as a CHECK failure)."""
    return isinstance(exc, asyncpg.CheckViolationError) and "no partition of relation" in str(exc)


class Partitions:
    """The journal's ranges as last read, and the work on them; see the module docstring."""

    def __init__(self, db: PostgresConnection, interval: float, retention: float):
        if interval < 1 or interval != int(interval):
            raise ValueError(f"partition_interval must be a whole number of seconds, at least 1, got {interval}")
        self._db = db
        self.interval = int(interval)
        self.retention = retention
        self._ranges: list[tuple[float, float]] = []  # sorted, never overlapping
        self._lock_key = int.from_bytes(hashlib.sha256(f"idemproxy-partitions:{db.schema}".encode()).digest()[:8],
                                        "big", signed=True)

    def covered(self, expiry: float) -> bool:
        i = bisect.bisect_right(self._ranges, (expiry, math.inf)) - 1
        return i >= 0 and self._ranges[i][0] <= expiry < self._ranges[i][1]

    async def cover(self, expiries: Iterable[float]) -> None:
        """Make sure each expiry has its range; a catalog read only when one looks missing."""
        missing = [e for e in expiries if not self.covered(e)]
        if missing:
            await self.create(missing)

    async def prepare(self, now: float) -> None:
        """The ranges of now, of now + retention, and the next one after each."""
        step = self.interval
        await self.cover([now, now + step, now + self.retention, now + self.retention + step])

    async def create(self, expiries: list[float]) -> None:
        """Create the aligned range of each expiry, where no range holds it already; a range
        is clipped where an older one (of another interval, or the first) overlaps it."""
        async def work(conn: asyncpg.Connection) -> None:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", self._lock_key)
                ranges = await self._read(conn)
                for expiry in sorted(set(expiries)):
                    if self._holds(ranges, expiry):
                        continue
                    lo = math.floor(expiry / self.interval) * self.interval
                    hi = lo + self.interval
                    for start, end in ranges:  # clip to the neighbours
                        if end <= expiry:
                            lo = max(lo, end)
                        elif start > expiry:
                            hi = min(hi, start)
                    name = f"journal_{lo:.0f}" if lo == int(lo) else f"journal_{lo:.6f}".replace(".", "_")
                    # (a range detached by a purge cut short before its drop is attached again,
                    # to be dropped by the next purge)
                    await conn.execute(f'CREATE TABLE IF NOT EXISTS "{name}" (LIKE journal INCLUDING DEFAULTS)')
                    await conn.execute(f'ALTER TABLE journal ATTACH PARTITION "{name}" '
                                       f"FOR VALUES FROM ('{lo!r}') TO ('{hi!r}')")
                    ranges = sorted([*ranges, (lo, hi)])
            self._ranges = ranges
        await self._db.use("partition", work)

    async def refresh(self) -> None:
        async def work(conn: asyncpg.Connection) -> None:
            self._ranges = await self._read(conn)
        await self._db.use("partition", work)

    async def drop_expired(self, now: float) -> int:
        """Detach and drop every range wholly before ``now``; the entries they held."""
        await self._db.execute("purge", ORPHAN_PARTIALS, now)
        for (name,) in await self._db.fetch("purge", DETACHED):  # a purge cut short between detach and drop
            await self._db.execute("purge", f'DROP TABLE IF EXISTS "{name}"')
        rows = [row for row in await self._db.fetch("purge", RANGES) if parse_bound(row[1])[1] <= now]
        dropped = 0
        for name, _, pending, pages, tuples in rows:
            count = await self._count(name, pages, tuples)
            if await self._db.alone("purge", lambda conn: self._detach_and_drop(conn, name, pending)):
                log.info("journal partition %s dropped (%d entries)", name, count)
                dropped += count
        await self.refresh()
        return dropped

    @staticmethod
    async def _detach_and_drop(conn: asyncpg.Connection, name: str, pending: bool) -> bool:
        """Whether this call dropped it (False: another replica is detaching it now)."""
        finish = " FINALIZE" if pending else " CONCURRENTLY"
        try:
            await conn.execute(f'ALTER TABLE journal DETACH PARTITION "{name}"{finish}')
        except asyncpg.UndefinedTableError:
            pass  # another replica's purge detached it, or dropped it too
        except asyncpg.ObjectNotInPrerequisiteStateError:
            return False
        await conn.execute(f'DROP TABLE IF EXISTS "{name}"')
        return True

    async def _count(self, name: str, pages: int, tuples: float) -> int:
        if pages < EXACT_COUNT_PAGES or tuples < 0:  # (-1: never analyzed, no estimate to give)
            return (await self._db.fetchrow("purge", f'SELECT count(*) FROM "{name}"'))[0]
        return max(int(tuples), 0)

    @staticmethod
    async def _read(conn: asyncpg.Connection) -> list[tuple[float, float]]:
        return sorted(parse_bound(bound) for _, bound, pending, _, _ in await conn.fetch(RANGES) if not pending)

    @staticmethod
    def _holds(ranges: list[tuple[float, float]], expiry: float) -> bool:
        return any(lo <= expiry < hi for lo, hi in ranges)
