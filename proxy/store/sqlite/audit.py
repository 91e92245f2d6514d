"""The SQLite store's audit: operator actions in their own table."""

from __future__ import annotations

import time

import orjson

from ..base import Action
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
        return await self._db.write(lambda c: c.execute(
            "DELETE FROM actions WHERE expires_at <= ?", (now,)).rowcount, long=True)
