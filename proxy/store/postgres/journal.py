"""The PostgreSQL store's journal: claims, records, quarantines, streams in flight, purges.

- A claim is one ``INSERT … ON CONFLICT DO UPDATE … WHERE`` statement that also reads the
  run's epoch ``FOR SHARE``, so a fenced attempt never claims a key.
- Calls that arrive together are one statement (:mod:`..batching`): gets, claims, and
  completes, so N concurrent records share one commit. A claim reads the key's live
  entry first and answers with it, writing nothing: a replay is one read. Claims under
  ``on_ambiguous = retry`` commit without waiting for the WAL flush (sql.CLAIM_MANY says why).
- The journal is partitioned by expiry (:mod:`.partitioned`): a claim makes sure its
  expiry's range exists first, and a purge drops whole expired ranges (:mod:`.partitions`).
  A claim's owner then finds its entry in that one range (:class:`_Held`).
"""

from __future__ import annotations

import math
import time

import asyncpg

from ..errors import StoreUnavailable
from ..model import Claim, ClaimResult, Entry, EntryState, Recorded
from ..rules import counted, replayed_from
from ..batching import Batches, GiveBack
from ..purging import paced
from . import sql
from .connection import PostgresConnection, json_text
from .partitioned import FORGET_EXPIRED_IN_FIRST_RANGE, is_first_range_key
from .partitions import Partitions, is_no_partition


def _entry(row: asyncpg.Record, response: Recorded | None = None) -> Entry:
    return Entry(*row[:18], response=response)


def _listed(row: asyncpg.Record) -> Entry:
    """An entry as listings show it: its status, no body, its replays by epoch."""
    entry = _entry(row, None if row["status"] is None else Recorded(row["status"], [], b""))
    entry.replayed = replayed_from(row["replayed"])
    return entry


def _recorded(row: asyncpg.Record) -> Recorded | None:
    if row["status"] is None:
        return None
    return Recorded(row["status"], [tuple(h) for h in row["headers"] or []], row["body"] or b"",
                    row["streamed"], [tuple(t) for t in row["timing"] or []])


def _with_evidence(entry: Entry, row: asyncpg.Record) -> Entry:
    entry.evidence = row["evidence"]
    return entry


def _rows(status: str) -> int:
    """Rows touched, from a command tag such as ``UPDATE 1``."""
    return int(status.rsplit(" ", 1)[-1])


ANY_EXPIRY = (-math.inf, math.inf)


class _Held:
    """The expiry of each claim this process won and still holds, by (kid, owner).

    An entry's expiry is its partition key and never changes after its claim, and only the
    claim's owner records, renews or releases it. So those statements can bound the row's
    expiry to the one value it was written with, and PostgreSQL looks for the row in that one
    range (run-time partition pruning) instead of probing every live range's kid index. A
    claim not found here (forgotten once a call on it ended, or past the bound) is looked for
    in every range: forgetting costs a probe per range, never a record.
    """
    BOUND = 100_000  # claims in flight at once; past it, forget the oldest rather than grow

    def __init__(self) -> None:
        self._expiry: dict[tuple[str, str], float] = {}

    def add(self, kid: str, owner: str, expires_at: float) -> None:
        if len(self._expiry) >= self.BOUND:  # the oldest first
            del self._expiry[next(iter(self._expiry))]
        self._expiry[(kid, owner)] = expires_at

    def bounds(self, kid: str, owner: str) -> tuple[float, float]:
        expires_at = self._expiry.get((kid, owner))
        return ANY_EXPIRY if expires_at is None else (expires_at, expires_at)

    def forget(self, kid: str, owner: str | None) -> None:
        if owner is not None:
            self._expiry.pop((kid, owner), None)


class PostgresJournal:
    def __init__(self, db: PostgresConnection, partitions: Partitions):
        self._db = db
        self.partitions = partitions
        self._waiters = db.waiters
        self._gets = Batches("postgres get", self._get_many, db.timeout)
        self._claims = Batches("postgres claim", self._claim_many, db.timeout, self._claim_unanswered)
        self._give_back = GiveBack(self.release)
        self._completes = Batches("postgres complete", self._complete_many, db.timeout)
        self._held = _Held()

    async def opened(self, migrate: bool) -> None:
        """The ranges the next claims need; told not to migrate, the store writes nothing."""
        if migrate:
            await self.partitions.prepare(time.time())
        else:
            await self.partitions.refresh()

    async def aclose(self) -> None:
        """Send what is queued (pending records first), then stop giving claims back."""
        for batches in (self._completes, self._claims, self._gets):
            await batches.flushed()
        await self._give_back.aclose()

    async def get(self, kid: str) -> Entry | None:
        return await self._gets(kid)

    async def _get_many(self, kids: list[str]) -> list[Entry | None]:
        rows = await self._db.batch("get", sql.GET_MANY, list(set(kids)), time.time())
        found = {row["kid"]: row for row in rows}
        return [_with_evidence(_entry(row, _recorded(row)), row) if (row := found.get(kid)) else None
                for kid in kids]

    async def claim(self, claim: Claim) -> ClaimResult:
        kid = claim.scope.kid
        for _ in range(3):
            now = time.time()
            won, run_epoch, live = await self._claims((claim, now))
            if won:
                entry = claim.entry(now)
                self._held.add(kid, claim.owner, entry.expires_at)
                return ClaimResult(True, entry)
            if run_epoch is not None and claim.epoch is not None and run_epoch > claim.epoch:
                return ClaimResult(False, None, stale_epoch=run_epoch)
            lapsed = live is not None and live.state == EntryState.IN_FLIGHT and live.lease_until <= now
            if claim.on_expired == "quarantine" and lapsed:  # its proxy died mid-call: outcome unknown
                quarantined = await self._db.fetchrow("claim", sql.QUARANTINE_EXPIRED, kid, time.time(),
                                                      "the proxy holding the claim stopped mid-call",
                                                      claim.fingerprint, self._db.channel)
                if quarantined is not None:
                    self._waiters.wake(kid)
                    return ClaimResult(False, _entry(quarantined))
                live = None  # changed meanwhile (completed, or quarantined by another proxy)
            # the entry we lost to, as the claim found it, or as it is now after a race
            existing = live or await self.get(kid)
            if existing is not None and existing.state != EntryState.RETRIED:
                return ClaimResult(False, existing)
            # the entry we lost to was released, resolved or purged meanwhile: claim again
        raise StoreUnavailable(f"postgres claim on {kid[:12]} kept racing with other writers")

    def _claim_unanswered(self, item: tuple[Claim, float], outcome: object) -> None:
        """A claim its caller gave up on (or whose batch failed) may be written: give it back."""
        claim, _ = item
        if not (isinstance(outcome, tuple) and not outcome[0]):  # unless it surely lost
            self._give_back.add(claim.scope.kid, claim.owner, claim.lease_s)

    async def _claim_many(self, batch: list[tuple[Claim, float]]) -> list[tuple[bool, int | None, Entry | None]]:
        """Claims that arrived together: (won, the run's epoch, the live entry) for each.

        One statement per ``on_expired`` policy (usually one). A kid asked more than once
        (requests alike, arriving together) is sent once; the others lost, to that claim
        or to the entry it found, and are answered so.
        """
        first: dict[str, int] = {}
        for i, (claim, _) in enumerate(batch):
            first.setdefault(claim.scope.kid, i)
        policies: dict[bool, list[int]] = {True: [], False: []}
        for i in first.values():
            policies[batch[i][0].on_expired == "retry"].append(i)
        answers: dict[int, tuple[bool, int | None, Entry | None]] = {}
        for take_over, members in policies.items():
            if not members:
                continue
            members.sort(key=lambda i: batch[i][0].scope.kid)
            claims = [(c.scope.kid, c.scope.tenant, c.scope.run, c.epoch, c.scope.upstream, c.scope.key,
                       c.fingerprint, c.method, c.path, c.owner, now + c.lease_s, now, now + c.retention_s,
                       c.namespace) for c, now in (batch[i] for i in members)]  # claim_row (schema.py)
            rows = await self._send_claims(claims, take_over)
            found = {row["asked"]: row for row in rows}
            for i in members:
                row = found[batch[i][0].scope.kid]
                live = _entry(row[3:], _recorded(row)) if row["kid"] is not None else None
                answers[i] = (row["won"], row["run_epoch"], live)
        results = []
        for i, (claim, _) in enumerate(batch):
            j = first[claim.scope.kid]
            won, run_epoch, live = answers[j]
            if i != j:  # a twin of claim j: it lost to j's claim, or to the entry j found
                won, live = False, batch[j][0].entry(batch[j][1]) if won else live
            results.append((won, run_epoch, live))
        return results

    async def _send_claims(self, claims: list[tuple], take_over: bool) -> list[asyncpg.Record]:
        expiries = [claim[12] for claim in claims]
        await self.partitions.cover(expiries)
        try:
            return await self._db.batch("claim", sql.CLAIM_MANY, claims, time.time(), take_over)
        except asyncpg.CheckViolationError as exc:
            if not is_no_partition(exc):
                raise
            # a range this process thought was there is not (another replica dropped one that a
            # skewed clock still needs): read the ranges again, create it, send once more
            await self.partitions.create(expiries)
        except asyncpg.UniqueViolationError as exc:
            if not is_first_range_key(exc):
                raise
            # a key's expired row in the first range refused its new one (partitioned.py)
            await self._db.execute("claim", FORGET_EXPIRED_IN_FIRST_RANGE, [claim[0] for claim in claims],
                                   time.time())
        return await self._db.batch("claim", sql.CLAIM_MANY, claims, time.time(), take_over)

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        row = await self._db.fetchrow("next_occurrence", sql.NEXT_OCCURRENCE, namespace, run,
                                      -1 if epoch is None else epoch, counted(tenant, fingerprint),
                                      time.time() + retention_s, keep=True)
        return row[0] - 1

    async def replay_occurrence(self, namespace: str, run: str, epoch: int, fingerprint: str,
                                retention_s: float, *, tenant: str) -> int | None:
        row = await self._db.fetchrow("replay_occurrence", sql.REPLAY_OCCURRENCE, namespace, run, epoch,
                                      counted(tenant, fingerprint), time.time() + retention_s, keep=True)
        return None if row is None else row[0] - 1

    async def recorded(self, namespace: str, run: str, max_bytes: int) -> tuple[dict[str, Entry], bool]:
        rows = await self._db.fetch("recorded", sql.RECORDED, namespace, run, time.time(), max_bytes)
        kept = [row for row in rows if row["upto"] <= max_bytes]
        return {row["kid"]: _entry(row, _recorded(row)) for row in kept}, len(kept) == len(rows)

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        return _rows(await self._db.execute("renew", sql.RENEW, time.time() + lease_s, kid, owner,
                                            *self._held.bounds(kid, owner))) == 1

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        try:
            return await self._completes((kid, owner, recorded))
        finally:  # kept, refused or failed: ended, or left to a quarantine that looks everywhere
            self._held.forget(kid, owner)
            self._waiters.wake(kid)

    async def _complete_many(self, batch: list[tuple[str, str, Recorded]]) -> list[bool]:
        """Group commit: every complete() queued meanwhile goes in one statement, one commit."""
        # in kid order, as claims lock rows: a takeover batch and this one never wait in a cycle
        batch_in_order = sorted(batch, key=lambda done: done[0])
        records = [(kid, owner, r.status, json_text(r.headers), r.body, r.streamed, json_text(r.timing))
                   for kid, owner, r in batch_in_order]  # record_row (schema.py)
        lows, highs = zip(*(self._held.bounds(kid, owner) for kid, owner, _ in batch_in_order))
        rows = await self._db.batch("complete", sql.COMPLETE_MANY, records, time.time(), self._db.channel,
                                    list(lows), list(highs))
        kept = {(row["kid"], row["owner"]) for row in rows}
        return [(kid, owner) in kept for kid, owner, _ in batch]

    async def release(self, kid: str, owner: str) -> None:
        try:
            await self._db.execute("release", sql.RELEASE, kid, owner, self._db.channel,
                                   *self._held.bounds(kid, owner))
        finally:
            self._held.forget(kid, owner)
            self._waiters.wake(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str,
                         evidence: dict | None = None) -> None:
        try:
            await self._db.execute(state, sql.SET_STATE, kid, state, detail, owner, self._db.channel, evidence,
                                   time.time())
        finally:
            self._held.forget(kid, owner)
            self._waiters.wake(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str, evidence: dict | None = None) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail, evidence)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        try:
            if recorded is None:
                rows = await self._db.fetch("resolve", sql.RESOLVE_AS_RETRY, kid, self._db.channel, time.time())
            else:
                rows = await self._db.fetch("resolve", sql.RESOLVE_WITH_ANSWER, kid, recorded.status,
                                            recorded.headers, recorded.body, time.time(), self._db.channel)
            return len(rows) == 1
        finally:
            self._waiters.wake(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._db.execute("append_partial", sql.APPEND_PARTIAL, kid, seq, data, self._db.channel)
        self._waiters.wake(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        rows = await self._db.fetch("read_partial", sql.READ_PARTIAL, kid, after_seq)
        return [(r[0], r[1]) for r in rows]

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        if counts:  # sorted, so two proxies updating the same rows lock them in one order
            now = time.time()
            await self._db.use("count_replays", lambda c: c.executemany(
                sql.COUNT_REPLAYS, [(n, kid, now) for kid, n in sorted(counts.items())]))

    async def purge(self, now: float, batch: int = 1000) -> int:
        """Drop the journal's wholly expired ranges (never deleting its rows), create the
        ranges ahead, and delete the expired occurrence counters in paced batches."""
        await self.partitions.prepare(now)
        dropped = await self.partitions.drop_expired(now)

        async def step() -> tuple[int, bool]:  # short transactions: never hold locks for a whole purge
            m = _rows(await self._db.execute("purge", sql.PURGE_OCCURRENCES, now, batch))
            return 0, m == batch
        await paced(step)
        return dropped

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        rows = await self._db.fetch("journal", sql.JOURNAL, namespace, run, time.time())
        return [_listed(r) for r in rows]

    async def search(self, *, state: str | None = None, key: str | None = None, tenant: str | None = None,
                     run: str | None = None, limit: int = 100) -> list[Entry]:
        rows = await self._db.fetch("search", sql.SEARCH, time.time(), state, key, tenant, run, limit)
        return [_listed(r) for r in rows]

    async def kids(self, prefix: str, limit: int) -> list[str]:
        return [row[0] for row in await self._db.fetch("kids", sql.KIDS, prefix, prefix + "g", limit, time.time())]

    async def count_quarantined(self) -> int:
        return (await self._db.fetchrow("count_quarantined", sql.COUNT_QUARANTINED, time.time()))[0]

    async def delete_run(self, namespace: str, run: str) -> int:
        return (await self._db.fetchrow("delete_journal", sql.DELETE_JOURNAL, namespace, run))[0]

    async def generation(self) -> int:
        row = await self._db.fetchrow("generation", sql.GENERATION)
        return row[0] if row else 0

    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not runs:
            return {}
        namespaces, run_ids = (list(column) for column in zip(*runs))
        rows = await self._db.fetch("count_steps", sql.COUNT_STEPS, namespaces, run_ids, time.time())
        return {(namespace, run): n for namespace, run, n in rows}
