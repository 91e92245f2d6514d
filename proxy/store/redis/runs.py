"""The Redis store's run registry: runs, epochs, heartbeats and restarts.

A run is a hash with its history and restart times in lists beside it; every change is
one Lua script (:mod:`.run_scripts`) that also keeps the indexes (by state, by deadline, by
name) in step. Reads are pipelines. The indexes are kept in each shard for its own runs
(:mod:`.shards`), so what reads them (listings, the supervisor's due runs, purges) asks
every shard and merges.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
from typing import Any, Awaitable

import orjson

from ..batching import Batches
from ..model import RUN_STATES, Run, RunState
from ..rules import HISTORY_LIMIT, SILENT_LIMIT, check_settable
from .connection import RedisConnection
from .shards import Shard
from .values import field, maybe, run_ref, text


def _fields(raw: dict | list) -> dict[str, bytes]:
    """A hash as {name: value}, from HGETALL's dict or a script's flat [name, value, ...]."""
    if isinstance(raw, list):
        raw = dict(zip(raw[::2], raw[1::2]))
    return {text(name): value for name, value in raw.items()}


def _run(raw: dict | list, history: list[bytes], restart_times: list[bytes]) -> Run:
    f = _fields(raw)
    return Run(text(f["tenant"]), text(f["run_id"]), text(f["state"]), int(f["epoch"]),
               int(f["restarts"]), float(f["last_seen"]), float(f["started_at"]),
               float(f["timeout_s"]), float(f["grace_s"]), int(f["max_restarts"]),
               text(f.get("hook")), orjson.loads(f.get("metadata") or b"{}"),
               float(f["created_at"]), maybe(float, f.get("ended_at")),
               float(f.get("next_restart_at") or 0), [orjson.loads(h) for h in history],
               [float(t) for t in restart_times], maybe(int, f.get("lost_epoch")),
               int(f.get("attachments") or 0))


def _ending(ended: dict[str, Any] | None) -> bytes:
    """How an attempt ended, for a script to remember (base.ending_event), which writes its
    time and epoch in front of these fields: '' for none."""
    if not ended:
        return b""
    fields = orjson.dumps({k: v for k, v in ended.items() if k not in ("at", "epoch", "event")})
    return fields[1:-1]  # the object's members, without its braces


def _new_run_fields(run: Run) -> dict[str, str | None]:
    fields = {"tenant": run.namespace, "run_id": run.run_id, "state": run.state, "epoch": run.epoch,
              "restarts": run.restarts, "last_seen": run.last_seen, "started_at": run.started_at,
              "timeout_s": run.timeout_s, "grace_s": run.grace_s, "max_restarts": run.max_restarts,
              "hook": run.hook, "metadata": orjson.dumps(run.metadata).decode(),
              "created_at": run.created_at, "ended_at": run.ended_at,
              "next_restart_at": run.next_restart_at, "lost_epoch": run.lost_epoch,
              "attachments": run.attachments}
    return {k: None if v is None else field(v) for k, v in fields.items()}


class RedisRuns:
    def __init__(self, db: RedisConnection):
        self._db = db
        # the runs API's heartbeats, one pipeline for those that came together; no replica
        # need confirm a heartbeat (a failover that loses one costs a restart at worst)
        self._heartbeats = Batches("redis heartbeat", db.pipeline, db.timeout)

    def _of(self, rk: str) -> Shard:
        return self._db.layout.of(rk)

    def _script(self, name: str, rk: str, *args: Any) -> Awaitable[Any]:
        """A run's script, in its shard: its ARGV start with the shard's prefix and the run's rk."""
        shard = self._of(rk)
        return self._db.script(name, [shard.anchor], [shard.prefix, rk, *args])

    def _each_shard(self, name: str, *args: Any) -> Awaitable[list[Any]]:
        """A script that reads or changes a shard's indexes (no one run: rk ''), in every shard."""
        return asyncio.gather(*(self._db.script(name, [shard.anchor], [shard.prefix, "", *args])
                                for shard in self._db.layout.shards))

    async def _per_shard(self, ask: Any) -> list[Any]:
        """``ask(pipe, shard)`` for every shard, in one pipeline: its replies, shard by shard."""
        pipe = self._db.client.pipeline(transaction=False)
        for shard in self._db.layout.shards:
            ask(pipe, shard)
        return await self._db.do(pipe.execute())

    async def _runs(self, rks: list[str]) -> list[Run]:
        if not rks:
            return []
        pipe = self._db.client.pipeline(transaction=False)
        for rk in rks:
            key = self._of(rk).key
            pipe.hgetall(key("run", rk)).lrange(key("history", rk), 0, -1)
            pipe.lrange(key("restarts", rk), 0, -1)
        replies = await self._db.do(pipe.execute())
        return [_run(h, history, times)
                for h, history, times in zip(replies[::3], replies[1::3], replies[2::3]) if h]

    async def upsert(self, run: Run) -> Run:
        new = _new_run_fields(run)
        update = {k: new[k] for k in ("timeout_s", "grace_s", "max_restarts", "hook", "metadata")}
        history = [orjson.dumps(event).decode() for event in run.history[-HISTORY_LIMIT:]]
        reply = await self._script("upsert_run", run_ref(run.namespace, run.run_id), orjson.dumps(new),
                                   orjson.dumps(update), orjson.dumps(history), *map(repr, run.restart_times))
        return _run(*reply)

    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        if namespace is not None:
            return await self._runs([run_ref(namespace, run_id)])
        named = await self._per_shard(lambda pipe, shard: pipe.smembers(shard.key("runs-named", run_id)))
        return await self._runs(sorted(rk.decode() for rks in named for rk in rks))

    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]:
        # each shard's newest, merged: the newest of all
        index = ("runs", state) if state else ("runs",)
        found = await self._per_shard(lambda pipe, shard: pipe.zrevrange(shard.key(*index), 0, limit - 1,
                                                                          withscores=True))
        newest = heapq.nlargest(limit, itertools.chain.from_iterable(found), key=lambda pair: (pair[1], pair[0]))
        return await self._runs([rk.decode() for rk, _ in newest])

    async def count(self) -> dict[str, int]:
        def ask(pipe: Any, shard: Shard) -> None:
            for state in RUN_STATES:
                pipe.zcard(shard.key("runs", state))
        counts = await self._per_shard(ask)
        totals = {state: sum(counts[i::len(RUN_STATES)]) for i, state in enumerate(RUN_STATES)}
        return {state: n for state, n in totals.items() if n}

    async def live(self, namespace: str, limit: int) -> int:
        # the live runs' indexes, filtered by the namespace's part of each member (run_ref)
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", run_ref(namespace, "")) + "*"
        found = 0
        for shard in self._db.layout.shards:
            for state in (RunState.RUNNING, RunState.RESTARTING):
                cursor = 0
                while found < limit:
                    cursor, members = await self._db.do(self._db.client.zscan(
                        shard.key("runs", state), cursor, match=pattern, count=1000))
                    found += len(members)
                    if cursor == 0:
                        break
        return min(found, limit)

    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float, ended: dict[str, Any] | None = None) -> int:
        rk = run_ref(namespace, run_id)
        current = await self._db.do(self._db.client.hget(self._of(rk).key("run", rk), "epoch"))
        if current is not None and (epoch is None or epoch <= int(current)):
            return int(current)  # the common case: a known run at its current epoch, no write
        new = Run(namespace, run_id, RunState.RUNNING, epoch or 0, 0, now, now, defaults.timeout_s,
                  defaults.grace_s, defaults.max_restarts, defaults.hook, defaults.metadata, now)
        return int(await self._script("observe_epoch", rk, "" if epoch is None else epoch, field(now),
                                      orjson.dumps(_new_run_fields(new)), _ending(ended)))

    async def touch(self, beats: dict[tuple[str, str, int | None], float]) -> None:
        # ARGV: the shard's prefix, then rk, at, epoch ('' = unfenced), rk, at, epoch, ...: one script a shard
        by_shard: dict[Shard, list[Any]] = {}
        for (namespace, run, epoch), at in beats.items():
            rk = run_ref(namespace, run)
            by_shard.setdefault(self._of(rk), []).extend((rk, field(at), "" if epoch is None else epoch))
        await asyncio.gather(*(self._db.script("touch", [shard.anchor], [shard.prefix, *triples])
                               for shard, triples in by_shard.items()))

    async def heartbeat(self, namespace: str, run_id: str, now: float,
                        epoch: int | None = None) -> Run | None:
        rk = run_ref(namespace, run_id)
        shard = self._of(rk)
        reply = await self._heartbeats(self._db.evalsha("heartbeat", [shard.anchor], [
            shard.prefix, rk, field(now), "" if epoch is None else epoch]))
        return _run(*reply) if reply else None

    async def end(self, namespace: str, run_id: str, state: str, now: float,
                  epoch: int | None = None, ended: dict[str, Any] | None = None) -> Run | None:
        reply = await self._script("end_run", run_ref(namespace, run_id), state, field(now),
                                   "" if epoch is None else epoch, _ending(ended))
        return _run(*reply) if reply else None

    async def new_attempt(self, namespace: str, run_id: str, expected_epoch: int | None, now: float,
                          reason: str, restart: bool, window_s: float | None = None,
                          ended: dict[str, Any] | None = None) -> Run | None:
        reply = await self._script("new_attempt", run_ref(namespace, run_id),
                                   "" if expected_epoch is None else expected_epoch, field(now), reason,
                                   int(restart), "" if window_s is None else field(float(window_s)),
                                   _ending(ended))
        return _run(*reply) if reply else None

    async def revive(self, namespace: str, run_id: str, now: float) -> Run | None:
        reply = await self._script("revive_run", run_ref(namespace, run_id), field(now))
        return _run(*reply) if reply else None

    async def silent(self, now: float, limit: int = SILENT_LIMIT, claim_s: float = 0.0) -> list[Run]:
        # runs-deadline scores each live run by when it is due (run_scripts.py, due): the runs
        # due come first, and the exact condition is checked on those only
        # (with shards: each shard's soonest due, the soonest `limit` of those, then claimed)
        if claim_s and not self._db.layout.sharded:
            rks = await self._script("claim_silent_runs", "", field(now), limit, field(now + claim_s))
        else:
            found = await self._per_shard(lambda pipe, shard: pipe.zrangebyscore(
                shard.key("runs-deadline"), "-inf", field(now), start=0, num=limit, withscores=True))
            rks = [rk for rk, _ in heapq.nsmallest(limit, itertools.chain.from_iterable(found),
                                                   key=lambda pair: (pair[1], pair[0]))]
            if claim_s:
                by_shard: dict[Shard, list[bytes]] = {}
                for rk in rks:
                    by_shard.setdefault(self._of(rk.decode()), []).append(rk)
                claimed = await asyncio.gather(*(self._db.script(
                    "claim_silent_runs", [shard.anchor], [shard.prefix, "", field(now), limit, field(now + claim_s), *mine])
                    for shard, mine in by_shard.items()))
                won = {rk for mine in claimed for rk in mine}
                rks = [rk for rk in rks if rk in won]  # still soonest due first
        runs = await self._runs([rk.decode() for rk in rks])
        return [r for r in runs if r.state in (RunState.RUNNING, RunState.RESTARTING)
                and ((r.lost and r.hook) or (r.last_seen + r.timeout_s < now and r.started_at + r.grace_s < now))
                and r.next_restart_at <= now]

    async def purge(self, before: float, batch: int = 1000) -> int:
        total = 0
        while True:  # in batches, so no script holds the server for long
            purged = await self._each_shard("purge_runs", field(before), batch)
            total += sum(purged)
            if max(purged) < batch:
                return total

    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run | None:
        reply = await self._script("attach_run", run_ref(namespace, run_id), epoch)
        return _run(*reply) if reply else None

    async def lose(self, namespace: str, run_id: str, epoch: int, now: float, event: dict[str, Any],
                   attachment: int | None = None) -> bool:
        rk = run_ref(namespace, run_id)
        return bool(await self._script("lose_attempt", rk, epoch, orjson.dumps({"at": now, **event}),
                                       "" if attachment is None else attachment, self._of(rk).channel))

    async def wait_lost(self, timeout: float) -> bool:
        return await self._db.lost.wait(timeout)

    async def set_state(self, namespace: str, run_id: str, state: str | None, now: float,
                        event: dict[str, Any] | None = None, **fields: Any) -> None:
        check_settable(fields)
        changes = {k: None if v is None else field(v) for k, v in fields.items()}
        if state is not None:
            changes["state"] = state
        await self._script("set_run_state", run_ref(namespace, run_id), orjson.dumps(changes),
                           orjson.dumps({"at": now, **event}) if event else "")
