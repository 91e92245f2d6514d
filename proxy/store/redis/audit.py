"""The Redis store's audit: operator actions as JSON in two lists, by entry and by run.

Each list expires one retention after its last action; an action older than its own
retention is left out when read, and gone with its list.
"""

from __future__ import annotations

import time

import orjson

from ..base import Action
from .connection import RedisConnection, run_ref


class RedisAudit:
    def __init__(self, db: RedisConnection):
        self._db = db

    def _lists(self, action: Action) -> list[str]:
        lists = [self._db.key("actions", "entry", action.kid)] if action.kid else []
        if action.namespace is not None and action.run is not None:
            lists.append(self._db.key("actions", "run", run_ref(action.namespace, action.run)))
        return lists

    async def note(self, action: Action, retention_s: float) -> None:
        kept = orjson.dumps({**action.as_json(), "expires_at": action.at + retention_s})
        pipe = self._db.client.pipeline(transaction=True)
        for key in self._lists(action):
            pipe.rpush(key, kept)
            pipe.pexpire(key, int(retention_s * 1000))
        await self._db.do(pipe.execute())

    async def _read(self, key: str) -> list[Action]:
        now = time.time()
        raw = [orjson.loads(item) for item in await self._db.do(self._db.client.lrange(key, 0, -1))]
        return [Action.of_json(item) for item in raw if item.get("expires_at", now + 1) > now]

    async def of_entry(self, kid: str) -> list[Action]:
        return await self._read(self._db.key("actions", "entry", kid))

    async def of_run(self, namespace: str, run: str) -> list[Action]:
        return await self._read(self._db.key("actions", "run", run_ref(namespace, run)))

    async def purge(self, now: float) -> int:
        return 0  # the lists expire by themselves
