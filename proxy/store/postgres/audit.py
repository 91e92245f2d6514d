"""The PostgreSQL store's audit: operator actions in their own table."""

from __future__ import annotations

import time

import asyncpg

from ..base import Action
from . import sql
from .connection import PostgresConnection


def _action(row: asyncpg.Record) -> Action:
    return Action(row[0], row[1], row[2], row[3], row[4], row[5], dict(row[6] or {}))


class PostgresAudit:
    def __init__(self, db: PostgresConnection):
        self._db = db

    async def note(self, action: Action, retention_s: float) -> None:
        await self._db.execute("note_action", sql.NOTE_ACTION, action.at, action.by, action.action,
                               action.namespace, action.run, action.kid, action.detail,
                               action.at + retention_s)

    async def of_entry(self, kid: str) -> list[Action]:
        return [_action(r) for r in await self._db.fetch("actions", sql.ACTIONS_OF_ENTRY, kid, time.time())]

    async def of_run(self, namespace: str, run: str) -> list[Action]:
        rows = await self._db.fetch("actions", sql.ACTIONS_OF_RUN, namespace, run, time.time())
        return [_action(r) for r in rows]

    async def purge(self, now: float) -> int:
        status = await self._db.execute("purge_actions", sql.PURGE_ACTIONS, now)
        return int(status.rsplit(" ", 1)[-1])
