"""The SQLite store's journal: claims, records, quarantines, streams in flight, purges.

Reads go to the connection's reader; every change is a function the writer runs in its
next group commit, and wakes the entry's waiters in this process.
"""

from __future__ import annotations

import sqlite3
import time

import orjson

from ..model import ANSWERED_BY_OPERATOR, Claim, ClaimResult, Entry, EntryState, Recorded
from ..purging import paced
from ..rules import counted, replayed_from, tallied
from .connection import SQLiteConnection

ENTRY_COLUMNS = ("kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, "
                 "created_at, completed_at, expires_at, replays, detail, method, path, namespace")
CLAIM_COLUMNS = ("(kid, tenant, run, epoch, upstream, key, fingerprint, method, path, namespace, state, owner, "
                 "lease_until, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
CLAIM_NEW = f"INSERT INTO journal {CLAIM_COLUMNS} ON CONFLICT (kid) DO NOTHING"
CLAIM_OVER = f"INSERT OR REPLACE INTO journal {CLAIM_COLUMNS}"
GET = (f"SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing, evidence FROM journal "
       "WHERE kid = ? AND expires_at > ?")
NEXT_OCCURRENCE = ("INSERT INTO occurrences (tenant, run, epoch, fingerprint, n, expires_at) "
                   "VALUES (?, ?, ?, ?, 1, ?) ON CONFLICT DO UPDATE SET n = n + 1, "
                   "expires_at = excluded.expires_at RETURNING n")
# A stream's bytes shared while it is recorded; every delete of an entry deletes its partials,
# so a key claimed anew never finds a dead call's bytes (SQLiteJournal.claim)
DROP_PARTIALS = "DELETE FROM partials WHERE kid = ?"
BUMP_GENERATION = ("INSERT INTO cache_generation (id, generation) VALUES (0, 1) "
                   "ON CONFLICT (id) DO UPDATE SET generation = generation + 1")
# Entries a purge deletes in one write: it shares the writer's group commit with the
# requests queued beside it, so it is kept short (~15 ms of a loaded two-core machine).
PURGE_BATCH = 100


def _entry(row: sqlite3.Row, response: Recorded | None = None) -> Entry:
    return Entry(*row[:18], response=response)


def _listed(row: sqlite3.Row) -> Entry:
    """An entry as listings show it: its status, no body, its replays by epoch."""
    entry = _entry(row)
    if row["status"] is not None:
        entry.response = Recorded(row["status"], [], b"")
    entry.replayed = replayed_from(orjson.loads(row["replayed"] or b"{}"))
    return entry


def _recorded(row: sqlite3.Row) -> Recorded | None:
    if row["status"] is None:
        return None
    return Recorded(row["status"], [tuple(h) for h in orjson.loads(row["headers"] or b"[]")],
                    row["body"] or b"", bool(row["streamed"]),
                    [tuple(t) for t in orjson.loads(row["timing"] or b"[]")])


class SQLiteJournal:
    """A taken key's claim is a read, answered before the commit (SQLiteConnection._run). A
    read before it would cost every fresh key one more: each commit empties the reader's page
    cache, so a key's lookup there costs several times what it costs in the writer."""

    def __init__(self, db: SQLiteConnection):
        self._db = db
        self._waiters = db.waiters

    async def opened(self, migrate: bool) -> None:
        """Nothing to prepare: the connection made the schema."""

    async def aclose(self) -> None:
        """Nothing queued here: the connection's writer writes what is queued as it closes."""

    async def _read(self, sql: str, args: tuple | dict = ()) -> list[sqlite3.Row]:
        """A read that sees every write this process has answered: a claim answered before
        its commit (``claim``) is waited for, as in any read-your-writes store."""
        await self._db.settled()
        return self._db.read(sql, args)

    async def get(self, kid: str) -> Entry | None:
        rows = await self._read(GET, (kid, time.time()))
        if not rows:
            return None
        entry = _entry(rows[0], _recorded(rows[0]))
        entry.evidence = orjson.loads(rows[0]["evidence"]) if rows[0]["evidence"] else None
        return entry

    async def claim(self, claim: Claim) -> ClaimResult:
        scope = claim.scope
        kid = scope.kid

        def op(c: sqlite3.Connection) -> ClaimResult:
            now = time.time()
            if scope.run and claim.epoch is not None:
                run = c.execute("SELECT epoch FROM runs WHERE tenant = ? AND run_id = ?",
                                (claim.namespace, scope.run)).fetchone()
                if run and run[0] > claim.epoch:
                    return ClaimResult(False, None, stale_epoch=run[0])
            values = (kid, scope.tenant, scope.run, claim.epoch, scope.upstream, scope.key, claim.fingerprint,
                      claim.method, claim.path, claim.namespace, EntryState.IN_FLIGHT, claim.owner,
                      now + claim.lease_s, now, now + claim.retention_s)
            # the usual case: a key not seen before (see DROP_PARTIALS)
            if c.execute(CLAIM_NEW, values).rowcount == 1:
                return ClaimResult(True, claim.entry(now))
            row = c.execute(f"SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing "
                            "FROM journal WHERE kid = ?", (kid,)).fetchone()
            # a live entry answers, unless an operator retried it: the next claim takes it over
            if row is not None and row["expires_at"] > now and row["state"] != EntryState.RETRIED:
                existing = _entry(row, _recorded(row))
                if (existing.state != EntryState.IN_FLIGHT or existing.lease_until > now
                        or existing.fingerprint != claim.fingerprint):
                    return ClaimResult(False, existing)
                if claim.on_expired == "quarantine":  # its proxy died mid-call: outcome unknown
                    c.execute("UPDATE journal SET state = ?, owner = NULL, detail = ? WHERE kid = ?",
                              (EntryState.UNKNOWN, "the proxy holding the claim stopped mid-call", kid))
                    c.execute(DROP_PARTIALS, (kid,))  # as quarantine() does
                    existing.state, existing.owner = EntryState.UNKNOWN, None
                    return ClaimResult(False, existing)
            # a takeover (expired, or its claim's lease lapsed): bytes a dead call left behind
            # must not be joined
            c.execute(DROP_PARTIALS, (kid,))
            c.execute(CLAIM_OVER, values)
            return ClaimResult(True, claim.entry(now))
        # Under on_ambiguous = retry the claim is answered once written, before its commit
        # (SQLiteConnection.write's ``early``), as PostgreSQL's is not flushed: a crash that loses
        # it frees the key at once instead of after its lease, and the next try goes upstream
        # again either way. The record is committed, and fsynced, before anyone is answered.
        # Under quarantine the claim must outlive a crash, to be quarantined: it waits.
        return await self._db.write(op, early=claim.on_expired == "retry")

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        def op(c):
            row = c.execute(NEXT_OCCURRENCE, (namespace, run, -1 if epoch is None else epoch,
                                              counted(tenant, fingerprint), time.time() + retention_s)).fetchone()
            return row[0] - 1
        return await self._db.write(op)

    async def replay_occurrence(self, namespace: str, run: str, epoch: int, fingerprint: str,
                                retention_s: float, *, tenant: str) -> int | None:
        def op(c):
            current = c.execute("SELECT epoch FROM runs WHERE tenant = ? AND run_id = ?",
                                (namespace, run)).fetchone()
            if current is None or current[0] != epoch:
                return None
            return c.execute(NEXT_OCCURRENCE, (namespace, run, epoch, counted(tenant, fingerprint),
                                               time.time() + retention_s)).fetchone()[0] - 1
        return await self._db.write(op, durable=False)

    async def recorded(self, namespace: str, run: str, max_bytes: int) -> tuple[dict[str, Entry], bool]:
        # with a running total of the bodies, up to the first entry past max_bytes (dropped below)
        rows = await self._read(
            f"SELECT * FROM (SELECT {ENTRY_COLUMNS}, status, headers, body, streamed, timing, "
            "sum(length(body)) OVER (ORDER BY created_at, kid) AS upto FROM journal "
            "WHERE namespace = ? AND run = ? AND state = ? AND expires_at > ?) "
            "WHERE upto - length(body) <= ?",
            (namespace, run, EntryState.COMPLETE, time.time(), max_bytes))
        kept = [row for row in rows if row["upto"] <= max_bytes]
        return {row["kid"]: _entry(row, _recorded(row)) for row in kept}, len(kept) == len(rows)

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        def op(c):
            return c.execute("UPDATE journal SET lease_until = ? WHERE kid = ? AND owner = ? "
                             "AND state = ?", (time.time() + lease_s, kid, owner, EntryState.IN_FLIGHT)).rowcount == 1
        return await self._db.write(op)

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        headers, timing = orjson.dumps(recorded.headers), orjson.dumps(recorded.timing)

        def op(c):
            done = c.execute(
                "UPDATE journal SET state = ?, owner = NULL, status = ?, headers = ?, body = ?, "
                "streamed = ?, timing = ?, completed_at = ? WHERE kid = ? AND owner = ? AND state = ?",
                (EntryState.COMPLETE, recorded.status, headers, recorded.body, int(recorded.streamed), timing,
                 time.time(), kid, owner, EntryState.IN_FLIGHT)).rowcount == 1
            if recorded.streamed:  # only a stream shares its bytes while it is recorded
                c.execute(DROP_PARTIALS, (kid,))
            return done
        try:
            return await self._db.write(op)
        finally:
            self._waiters.wake(kid)

    async def release(self, kid: str, owner: str) -> None:
        def op(c):
            row = c.execute("DELETE FROM journal WHERE kid = ? AND owner = ? RETURNING namespace, run, "
                            "epoch, tenant, fingerprint, key", (kid, owner)).fetchone()
            c.execute(DROP_PARTIALS, (kid,))
            if row is not None and row["key"].startswith("derived:"):
                # give the occurrence number back, so the caller's retry maps onto this slot
                n = int(row["key"].rsplit(":", 1)[1])
                c.execute("UPDATE occurrences SET n = n - 1 WHERE tenant = ? AND run = ? AND epoch = ? "
                          "AND fingerprint = ? AND n = ?",
                          (row["namespace"], row["run"], -1 if row["epoch"] is None else row["epoch"],
                           counted(row["tenant"], row["fingerprint"]), n + 1))
        try:
            await self._db.write(op)
        finally:
            self._waiters.wake(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str,
                         evidence: dict | None = None) -> None:
        kept = None if evidence is None else orjson.dumps(evidence)

        def op(c):
            c.execute("UPDATE journal SET state = ?, owner = NULL, detail = ?, evidence = ? WHERE kid = ? "
                      "AND (? IS NULL OR owner = ?)", (state, detail, kept, kid, owner, owner))
            c.execute(DROP_PARTIALS, (kid,))
        try:
            await self._db.write(op)
        finally:
            self._waiters.wake(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str, evidence: dict | None = None) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail, evidence)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        def op(c):
            if recorded is None:  # kept, findable: the next claim of its key takes it over
                c.execute(DROP_PARTIALS, (kid,))
                return c.execute("UPDATE journal SET state = ? WHERE kid = ? AND state = ?",
                                 (EntryState.RETRIED, kid, EntryState.UNKNOWN)).rowcount == 1
            return c.execute(
                "UPDATE journal SET state = ?, status = ?, headers = ?, body = ?, streamed = 0, "
                "completed_at = ?, detail = ? WHERE kid = ? AND state = ?",
                (EntryState.COMPLETE, recorded.status, orjson.dumps(recorded.headers), recorded.body,
                 time.time(), ANSWERED_BY_OPERATOR, kid, EntryState.UNKNOWN)).rowcount == 1
        try:
            return await self._db.write(op)
        finally:
            self._waiters.wake(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._db.write(lambda c: c.execute(
            "INSERT OR IGNORE INTO partials (kid, seq, data) VALUES (?, ?, ?)", (kid, seq, data)))
        self._waiters.wake(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        rows = await self._read("SELECT seq, data FROM partials WHERE kid = ? AND seq > ? ORDER BY seq",
                             (kid, after_seq))
        return [(r[0], r[1]) for r in rows]

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        def op(c):
            now = time.time()
            for kid, n in counts.items():
                row = c.execute("SELECT j.replayed, r.epoch FROM journal j LEFT JOIN runs r "
                                "ON r.tenant = j.namespace AND r.run_id = j.run WHERE j.kid = ?", (kid,)).fetchone()
                if row is None:
                    continue
                replayed = replayed_from(orjson.loads(row[0] or b"{}"))
                if row[1] is not None:
                    replayed = tallied(replayed, row[1], n, now)
                c.execute("UPDATE journal SET replays = replays + ?, replayed = ? WHERE kid = ?",
                          (n, orjson.dumps({str(e): t for e, t in replayed.items()}), kid))
        await self._db.write(op, long=len(counts) > 100)  # a second's replays under load: many keys

    async def purge(self, now: float, batch: int = PURGE_BATCH) -> int:
        def journal(c):
            # oldest first: the rows and their expiry index go in runs of neighbouring pages
            kids = [r[0] for r in c.execute(
                "DELETE FROM journal WHERE rowid IN (SELECT rowid FROM journal WHERE expires_at <= ? "
                "ORDER BY expires_at LIMIT ?) RETURNING kid", (now, batch))]
            c.executemany(DROP_PARTIALS, [(k,) for k in kids])
            return len(kids)

        async def step() -> tuple[int, bool]:
            n = await self._db.write(journal, long=True)
            if n < batch:  # the counters last (no index on their expiry: one scan a purge, not a batch)
                await self._db.write(lambda c: c.execute("DELETE FROM occurrences WHERE expires_at <= ?", (now,)))
            return n, n == batch
        # small batches, paced: each rides in a group commit with the records queued beside it
        return await paced(step)

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        rows = await self._read(f"SELECT {ENTRY_COLUMNS}, status, replayed FROM journal "
                             "WHERE namespace = ? AND run = ? ORDER BY created_at", (namespace, run))
        return [_listed(row) for row in rows]

    async def search(self, *, state: str | None = None, key: str | None = None, tenant: str | None = None,
                     run: str | None = None, limit: int = 100) -> list[Entry]:
        rows = await self._read(
            f"SELECT {ENTRY_COLUMNS}, status, replayed FROM journal WHERE expires_at > :now "
            "AND (:state IS NULL OR state = :state) AND (:key IS NULL OR key = :key) "
            "AND (:tenant IS NULL OR tenant = :tenant) AND (:run IS NULL OR run = :run) "
            "ORDER BY created_at DESC LIMIT :limit",
            {"now": time.time(), "state": state, "key": key, "tenant": tenant, "run": run, "limit": limit})
        return [_listed(row) for row in rows]

    async def kids(self, prefix: str, limit: int) -> list[str]:
        # the primary key's range: "g" sorts after every hex digit
        rows = await self._read("SELECT kid FROM journal WHERE kid >= ? AND kid < ? ORDER BY kid LIMIT ?",
                                (prefix, prefix + "g", limit))
        return [row[0] for row in rows]

    async def count_quarantined(self) -> int:
        # as written, so that the partial index journal_quarantined serves it
        rows = await self._read("SELECT count(*) FROM journal WHERE state = 'unknown' AND expires_at > ?",
                                (time.time(),))
        return rows[0][0]

    async def delete_run(self, namespace: str, run: str) -> int:
        def op(c):
            c.execute("DELETE FROM partials WHERE kid IN (SELECT kid FROM journal WHERE namespace = ? "
                      "AND run = ?)", (namespace, run))
            c.execute("DELETE FROM occurrences WHERE tenant = ? AND run = ?", (namespace, run))
            deleted = c.execute("DELETE FROM journal WHERE namespace = ? AND run = ?",
                                (namespace, run)).rowcount
            c.execute(BUMP_GENERATION)  # in the same transaction: see Journal.generation
            return deleted
        return await self._db.write(op, long=True)  # a run's entries may be thousands of rows

    async def generation(self) -> int:
        # straight from the reader: no claim writes the generation, so an early one is not
        # waited for, and Freshness's lease (begun before this read) loses no time to a commit
        rows = self._db.read("SELECT generation FROM cache_generation")
        return rows[0][0] if rows else 0

    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not runs:
            return {}
        # the runs as one JSON parameter: one indexed query however many runs are listed
        rows = await self._read(
            "WITH wanted (namespace, run) AS (SELECT DISTINCT json_extract(value, '$[0]'), "
            "json_extract(value, '$[1]') FROM json_each(?)) "
            "SELECT w.namespace, w.run, count(*) FROM wanted w "
            "JOIN journal j ON j.namespace = w.namespace AND j.run = w.run GROUP BY w.namespace, w.run",
            (orjson.dumps(runs),))
        return {(namespace, run): n for namespace, run, n in rows}
