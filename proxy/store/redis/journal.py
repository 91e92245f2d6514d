"""The Redis store's journal: claims, records, quarantines, streams in flight, purges.

Every change to an entry is one Lua script (:mod:`.scripts`), so it is atomic. The calls of
the request path (get, claim, complete) that arrive together go as one pipeline
(:mod:`..batching`).

An entry lives in the shard of its kid, a run's journal index in the run's (:mod:`.shards`).
Where they are apart, a claim is two scripts: the claim, then the run's check of the epoch
with the step's index (ENTER_STEP), in that order, so a call goes upstream only if its attempt
was still current after its key was claimed, as with one script (a claim the check finds
superseded is given back at once). Sent together they would save a round trip, but every
replay would then pay a second command: measured, that cost more than the round trip. A
release deletes the claim, then its index entry; a run's journal is deleted entries first,
and the generation raised last (Journal.generation).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from typing import Any, Awaitable, Callable

import orjson

from ..batching import Batches, GiveBack
from ..errors import StoreUnavailable
from ..model import ANSWERED_BY_OPERATOR, Claim, ClaimResult, Entry, EntryState, Recorded
from ..purging import paced
from ..rules import counted, replayed_from
from .connection import RedisConnection
from .durability import ReplicasBehind
from .journal_scripts import ENTRY_FIELDS, READ_FIELDS
from .shards import Shard
from .values import field, maybe, run_ref, text

BATCH = 1000  # index entries per script, so no script holds the server for long


def _flat(fields: dict[str, Any]) -> list[Any]:
    """{name: value} as [name, value, ...] for HSET; bytes stay bytes, the rest become text."""
    return [x for name, value in fields.items()
            for x in (name, value if isinstance(value, bytes) else field(value))]


def _entry(values: list[bytes | None]) -> Entry:
    """An entry from its hash's values in READ_FIELDS order (a shorter list: no response body)."""
    (kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, created_at,
     completed_at, expires_at, replays, detail, method, path, namespace, status, headers, body,
     streamed, timing, evidence) = (*values, *[None] * (len(READ_FIELDS) - len(values)))
    entry = Entry(kid.decode(), tenant.decode(), text(run), maybe(int, epoch), upstream.decode(),
                  key.decode(), fingerprint.decode(), state.decode(), text(owner), float(lease_until),
                  float(created_at), maybe(float, completed_at), float(expires_at), int(replays or 0),
                  text(detail), text(method) or "", text(path) or "", text(namespace) or "default")
    if status is not None:  # journal() reads the status alone, without headers and body
        entry.response = Recorded(int(status), [tuple(h) for h in orjson.loads(headers or b"[]")],
                                  body or b"", streamed == b"1",
                                  [tuple(t) for t in orjson.loads(timing or b"[]")])
    if evidence:
        entry.evidence = orjson.loads(evidence)
    return entry


LISTED_FIELDS = (*ENTRY_FIELDS, "status", "replayed")  # what listings read of an entry


def _listed(values: list[bytes | None]) -> Entry:
    """An entry from its LISTED_FIELDS: its status, no body, its replays by epoch."""
    entry = _entry(values[:-1])
    entry.replayed = replayed_from(orjson.loads(values[-1] or b"{}"))
    return entry


def _response_fields(recorded: Recorded, now: float) -> dict[str, Any]:
    return {"state": EntryState.COMPLETE, "status": recorded.status, "headers": orjson.dumps(recorded.headers),
            "body": recorded.body, "streamed": int(recorded.streamed),
            "timing": orjson.dumps(recorded.timing), "completed_at": now}


class RedisJournal:
    def __init__(self, db: RedisConnection):
        self._db = db
        self._waiters = db.waiters
        self._pipelined = Batches("redis", self._send, db.timeout, self._unanswered)
        self._give_back = GiveBack(self.release)
        self._acknowledged: set[str] = set()  # the SHAs of the claim and the record scripts

    async def opened(self, migrate: bool) -> None:
        self._acknowledged = {self._db.evalsha(name, [], [])[1] for name in ("claim", "complete")}
        if migrate:
            await self.index_quarantined()

    async def aclose(self) -> None:
        """Send what is queued (pending records), then stop giving claims back."""
        await self._pipelined.flushed()
        await self._give_back.aclose()

    def _send(self, calls: list[tuple[tuple[Any, ...], Claim | None]]) -> Awaitable[list[Any]]:
        def wrote(i: int, result: Any) -> bool:
            """A claim won or a record kept: what redis_wait_replicas makes replicas confirm."""
            return (calls[i][0][1] in self._acknowledged
                    and (result == 1 or (isinstance(result, list) and result[0] == b"won")))
        return self._db.pipeline([command for command, _ in calls], wrote)

    def _unanswered(self, call: tuple[tuple[Any, ...], Claim | None], outcome: object) -> None:
        """A claim its caller gave up on (or whose pipeline failed) may be written: give it back."""
        _, claim = call
        if claim is not None and not (isinstance(outcome, list) and outcome[0] != b"won"):
            self._give_back.add(claim.scope.kid, claim.owner, claim.lease_s)

    def _pipelined_script(self, name: str, keys: list[str], args: list[Any],
                          claim: Claim | None = None) -> Awaitable[Any]:
        return self._pipelined((self._db.evalsha(name, keys, args), claim))

    def _of(self, name: str) -> Shard:
        """The shard of a kid or a run's rk."""
        return self._db.layout.of(name)

    async def get(self, kid: str) -> Entry | None:
        values = await self._pipelined_script("read", [self._of(kid).key("entry", kid)], [])
        if values[0] is None:
            return None
        entry = _entry(values)
        return entry if entry.expires_at > time.time() else None

    async def claim(self, claim: Claim) -> ClaimResult:
        # The claim script answers a taken key with its entry, so the proxy asks it first and
        # a record is two pipelined calls (claim, complete), not three. A replay that reaches
        # the store costs a little more through it than through the read script, but few do: a
        # restarted attempt's journal is loaded into memory once (ReplayCache), and an entry
        # read or recorded here is answered from memory after (AnswerCache).
        scope, now = claim.scope, time.time()
        kid, rk = scope.kid, run_ref(claim.namespace, scope.run) if scope.run else ""
        entry = claim.entry(now)
        fields = {name: field(value) for name in ENTRY_FIELDS if (value := getattr(entry, name)) is not None}
        if rk:
            fields["rk"] = rk  # so release() finds the run's occurrence counters and journal
        fenced = scope.run is not None and claim.epoch is not None
        epoch, expires_ms, member = claim.epoch if fenced else "", int(entry.expires_at * 1000), f"{kid} {rk}"
        shard = self._of(kid)
        run_shard = self._of(rk) if rk else shard
        together = run_shard is shard  # the run's part in the claim's own script
        key = shard.key

        def claimed(ask: bool = False) -> Awaitable[Any]:
            return self._pipelined_script(
                "claim", [key("entry", kid), key("partial", kid), key("run", rk), key("steps", rk),
                          key("steps-expiry"), key("quarantined")],
                [field(now), epoch if together else "", claim.fingerprint, claim.owner, claim.on_expired,
                 expires_ms, kid, member if rk and together else "", orjson.dumps(fields), int(ask)],
                claim)

        def enter(won: bool) -> Awaitable[Any]:
            return self._pipelined_script(
                "enter_step", [run_shard.key("run", rk), run_shard.key("steps", rk), run_shard.key("steps-expiry")],
                [epoch, field(now), kid, member, expires_ms, int(won)])
        if together or not rk:
            try:
                reply = await claimed()
            except ReplicasBehind:  # won on the master alone: the caller is refused, so the key is freed
                self._give_back.add(kid, claim.owner, claim.lease_s)
                raise
        else:
            reply = await self._claim_apart(claim, claimed, enter)
        if reply[0] == b"stale":
            return ClaimResult(False, None, stale_epoch=int(reply[1]))
        if reply[0] != b"taken":
            return ClaimResult(True, entry)
        return ClaimResult(False, _entry(reply[1]))

    async def _claim_apart(self, claim: Claim, claimed: Callable[[bool], Awaitable[Any]],
                           enter: Callable[[bool], Awaitable[Any]]) -> Any:
        """The claim, then its run's check (``enter``, ENTER_STEP) if it won, or if it found the
        key taken and is fenced (a superseded attempt gets no replay either, as with one script;
        and a step a crash left out of its run's journal is indexed again): the claim's reply,
        or the run's 'stale'. A claim won but not to be used (superseded, or unchecked) is freed.

        A fenced claim that would change an entry already there (take over one an operator
        retried or whose lease ran out, or quarantine it) asks first: the run is checked before
        it, so a superseded attempt changes nothing, as with one script."""
        kid, owner, fenced = claim.scope.kid, claim.owner, claim.epoch is not None
        try:
            reply = await claimed(fenced)
            if reply[0] == b"takeover":
                check = await enter(False)
                if check[0] == b"stale":
                    return check
                reply = await claimed(False)
        except ReplicasBehind:  # won on the master alone: the caller is refused, so the key is freed
            self._give_back.add(kid, owner, claim.lease_s)
            raise
        won = reply[0] == b"won"
        if not won and not fenced:
            return reply
        try:
            check = await enter(won)
        except BaseException:
            if won:
                self._give_back.add(kid, owner, claim.lease_s)
            raise
        if check[0] != b"stale":
            return reply
        if won:  # superseded: nothing goes upstream, and the key is free again at once
            try:
                await self.release(kid, owner)
            except StoreUnavailable:
                self._give_back.add(kid, owner, claim.lease_s)
        return check

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        rk = run_ref(namespace, run)
        key = self._of(rk).key("occ", rk)
        pipe = self._db.client.pipeline(transaction=True)
        # the counter outlives, by one retention, the last entry it numbered
        pipe.hincrby(key, f"{-1 if epoch is None else epoch}:{counted(tenant, fingerprint)}", 1)
        pipe.pexpire(key, int(retention_s * 1000))
        n, _ = await self._db.do(pipe.execute())
        return n - 1

    async def replay_occurrence(self, namespace: str, run: str, epoch: int, fingerprint: str,
                                retention_s: float, *, tenant: str) -> int | None:
        rk = run_ref(namespace, run)
        shard = self._of(rk)
        return await self._pipelined_script("replay_occurrence", [shard.key("run", rk), shard.key("occ", rk)],
                                            [epoch, f"{epoch}:{counted(tenant, fingerprint)}",
                                             int(retention_s * 1000)])

    async def _steps(self, namespace: str, run: str) -> list[str]:
        """The kids of a run's journal, oldest first."""
        return [kid for kid, _ in await self._scored_steps(namespace, run)]

    async def _scored_steps(self, namespace: str, run: str) -> list[tuple[str, float]]:
        """The kids of a run's journal, oldest first, with when each was claimed."""
        rk = run_ref(namespace, run)
        steps = await self._db.do(self._db.client.zrange(self._of(rk).key("steps", rk), 0, -1, withscores=True))
        return [(kid.decode(), at) for kid, at in steps]

    async def _read_each(self, kids: list[str], *fields: str) -> list[list[Any]]:
        """Some fields of each entry (None for an entry gone), one pipeline to each master."""
        if not kids:
            return []
        pipe = self._db.client.pipeline(transaction=False)
        for kid in kids:
            pipe.hmget(self._of(kid).key("entry", kid), fields)
        return await self._db.do(pipe.execute())

    async def recorded(self, namespace: str, run: str, max_bytes: int) -> tuple[dict[str, Entry], bool]:
        # the complete, unexpired entries, oldest first, while their bodies fit in max_bytes:
        # their sizes first, then the entries that fit
        kids, now = await self._steps(namespace, run), time.time()
        pipe = self._db.client.pipeline(transaction=False)
        for kid in kids:
            key = self._of(kid).key("entry", kid)
            pipe.hmget(key, ("state", "expires_at")).hstrlen(key, "body")
        replies = await self._db.do(pipe.execute()) if kids else []
        wanted, total, whole = [], 0, True
        for kid, (state, expires_at), size in zip(kids, replies[::2], replies[1::2]):
            if state == b"complete" and float(expires_at) > now:
                total += size
                if total > max_bytes:
                    whole = False
                    break
                wanted.append(kid)
        rows = await self._read_each(wanted, *READ_FIELDS)
        entries = (_entry(values) for values in rows if values[0] is not None)
        return {entry.kid: entry for entry in entries}, whole

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        return await self._db.script("renew", [self._of(kid).key("entry", kid)],
                                     [owner, field(time.time() + lease_s)]) == 1

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        shard = self._of(kid)
        try:
            return await self._pipelined_script(
                "complete", [shard.key("entry", kid), shard.key("partial", kid)],
                [owner, shard.channel, kid, *_flat(_response_fields(recorded, time.time()))]) == 1
        finally:
            self._waiters.wake(kid)

    async def release(self, kid: str, owner: str) -> None:
        shard = self._of(kid)
        try:
            gone = await self._db.script("release", [shard.key("entry", kid), shard.key("partial", kid)],
                                         [owner, shard.channel, kid])
        finally:
            self._waiters.wake(kid)
        if gone and gone[0]:  # a run's step: out of its journal, its occurrence given back
            rk, key, epoch, fingerprint, tenant, created_at, expires_at = (text(x) for x in gone)
            run_shard = self._of(rk)
            await self._db.script(
                "unindex_step", [run_shard.key("steps", rk), run_shard.key("steps-expiry"), run_shard.key("occ", rk)],
                [kid, f"{kid} {rk}", created_at, int(float(expires_at) * 1000), key, epoch, fingerprint, tenant])

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str,
                         evidence: dict | None = None) -> None:
        shard = self._of(kid)
        try:
            await self._db.script("set_state", [shard.key("entry", kid), shard.key("partial", kid),
                                                shard.key("quarantined")],
                                  [owner or "", state, detail, shard.channel, kid,
                                   b"" if evidence is None else orjson.dumps(evidence)])
        finally:
            self._waiters.wake(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str, evidence: dict | None = None) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail, evidence)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        answer = []
        if recorded is not None:
            answer = _flat({**_response_fields(recorded, time.time()), "streamed": 0, "timing": "[]",
                            "detail": ANSWERED_BY_OPERATOR})
        shard = self._of(kid)
        try:
            return await self._db.script("resolve", [shard.key("entry", kid), shard.key("quarantined")],
                                         [shard.channel, kid, *answer]) == 1
        finally:
            self._waiters.wake(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        shard = self._of(kid)
        await self._db.script("append_partial", [shard.key("entry", kid), shard.key("partial", kid)],
                              [owner, seq, data, shard.channel, kid])
        self._waiters.wake(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        flat = await self._db.script("read_partial", [self._of(kid).key("partial", kid)], [after_seq])
        return list(zip(flat[::2], flat[1::2]))

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        # each tallied under its run's epoch now: the runs first, read from their shards
        kids = list(counts)
        rks = [text(rk) for rk, in await self._read_each(kids, "rk")]
        runs = sorted({rk for rk in rks if rk})
        pipe = self._db.client.pipeline(transaction=False)
        for rk in runs:
            pipe.hget(self._of(rk).key("run", rk), "epoch")
        epochs = dict(zip(runs, await self._db.do(pipe.execute()) if runs else []))
        by_shard: dict[Shard, list[int]] = {}
        for i, kid in enumerate(kids):
            by_shard.setdefault(self._of(kid), []).append(i)
        now = field(time.time())
        await asyncio.gather(*(self._db.script(
            "count_replays", [shard.key("entry", kids[i]) for i in picked],
            [now, *(x for i in picked for x in (counts[kids[i]], text(epochs.get(rks[i] or "")) or ""))])
            for shard, picked in by_shard.items()))

    async def purge(self, now: float, batch: int = BATCH) -> int:
        """Forget the index entries of expired journal entries (Redis expires the entries)."""
        purged = sum(await asyncio.gather(*(self._purge_shard(shard, now, batch)
                                            for shard in self._db.layout.shards)))
        # quarantined entries expired, or taken over after they expired (count_quarantined)
        pipe = self._db.client.pipeline(transaction=False)
        for shard in self._db.layout.shards:
            pipe.zremrangebyscore(shard.key("quarantined"), "-inf", int(now * 1000))
        await self._db.do(pipe.execute())
        return purged

    async def _purge_shard(self, shard: Shard, now: float, batch: int) -> int:
        """One shard's steps-expiry: the members due, their entries' PTTL read where they live,
        then the index entries of those gone dropped (PURGE_STEPS)."""
        client, now_ms = self._db.client, int(now * 1000)

        async def step() -> tuple[int, bool]:
            members = [m.decode() for m in await self._db.do(client.zrangebyscore(
                shard.key("steps-expiry"), "-inf", now_ms, start=0, num=batch))]
            if not members:
                return 0, False
            pipe = client.pipeline(transaction=False)
            for member in members:
                kid = member.partition(" ")[0]
                pipe.pttl(self._of(kid).key("entry", kid))
            ttls = await self._db.do(pipe.execute())
            gone = await self._db.script("purge_steps", [shard.key("steps-expiry")],
                                         [now_ms, shard.prefix, *(x for pair in zip(members, ttls) for x in pair)])
            return gone, len(members) == batch and gone > 0
        return await paced(step)

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        rows = await self._read_each(await self._steps(namespace, run), *LISTED_FIELDS)
        return [_listed(row) for row in rows if row[0] is not None]

    async def search(self, *, state: str | None = None, key: str | None = None, tenant: str | None = None,
                     run: str | None = None, limit: int = 100) -> list[Entry]:
        """Scans the entries (SCAN, in steps of a thousand keys: it never blocks the server)."""
        now = time.time()
        wanted = {name: value for name, value in
                  (("state", state), ("key", key), ("tenant", tenant), ("run", run)) if value is not None}
        newest: list[tuple[float, str, Entry]] = []  # a heap of the `limit` newest found so far
        async for found in self._db.scan("entry:"):
            for row in await self._read_each([name[len("entry:"):] for _, name in found], *LISTED_FIELDS):
                if row[0] is None:
                    continue
                entry = _listed(row)
                if entry.expires_at > now and all(getattr(entry, f) == v for f, v in wanted.items()):
                    item = (entry.created_at, entry.kid, entry)
                    (heapq.heappush if len(newest) < limit else heapq.heappushpop)(newest, item)
        return [entry for _, _, entry in sorted(newest, reverse=True)]

    async def kids(self, prefix: str, limit: int) -> list[str]:
        found: set[str] = set()
        async for names in self._db.scan("entry:" + prefix):
            found.update(name[len("entry:"):] for _, name in names)
            if len(found) >= limit:
                break
        return sorted(found)[:limit]

    async def delete_run(self, namespace: str, run: str) -> int:
        rk = run_ref(namespace, run)
        run_shard, steps = self._of(rk), await self._scored_steps(namespace, run)
        deleted = 0
        try:  # the entries, then their index; the generation last, even after a failure (Journal.generation)
            for start in range(0, max(len(steps), 1), BATCH):
                some = steps[start:start + BATCH]
                by_shard: dict[Shard, list[str]] = {}
                for kid, _ in some:
                    by_shard.setdefault(self._of(kid), []).append(kid)
                deleted += sum(await asyncio.gather(*(self._db.script(
                    "delete_entries", [shard.key("quarantined"), *(
                        k for kid in mine for k in (shard.key("entry", kid), shard.key("partial", kid)))],
                    mine) for shard, mine in by_shard.items())))
                await self._db.script("delete_steps", [run_shard.key("steps", rk), run_shard.key("occ", rk),
                                                       run_shard.key("steps-expiry")],
                                      [rk, *(x for kid, at in some for x in (kid, field(at)))])
        finally:
            await self._db.do(self._db.client.incr(self._db.key("generation")))
        return deleted

    async def index_quarantined(self) -> None:
        """Index the quarantined entries made before the ``quarantined`` zset was kept (once per
        key prefix, at a migrating open): it SCANs every entry, so its marker is set after it."""
        client, marker = self._db.client, self._db.key("layout", "quarantined")
        if await self._db.do(client.exists(marker)):
            return
        async for names in self._db.scan("entry:"):
            kids = [name[len("entry:"):] for _, name in names]
            rows = await self._read_each(kids, "state", "expires_at")
            found = [(kid, int(float(expires) * 1000)) for kid, (state, expires) in zip(kids, rows)
                     if state == b"unknown" and expires]
            if found:
                pipe = client.pipeline(transaction=False)
                for kid, expires_ms in found:
                    pipe.zadd(self._of(kid).key("quarantined"), {kid: expires_ms})
                await self._db.do(pipe.execute())
        await self._db.do(client.set(marker, b"1"))

    async def count_quarantined(self) -> int:
        # by their expiry (ms): one quarantined past its retention is not counted, before the purge
        pipe = self._db.client.pipeline(transaction=False)
        for shard in self._db.layout.shards:
            pipe.zcount(shard.key("quarantined"), f"({int(time.time() * 1000)}", "+inf")
        return sum(await self._db.do(pipe.execute()))

    async def generation(self) -> int:
        return int(await self._db.do(self._db.client.get(self._db.key("generation"))) or 0)

    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not runs:
            return {}
        pipe = self._db.client.pipeline(transaction=False)
        for namespace, run in runs:
            rk = run_ref(namespace, run)
            pipe.zcard(self._of(rk).key("steps", rk))
        counts = await self._db.do(pipe.execute())
        return {ref: n for ref, n in zip(runs, counts) if n}
