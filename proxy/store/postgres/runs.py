"""The PostgreSQL store's run registry: runs, epochs, heartbeats and restarts.

A change that must see the run as it is (an end, a new attempt, a state) locks its row
``FOR UPDATE`` in a transaction: concurrent callers queue on the row lock.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from ..batching import Batches
from ..model import ENDED, RUN_STATES, Run, RunState
from ..rules import (HISTORY_LIMIT, SILENT_LIMIT, advance_attempt, check_settable, ending_event, remembered,
                     revive_attempt)
from . import sql
from .connection import PostgresConnection


def _run(row: asyncpg.Record) -> Run:
    run = Run(*row)
    run.metadata, run.history = run.metadata or {}, run.history or []
    run.restart_times = run.restart_times or []
    return run


Beat = tuple[str, str, "int | None", float]  # (namespace, run id, epoch, now)


class PostgresRuns:
    def __init__(self, db: PostgresConnection):
        self._db = db
        # the runs API's heartbeats, one statement and one commit for those that came together
        self._heartbeats = Batches("postgres heartbeat", self._heartbeat_many, db.timeout)

    async def upsert(self, run: Run) -> Run:
        return _run(await self._db.fetchrow(
            "upsert_run", sql.UPSERT_RUN, run.namespace, run.run_id, run.state, run.epoch, run.restarts,
            run.last_seen, run.started_at, run.timeout_s, run.grace_s, run.max_restarts, run.hook,
            run.metadata, run.created_at, run.ended_at, run.next_restart_at, run.history[-HISTORY_LIMIT:],
            run.restart_times, run.lost_epoch, run.attachments))

    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        rows = await self._db.fetch("get_run", sql.GET_RUN, namespace, run_id)
        return [_run(r) for r in rows]

    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]:
        rows = await self._db.fetch("list_runs", sql.LIST_RUNS, state or None, limit)
        return [_run(r) for r in rows]

    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float, ended: dict[str, Any] | None = None) -> int:
        row = await self._db.fetchrow("observe_epoch", sql.RUN_EPOCH, namespace, run_id)
        if row and (epoch is None or epoch <= row[0]):
            return row[0]  # the common case: a known run at its current epoch, no write

        async def raise_epoch(c: asyncpg.Connection) -> int:
            raised = await c.fetchval(sql.RAISE_EPOCH, namespace, run_id, epoch or 0, now, defaults.timeout_s,
                                      defaults.grace_s, defaults.max_restarts, defaults.hook,
                                      defaults.metadata,
                                      None if ended is None else ending_event(now, (epoch or 0) - 1, ended))
            if raised is not None:
                return raised
            return await c.fetchval(sql.RUN_EPOCH, namespace, run_id) or 0  # none: counts as epoch 0
        return await self._db.use("observe_epoch", raise_epoch)

    async def touch(self, beats: dict[tuple[str, str, int | None], float]) -> None:
        # One round trip for the whole flush (executemany pipelines the statements; one
        # statement over arrays of the beats was no faster: the rows' writes are the cost),
        # sorted by run, so two proxies beating for the same runs lock them in one order.
        if beats:
            await self._db.use("touch", lambda c: c.executemany(sql.TOUCH, [
                (at, namespace, run, epoch)
                for (namespace, run, epoch), at in sorted(beats.items(), key=lambda beat: beat[0][:2])]))

    async def _locked_run(self, c: asyncpg.Connection, namespace: str, run_id: str) -> Run | None:
        row = await c.fetchrow(sql.LOCK_RUN, namespace, run_id)
        return None if row is None else _run(row)

    async def heartbeat(self, namespace: str, run_id: str, now: float,
                        epoch: int | None = None) -> Run | None:
        return await self._heartbeats((namespace, run_id, epoch, now))

    async def _heartbeat_many(self, beats: list[Beat]) -> list[Run | None]:
        """Each beat's run: as the beat left it, or as it is (a superseded attempt's beat)."""
        namespaces, run_ids, epochs, times = zip(*beats)

        async def beat(c: asyncpg.Connection) -> dict[tuple[str, str], Run]:
            runs = {(r.namespace, r.run_id): r for r in map(_run, await c.fetch(
                sql.HEARTBEAT_MANY, namespaces, run_ids, epochs, times))}
            unmoved = [(ns, run_id) for ns, run_id, _, _ in beats if (ns, run_id) not in runs]
            if unmoved:
                runs.update(((r.namespace, r.run_id), r) for r in map(_run, await c.fetch(
                    sql.GET_RUNS, [ns for ns, _ in unmoved], [run_id for _, run_id in unmoved])))
            return runs
        runs = await self._db.use("heartbeat", beat)
        return [runs.get((ns, run_id)) for ns, run_id, _, _ in beats]

    async def end(self, namespace: str, run_id: str, state: str, now: float,
                  epoch: int | None = None, ended: dict[str, Any] | None = None) -> Run | None:
        async def op(c: asyncpg.Connection) -> Run | None:
            run = await self._locked_run(c, namespace, run_id)
            if run is None or run.state in ENDED or (epoch is not None and run.epoch > epoch):
                return run
            if ended is not None:
                run.history = remembered(run.history, ending_event(now, run.epoch, ended))
            run.history = remembered(run.history, {"at": now, "epoch": run.epoch, "event": state})
            run.state, run.ended_at = state, now
            await c.execute(sql.END_RUN, state, now, run.history, namespace, run_id)
            return run
        return await self._db.tx("end_run", op)

    async def new_attempt(self, namespace: str, run_id: str, expected_epoch: int | None, now: float,
                          reason: str, restart: bool, window_s: float | None = None,
                          ended: dict[str, Any] | None = None) -> Run | None:
        async def op(c: asyncpg.Connection) -> Run | None:
            run = await self._locked_run(c, namespace, run_id)  # concurrent callers queue on the row lock
            if run is None or run.state in ENDED or expected_epoch not in (None, run.epoch):
                return None
            advance_attempt(run, now, reason, restart, window_s, ended)
            await c.execute(sql.NEW_ATTEMPT, run.epoch, run.restarts, run.state, now, run.history,
                            run.restart_times, namespace, run_id)
            return run
        return await self._db.tx("new_attempt", op)

    async def revive(self, namespace: str, run_id: str, now: float) -> Run | None:
        async def op(c: asyncpg.Connection) -> Run | None:
            run = await self._locked_run(c, namespace, run_id)
            if run is None or run.state != RunState.DEAD:
                return None
            revive_attempt(run, now)
            await c.execute(sql.REVIVE_RUN, run.epoch, run.restarts, run.state, now, run.history,
                            run.restart_times, namespace, run_id)
            return run
        return await self._db.tx("revive_run", op)

    async def silent(self, now: float, limit: int = SILENT_LIMIT, claim_s: float = 0.0) -> list[Run]:
        if claim_s:
            rows = await self._db.fetch("claim_silent_runs", sql.CLAIM_SILENT_RUNS, now, limit, now + claim_s)
        else:
            rows = await self._db.fetch("silent_runs", sql.SILENT_RUNS, now, limit)
        return [_run(r) for r in rows]

    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run | None:
        async def op(c: asyncpg.Connection) -> Run | None:
            await c.execute(sql.ATTACH, namespace, run_id, epoch)
            row = await c.fetchrow(sql.GET_RUN, namespace, run_id)
            return None if row is None else _run(row)
        return await self._db.tx("attach", op)

    async def lose(self, namespace: str, run_id: str, epoch: int, now: float, event: dict[str, Any],
                   attachment: int | None = None) -> bool:
        async def op(c: asyncpg.Connection) -> bool:
            run = await self._locked_run(c, namespace, run_id)
            if (run is None or run.epoch != epoch or run.state in ENDED or run.lost
                    or attachment not in (None, run.attachments)):
                return False
            await c.execute(sql.LOSE, epoch, remembered(run.history, {"at": now, **event}), namespace,
                            run_id, self._db.channel)
            return True
        return await self._db.tx("lose_attempt", op)  # our own listener rings our bell too

    async def wait_lost(self, timeout: float) -> bool:
        return await self._db.lost.wait(timeout)

    async def set_state(self, namespace: str, run_id: str, state: str | None, now: float,
                        event: dict[str, Any] | None = None, **fields: Any) -> None:
        check_settable(fields)

        async def op(c: asyncpg.Connection) -> None:
            run = await self._locked_run(c, namespace, run_id)
            if run is None:
                return
            history = remembered(run.history, {"at": now, **event}) if event else run.history
            sets = "".join(f", {name} = ${i}" for i, name in enumerate(fields, start=5))
            await c.execute(f"UPDATE runs SET state = coalesce($1, state), history = $2{sets} "
                            "WHERE tenant = $3 AND run_id = $4", state, history, namespace, run_id,
                            *fields.values())
        await self._db.tx("set_run_state", op)

    async def count(self) -> dict[str, int]:
        rows = await self._db.fetch("count_runs", sql.COUNT_RUNS)
        return {state: n for state, n in rows}

    async def live(self, namespace: str, limit: int) -> int:
        return (await self._db.fetchrow("live_runs", sql.LIVE_RUNS, namespace, limit))[0]

    async def purge(self, before: float, batch: int = 1000) -> int:
        total = 0
        while True:  # in batches: no transaction holds many rows for long
            n = (await self._db.fetchrow("purge_runs", sql.PURGE_RUNS, before, batch, list(RUN_STATES)))[0]
            total += n
            if n < batch:
                return total
