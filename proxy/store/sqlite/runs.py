"""The SQLite store's run registry: runs, epochs, heartbeats and restarts.

Reads go to the connection's reader; a change that must see the run as it is (an end,
a new attempt) reads and writes it in one function of the writer's transaction.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson

from ..model import ENDED, RUN_STATES, Run, RunState
from ..rules import (HISTORY_LIMIT, SILENT_LIMIT, advance_attempt, check_settable, ending_event, remembered,
                     revive_attempt)
from .connection import SQLiteConnection

RUN_COLUMNS = ("tenant, run_id, state, epoch, restarts, last_seen, started_at, timeout_s, grace_s, "
               "max_restarts, hook, metadata, created_at, ended_at, next_restart_at, history, restart_times, "
               "lost_epoch, attachments")


def _run(row: sqlite3.Row) -> Run:
    values = list(row)
    values[11] = orjson.loads(values[11] or b"{}")
    values[15] = orjson.loads(values[15] or b"[]")
    values[16] = orjson.loads(values[16] or b"[]")
    return Run(*values)


def _run_in(c: sqlite3.Connection, namespace: str, run_id: str) -> Run | None:
    """The run as the write transaction on ``c`` sees it; None if there is none."""
    row = c.execute(f"SELECT {RUN_COLUMNS} FROM runs WHERE tenant = ? AND run_id = ?",
                    (namespace, run_id)).fetchone()
    return None if row is None else _run(row)


class SQLiteRuns:
    def __init__(self, db: SQLiteConnection):
        self._db = db

    async def upsert(self, run: Run) -> Run:
        def op(c):
            c.execute(
                f"INSERT INTO runs ({RUN_COLUMNS}) VALUES ({', '.join('?' * 19)}) "
                "ON CONFLICT DO UPDATE SET timeout_s = excluded.timeout_s, grace_s = excluded.grace_s, "
                "max_restarts = excluded.max_restarts, hook = excluded.hook, metadata = excluded.metadata",
                (run.namespace, run.run_id, run.state, run.epoch, run.restarts, run.last_seen,
                 run.started_at, run.timeout_s, run.grace_s, run.max_restarts, run.hook,
                 orjson.dumps(run.metadata), run.created_at, run.ended_at, run.next_restart_at,
                 orjson.dumps(run.history[-HISTORY_LIMIT:]), orjson.dumps(run.restart_times),
                 run.lost_epoch, run.attachments))
            return _run_in(c, run.namespace, run.run_id)
        return await self._db.write(op)

    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        if namespace is None:
            rows = self._db.read(f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,))
        else:
            rows = self._db.read(f"SELECT {RUN_COLUMNS} FROM runs WHERE tenant = ? AND run_id = ?",
                              (namespace, run_id))
        return [_run(r) for r in rows]

    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]:
        if state:
            rows = self._db.read(f"SELECT {RUN_COLUMNS} FROM runs WHERE state = ? "
                              "ORDER BY created_at DESC LIMIT ?", (state, limit))
        else:
            rows = self._db.read(f"SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at DESC LIMIT ?",
                              (limit,))
        return [_run(r) for r in rows]

    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float, ended: dict[str, Any] | None = None) -> int:
        rows = self._db.read("SELECT epoch FROM runs WHERE tenant = ? AND run_id = ?", (namespace, run_id))
        if rows and (epoch is None or epoch <= rows[0][0]):
            return rows[0][0]  # the common case: a known run at its current epoch, no write

        def op(c):
            row = c.execute("SELECT epoch FROM runs WHERE tenant = ? AND run_id = ?", (namespace, run_id)).fetchone()
            if row is None:
                if (epoch or 0) > 1:
                    return 0  # an unknown run counts as one at epoch 0
                c.execute(
                    f"INSERT INTO runs ({RUN_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, NULL, 0, ?, ?, NULL, 0)",
                    (namespace, run_id, RunState.RUNNING, epoch or 0, now, now, defaults.timeout_s,
                     defaults.grace_s, defaults.max_restarts, defaults.hook, orjson.dumps(defaults.metadata),
                     now, b"[]", b"[]"))
                return epoch or 0
            if epoch != row[0] + 1:
                return row[0]  # not the next attempt: only new attempts move a run further
            history = orjson.loads(c.execute("SELECT history FROM runs WHERE tenant = ? AND run_id = ?",
                                             (namespace, run_id)).fetchone()[0] or b"[]")
            if ended is not None:
                history = remembered(history, ending_event(now, row[0], ended))
            c.execute("UPDATE runs SET epoch = ?, started_at = ?, history = ?, "
                      f"state = CASE WHEN state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE state END "
                      "WHERE tenant = ? AND run_id = ?", (epoch, now, orjson.dumps(history), namespace, run_id))
            return epoch
        return await self._db.write(op)

    async def touch(self, beats: dict[tuple[str, str, int | None], float]) -> None:
        await self._db.write(lambda c: c.executemany(
            "UPDATE runs SET last_seen = max(last_seen, ?), "
            f"state = CASE WHEN state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE state END "
            "WHERE tenant = ? AND run_id = ? AND (? IS NULL OR epoch <= ?)",
            [(at, namespace, run, epoch, epoch) for (namespace, run, epoch), at in beats.items()]))

    async def heartbeat(self, namespace: str, run_id: str, now: float,
                        epoch: int | None = None) -> Run | None:
        def op(c):
            c.execute("UPDATE runs SET last_seen = max(last_seen, ?), "
                      f"state = CASE WHEN state = '{RunState.RESTARTING}' THEN '{RunState.RUNNING}' ELSE state END "
                      "WHERE tenant = ? AND run_id = ? AND (? IS NULL OR epoch <= ?)",
                      (now, namespace, run_id, epoch, epoch))
            return _run_in(c, namespace, run_id)
        return await self._db.write(op)

    async def end(self, namespace: str, run_id: str, state: str, now: float,
                  epoch: int | None = None, ended: dict[str, Any] | None = None) -> Run | None:
        def op(c):
            run = _run_in(c, namespace, run_id)
            if run is None:
                return None
            if run.state in ENDED or (epoch is not None and run.epoch > epoch):
                return run
            if ended is not None:
                run.history = remembered(run.history, ending_event(now, run.epoch, ended))
            run.history = remembered(run.history, {"at": now, "epoch": run.epoch, "event": state})
            c.execute("UPDATE runs SET state = ?, ended_at = ?, history = ? WHERE tenant = ? AND run_id = ?",
                      (state, now, orjson.dumps(run.history), namespace, run_id))
            run.state, run.ended_at = state, now
            return run
        return await self._db.write(op)

    async def new_attempt(self, namespace: str, run_id: str, expected_epoch: int | None, now: float,
                          reason: str, restart: bool, window_s: float | None = None,
                          ended: dict[str, Any] | None = None) -> Run | None:
        def op(c):
            run = _run_in(c, namespace, run_id)
            if run is None:
                return None
            if run.state in ENDED or (expected_epoch is not None and run.epoch != expected_epoch):
                return None
            advance_attempt(run, now, reason, restart, window_s, ended)
            c.execute("UPDATE runs SET epoch = ?, restarts = ?, state = ?, started_at = ?, last_seen = ?, "
                      "history = ?, restart_times = ?, claimed_until = 0 "
                      "WHERE tenant = ? AND run_id = ? AND epoch = ?",
                      (run.epoch, run.restarts, run.state, now, now, orjson.dumps(run.history),
                       orjson.dumps(run.restart_times), namespace, run_id, run.epoch - 1))
            return run
        return await self._db.write(op)

    async def revive(self, namespace: str, run_id: str, now: float) -> Run | None:
        def op(c):
            run = _run_in(c, namespace, run_id)
            if run is None or run.state != RunState.DEAD:
                return None
            revive_attempt(run, now)
            c.execute("UPDATE runs SET epoch = ?, restarts = ?, state = ?, started_at = ?, last_seen = ?, "
                      "history = ?, restart_times = ?, ended_at = NULL, next_restart_at = 0 "
                      "WHERE tenant = ? AND run_id = ?",
                      (run.epoch, run.restarts, run.state, now, now, orjson.dumps(run.history),
                       orjson.dumps(run.restart_times), namespace, run_id))
            return run
        return await self._db.write(op)

    async def silent(self, now: float, limit: int = SILENT_LIMIT, claim_s: float = 0.0) -> list[Run]:
        # the index on due_at (schema.DUE_AT) finds the runs due; the exact condition (silent
        # for longer than timeout_s, not "as long") is then checked on those rows only. Named,
        # or the planner takes runs_by_state for "state IN" and reads every live run.
        query = (f"SELECT {RUN_COLUMNS} FROM runs INDEXED BY runs_due "
                 "WHERE due_at <= :now AND state IN (:running, :restarting) "
                 "AND ((last_seen + timeout_s < :now AND started_at + grace_s < :now) "
                 "OR (lost_epoch = epoch AND hook IS NOT NULL)) AND next_restart_at <= :now "
                 "ORDER BY due_at LIMIT :limit")
        args = {"now": now, "running": RunState.RUNNING, "restarting": RunState.RESTARTING, "limit": limit}
        if not claim_s:
            return [_run(r) for r in self._db.read(query, args)]

        def claim(c):  # read and claimed in one write transaction: no other caller gets them
            rows = c.execute(query, args).fetchall()
            c.executemany("UPDATE runs SET claimed_until = ? WHERE tenant = ? AND run_id = ?",
                          [(now + claim_s, row[0], row[1]) for row in rows])
            return [_run(r) for r in rows]
        return await self._db.write(claim)

    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run | None:
        def op(c):
            c.execute("UPDATE runs SET attachments = attachments + 1 WHERE tenant = ? AND run_id = ? "
                      "AND epoch = ? AND state IN (?, ?) AND lost_epoch IS NOT epoch",
                      (namespace, run_id, epoch, RunState.RUNNING, RunState.RESTARTING))
            return _run_in(c, namespace, run_id)
        return await self._db.write(op)

    async def lose(self, namespace: str, run_id: str, epoch: int, now: float, event: dict[str, Any],
                   attachment: int | None = None) -> bool:
        def op(c):
            run = _run_in(c, namespace, run_id)
            if (run is None or run.epoch != epoch or run.state in ENDED or run.lost
                    or attachment not in (None, run.attachments)):
                return False
            c.execute("UPDATE runs SET lost_epoch = ?, history = ? WHERE tenant = ? AND run_id = ?",
                      (epoch, orjson.dumps(remembered(run.history, {"at": now, **event})), namespace, run_id))
            return True
        lost = await self._db.write(op)
        if lost:  # other processes on this file hear of it at their supervisor's next tick
            self._db.lost.ring()
        return lost

    async def wait_lost(self, timeout: float) -> bool:
        return await self._db.lost.wait(timeout)

    async def set_state(self, namespace: str, run_id: str, state: str | None, now: float,
                        event: dict[str, Any] | None = None, **fields: Any) -> None:
        check_settable(fields)

        def op(c):
            row = c.execute("SELECT history FROM runs WHERE tenant = ? AND run_id = ?",
                            (namespace, run_id)).fetchone()
            if row is None:
                return
            history = orjson.loads(row[0] or b"[]")
            if event:
                history = remembered(history, {"at": now, **event})
            sets = ", ".join(f"{k} = ?" for k in fields)
            c.execute(f"UPDATE runs SET state = coalesce(?, state), history = ?{', ' + sets if sets else ''} "
                      "WHERE tenant = ? AND run_id = ?",
                      (state, orjson.dumps(history), *fields.values(), namespace, run_id))
        await self._db.write(op)

    async def count(self) -> dict[str, int]:
        return {state: n for state, n in self._db.read("SELECT state, count(*) FROM runs GROUP BY state")}

    async def live(self, namespace: str, limit: int) -> int:
        return self._db.read(  # the primary key's (tenant, run_id) range, no further than limit
            "SELECT count(*) FROM (SELECT 1 FROM runs WHERE tenant = ? AND state IN (?, ?) LIMIT ?)",
            (namespace, RunState.RUNNING, RunState.RESTARTING, limit))[0][0]

    async def purge(self, before: float, batch: int = 1000) -> int:
        def op(c):
            # by state, so runs_by_state (state, last_seen) finds them without a full scan
            return c.execute(
                "DELETE FROM runs WHERE rowid IN (SELECT rowid FROM runs WHERE state IN "
                f"({', '.join('?' * len(RUN_STATES))}) AND last_seen < ? AND coalesce(ended_at, 0) < ? "
                "LIMIT ?)", (*RUN_STATES, before, before, batch)).rowcount
        total = 0
        while True:  # short transactions, as the journal's purge
            n = await self._db.write(op)
            total += n
            if n < batch:
                return total
