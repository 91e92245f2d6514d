"""The PostgreSQL store's audit: operator actions, runs' refusals and counted events, each in its table."""

from __future__ import annotations

import time
from typing import Any

import asyncpg

from ..model import Action
from ..rules import EVENT_BUCKETS, event_bucket
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
        await self._db.execute("purge_refusals", sql.PURGE_REFUSALS, now)
        await self._db.execute("purge_limits", sql.PURGE_LIMITS, now)
        status = await self._db.execute("purge_actions", sql.PURGE_ACTIONS, now)
        return int(status.rsplit(" ", 1)[-1])

    async def refused(self, namespace: str, run: str, refusal: dict[str, Any], keep: int,
                      retention_s: float) -> None:
        await self._db.execute("note_refusal", sql.NOTE_REFUSAL, namespace, run, refusal, keep,
                               refusal["at"] + retention_s)

    async def refusals(self, namespace: str, run: str) -> tuple[int, list[dict[str, Any]]]:
        row = await self._db.fetchrow("refusals", sql.REFUSALS_OF_RUN, namespace, run, time.time())
        return (row[0], list(row[1])) if row else (0, [])

    async def count_events(self, names: list[str], window_s: float, now: float) -> None:
        bucket, size = event_bucket(window_s, now)
        await self._db.execute("count_events", sql.COUNT_EVENTS, sorted(names), bucket, (bucket + 1) * size + window_s)

    async def events(self, name: str, window_s: float, now: float) -> list[tuple[float, int]]:
        bucket, size = event_bucket(window_s, now)
        rows = await self._db.fetch("events", sql.EVENTS_SINCE, name, bucket - EVENT_BUCKETS)
        return [(r[0] * size, r[1]) for r in rows]
