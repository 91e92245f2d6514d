"""The SQLite store's audit: operator actions, runs' refusals and counted events, each in its table."""

from __future__ import annotations

import time
from typing import Any

import orjson

from ..model import Action
from ..rules import EVENT_BUCKETS, event_bucket
from .connection import SQLiteConnection

COLUMNS = "at, who, action, namespace, run, kid, detail"


def _action(row) -> Action:
    return Action(row[0], row[1], row[2], row[3], row[4], row[5], orjson.loads(row[6] or b"{}"))


class SQLiteAudit:
    def __init__(self, db: SQLiteConnection):
        self._db = db

    async def note(self, action: Action, retention_s: float) -> None:
        values = (action.at, action.by, action.action, action.namespace, action.run, action.kid,
                  orjson.dumps(action.detail), action.at + retention_s)
        await self._db.write(lambda c: c.execute(
            f"INSERT INTO actions ({COLUMNS}, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", values))

    async def _read(self, where: str, args: tuple) -> list[Action]:
        await self._db.settled()
        rows = self._db.read(f"SELECT {COLUMNS} FROM actions WHERE {where} AND expires_at > ? "
                             "ORDER BY at, rowid", (*args, time.time()))
        return [_action(row) for row in rows]

    async def of_entry(self, kid: str) -> list[Action]:
        return await self._read("kid = ?", (kid,))

    async def of_run(self, namespace: str, run: str) -> list[Action]:
        return await self._read("namespace = ? AND run = ?", (namespace, run))

    async def purge(self, now: float) -> int:
        def op(c):
            c.execute("DELETE FROM refusals WHERE expires_at <= ?", (now,))
            c.execute("DELETE FROM limits WHERE expires_at <= ?", (now,))
            return c.execute("DELETE FROM actions WHERE expires_at <= ?", (now,)).rowcount
        return await self._db.write(op, long=True)

    async def refused(self, namespace: str, run: str, refusal: dict[str, Any], keep: int,
                      retention_s: float) -> None:
        def op(c):  # writes are serialised: the read and the write see no other refusal between
            row = c.execute("SELECT count, recent FROM refusals WHERE namespace = ? AND run = ?",
                            (namespace, run)).fetchone()
            count, recent = (row[0], orjson.loads(row[1])) if row else (0, [])
            c.execute("INSERT OR REPLACE INTO refusals (namespace, run, count, recent, expires_at) "
                      "VALUES (?, ?, ?, ?, ?)", (namespace, run, count + 1,
                                                 orjson.dumps((recent + [refusal])[-keep:]),
                                                 refusal["at"] + retention_s))
        await self._db.write(op, durable=False)  # a count: an OS crash may lose the last few

    async def refusals(self, namespace: str, run: str) -> tuple[int, list[dict[str, Any]]]:
        await self._db.settled()
        rows = self._db.read("SELECT count, recent FROM refusals WHERE namespace = ? AND run = ? "
                             "AND expires_at > ?", (namespace, run, time.time()))
        return (rows[0][0], orjson.loads(rows[0][1])) if rows else (0, [])

    async def count_events(self, names: list[str], window_s: float, now: float) -> None:
        bucket, size = event_bucket(window_s, now)
        await self._db.write(lambda c: c.executemany(
            "INSERT INTO limits (name, bucket, n, expires_at) VALUES (?, ?, 1, ?) "
            "ON CONFLICT (name, bucket) DO UPDATE SET n = n + 1",
            [(name, bucket, (bucket + 1) * size + window_s) for name in names]), durable=False)

    async def events(self, name: str, window_s: float, now: float) -> list[tuple[float, int]]:
        bucket, size = event_bucket(window_s, now)
        await self._db.settled()
        rows = self._db.read("SELECT bucket, n FROM limits WHERE name = ? AND bucket >= ?",
                             (name, bucket - EVENT_BUCKETS))
        return [(b * size, n) for b, n in rows]
