"""The Redis store's audit: operator actions as JSON in two lists, by entry and by run.

Each list expires one retention after its last action; an action older than its own
retention is left out when read, and gone with its list. A run's refusals are a count and a
list of the last few, expiring a retention after the last; counted events are one counter
per bucket, expiring once no window reads it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from ..model import Action
from ..rules import EVENT_BUCKETS, event_bucket
from .connection import RedisConnection
from .values import run_ref


class RedisAudit:
    def __init__(self, db: RedisConnection):
        self._db = db

    def _entry_list(self, kid: str) -> str:
        return self._db.layout.of(kid).key("actions", "entry", kid)

    def _run_list(self, namespace: str, run: str) -> str:
        rk = run_ref(namespace, run)
        return self._db.layout.of(rk).key("actions", "run", rk)

    def _lists(self, action: Action) -> list[str]:
        lists = [self._entry_list(action.kid)] if action.kid else []
        if action.namespace is not None and action.run is not None:
            lists.append(self._run_list(action.namespace, action.run))
        return lists

    async def note(self, action: Action, retention_s: float) -> None:
        kept = orjson.dumps({**action.as_json(), "expires_at": action.at + retention_s})

        async def append(key: str) -> None:  # each list in a transaction of its own: they may lie apart
            pipe = self._db.client.pipeline(transaction=True)
            pipe.rpush(key, kept)
            pipe.pexpire(key, int(retention_s * 1000))
            await self._db.do(pipe.execute())
        await asyncio.gather(*map(append, self._lists(action)))

    async def _read(self, key: str) -> list[Action]:
        now = time.time()
        raw = [orjson.loads(item) for item in await self._db.do(self._db.client.lrange(key, 0, -1))]
        return [Action.of_json(item) for item in raw if item.get("expires_at", now + 1) > now]

    async def of_entry(self, kid: str) -> list[Action]:
        return await self._read(self._entry_list(kid))

    async def of_run(self, namespace: str, run: str) -> list[Action]:
        return await self._read(self._run_list(namespace, run))

    async def purge(self, now: float) -> int:
        return 0  # the lists and counters expire by themselves

    def _refusal_keys(self, namespace: str, run: str) -> tuple[str, str]:
        ref = run_ref(namespace, run)  # both in the run's shard: one slot of a cluster
        key = self._db.layout.of(ref).key
        return key("refusals", "{" + ref + "}", "count"), key("refusals", "{" + ref + "}", "recent")

    async def refused(self, namespace: str, run: str, refusal: dict[str, Any], keep: int,
                      retention_s: float) -> None:
        count, recent = self._refusal_keys(namespace, run)
        pipe = self._db.client.pipeline(transaction=True)
        pipe.incr(count)
        pipe.rpush(recent, orjson.dumps(refusal))
        pipe.ltrim(recent, -keep, -1)
        for key in (count, recent):
            pipe.pexpireat(key, int((refusal["at"] + retention_s) * 1000))
        await self._db.do(pipe.execute())

    async def refusals(self, namespace: str, run: str) -> tuple[int, list[dict[str, Any]]]:
        count, recent = self._refusal_keys(namespace, run)
        pipe = self._db.client.pipeline(transaction=True)
        pipe.get(count)
        pipe.lrange(recent, 0, -1)
        n, items = await self._db.do(pipe.execute())
        return int(n or 0), [orjson.loads(item) for item in items]

    def _event_key(self, name: str, bucket: int) -> str:
        return self._db.key("events", "{" + name + "}", str(bucket))

    async def count_events(self, names: list[str], window_s: float, now: float) -> None:
        bucket, size = event_bucket(window_s, now)
        pipe = self._db.client.pipeline(transaction=False)  # one round trip; the names' keys may lie apart
        for name in names:
            key = self._event_key(name, bucket)
            pipe.incr(key)
            pipe.pexpireat(key, int(((bucket + 1) * size + window_s) * 1000))
        await self._db.do(pipe.execute())

    async def events(self, name: str, window_s: float, now: float) -> list[tuple[float, int]]:
        bucket, size = event_bucket(window_s, now)
        buckets = range(bucket - EVENT_BUCKETS, bucket + 1)
        counts = await self._db.do(self._db.client.mget([self._event_key(name, b) for b in buckets]))
        return [(b * size, int(n)) for b, n in zip(buckets, counts) if n]
