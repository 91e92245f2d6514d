"""The Redis store's journal: claims, records, quarantines, streams in flight, purges.

Every change is one Lua script (:mod:`.scripts`), so it is atomic. The calls of the
request path (get, claim, complete) that arrive together go as one pipeline
(:mod:`..batching`).
"""

from __future__ import annotations

import heapq
import re
import time
from typing import Any, Awaitable

import orjson

from ..batching import Batches, GiveBack
from ..model import ANSWERED_BY_OPERATOR, Claim, ClaimResult, Entry, EntryState, Recorded
from ..purging import paced
from ..rules import counted, replayed_from
from .connection import RedisConnection
from .durability import ReplicasBehind
from .journal_scripts import ENTRY_FIELDS, READ_FIELDS
from .values import field, maybe, run_ref, text


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

    async def get(self, kid: str) -> Entry | None:
        values = await self._pipelined_script("read", [self._db.key("entry", kid)], [])
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
        scope, now, key = claim.scope, time.time(), self._db.key
        kid, rk = scope.kid, run_ref(claim.namespace, scope.run) if scope.run else ""
        entry = claim.entry(now)
        fields = {name: field(value) for name in ENTRY_FIELDS if (value := getattr(entry, name)) is not None}
        if rk:
            fields["rk"] = rk  # so release() finds the run's occurrence counters and journal
        fenced = scope.run is not None and claim.epoch is not None
        try:
            reply = await self._pipelined_script(
                "claim", [key("entry", kid), key("partial", kid), key("run", rk), key("steps", rk),
                          key("steps-expiry"), key("quarantined")],
                [field(now), claim.epoch if fenced else "", claim.fingerprint, claim.owner, claim.on_expired,
                 int(entry.expires_at * 1000), kid, f"{kid} {rk}" if rk else "", orjson.dumps(fields)],
                claim)
        except ReplicasBehind:  # won on the master alone: the caller is refused, so the key is freed
            self._give_back.add(kid, claim.owner, claim.lease_s)
            raise
        if reply[0] == b"stale":
            return ClaimResult(False, None, stale_epoch=int(reply[1]))
        if reply[0] == b"won":
            return ClaimResult(True, entry)
        return ClaimResult(False, _entry(reply[1]))

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float, *, tenant: str) -> int:
        key = self._db.key("occ", run_ref(namespace, run))
        pipe = self._db.client.pipeline(transaction=True)
        # the counter outlives, by one retention, the last entry it numbered
        pipe.hincrby(key, f"{-1 if epoch is None else epoch}:{counted(tenant, fingerprint)}", 1)
        pipe.pexpire(key, int(retention_s * 1000))
        n, _ = await self._db.do(pipe.execute())
        return n - 1

    async def replay_occurrence(self, namespace: str, run: str, epoch: int, fingerprint: str,
                                retention_s: float, *, tenant: str) -> int | None:
        rk = run_ref(namespace, run)
        return await self._pipelined_script("replay_occurrence", [self._db.key("run", rk), self._db.key("occ", rk)],
                                            [epoch, f"{epoch}:{counted(tenant, fingerprint)}",
                                             int(retention_s * 1000)])

    async def recorded(self, namespace: str, run: str, max_bytes: int) -> tuple[dict[str, Entry], bool]:
        complete, rows = await self._db.script("recorded", [self._db.key("steps", run_ref(namespace, run))],
                                               [self._db.prefix, field(time.time()), max_bytes])
        entries = (_entry(values) for values in rows)
        return {entry.kid: entry for entry in entries}, complete == 1

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        return await self._db.script("renew", [self._db.key("entry", kid)],
                                     [owner, field(time.time() + lease_s)]) == 1

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        try:
            return await self._pipelined_script(
                "complete", [self._db.key("entry", kid), self._db.key("partial", kid)],
                [owner, self._db.channel, kid, *_flat(_response_fields(recorded, time.time()))]) == 1
        finally:
            self._waiters.wake(kid)

    async def release(self, kid: str, owner: str) -> None:
        key = self._db.key
        try:
            await self._db.script("release", [key("entry", kid), key("partial", kid), key("steps-expiry")],
                                  [owner, self._db.channel, kid, self._db.prefix])
        finally:
            self._waiters.wake(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str,
                         evidence: dict | None = None) -> None:
        key = self._db.key
        try:
            await self._db.script("set_state", [key("entry", kid), key("partial", kid), key("quarantined")],
                                  [owner or "", state, detail, self._db.channel, kid,
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
        try:
            return await self._db.script("resolve", [self._db.key("entry", kid), self._db.key("steps-expiry"),
                                                     self._db.key("quarantined")],
                                         [self._db.channel, kid, self._db.prefix, *answer]) == 1
        finally:
            self._waiters.wake(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._db.script("append_partial", [self._db.key("entry", kid), self._db.key("partial", kid)],
                              [owner, seq, data, self._db.channel, kid])
        self._waiters.wake(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        flat = await self._db.script("read_partial", [self._db.key("partial", kid)], [after_seq])
        return list(zip(flat[::2], flat[1::2]))

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        if counts:
            await self._db.script("count_replays", [self._db.key("entry", kid) for kid in counts],
                                  [self._db.prefix, field(time.time()), *counts.values()])

    async def purge(self, now: float, batch: int = 1000) -> int:
        """Forget the index entries of expired journal entries (Redis expires the entries)."""
        async def step() -> tuple[int, bool]:  # in batches, so no script holds the server for long
            seen, gone = await self._db.script("purge", [self._db.key("steps-expiry")],
                                               [int(now * 1000), batch, self._db.prefix])
            return gone, seen == batch and gone > 0
        purged = await paced(step)
        # quarantined entries expired, or taken over after they expired (count_quarantined)
        await self._db.do(self._db.client.zremrangebyscore(self._db.key("quarantined"), "-inf", int(now * 1000)))
        return purged

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        client = self._db.client
        kids = await self._db.do(client.zrange(self._db.key("steps", run_ref(namespace, run)), 0, -1))
        pipe = client.pipeline(transaction=False)
        for kid in kids:
            pipe.hmget(self._db.key("entry", kid.decode()), LISTED_FIELDS)
        rows = await self._db.do(pipe.execute()) if kids else []
        return [_listed(row) for row in rows if row[0] is not None]

    async def search(self, *, state: str | None = None, key: str | None = None, tenant: str | None = None,
                     run: str | None = None, limit: int = 100) -> list[Entry]:
        """Scans the entries (SCAN, in steps of a thousand keys: it never blocks the server)."""
        client, now = self._db.client, time.time()
        wanted = {name: value for name, value in
                  (("state", state), ("key", key), ("tenant", tenant), ("run", run)) if value is not None}
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._db.prefix) + "entry:*"
        newest: list[tuple[float, str, Entry]] = []  # a heap of the `limit` newest found so far
        cursor = 0
        while True:
            cursor, names = await self._db.scan(cursor, pattern)
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hmget(name, LISTED_FIELDS)
            for row in await self._db.do(pipe.execute()) if names else []:
                if row[0] is None:
                    continue
                entry = _listed(row)
                if entry.expires_at > now and all(getattr(entry, f) == v for f, v in wanted.items()):
                    item = (entry.created_at, entry.kid, entry)
                    (heapq.heappush if len(newest) < limit else heapq.heappushpop)(newest, item)
            if cursor == 0:
                return [entry for _, _, entry in sorted(newest, reverse=True)]

    async def kids(self, prefix: str, limit: int) -> list[str]:
        client, start = self._db.client, len(self._db.key("entry", "").encode())
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._db.key("entry", prefix)) + "*"
        found: set[str] = set()
        cursor = 0
        while True:
            cursor, names = await self._db.scan(cursor, pattern)
            found.update(name[start:].decode() for name in names)
            if cursor == 0 or len(found) >= limit:
                return sorted(found)[:limit]

    async def delete_run(self, namespace: str, run: str) -> int:
        rk = run_ref(namespace, run)
        return await self._db.script("delete_journal", [self._db.key("steps", rk), self._db.key("occ", rk),
                                                        self._db.key("steps-expiry"), self._db.key("generation"),
                                                        self._db.key("quarantined")],
                                     [self._db.prefix, rk])

    async def index_quarantined(self) -> None:
        """Index the quarantined entries made before the ``quarantined`` zset was kept (once per
        key prefix, at a migrating open): it SCANs every entry, so its marker is set after it."""
        client, marker = self._db.client, self._db.key("layout", "quarantined")
        if await self._db.do(client.exists(marker)):
            return
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._db.prefix) + "entry:*"
        start, cursor = len(self._db.key("entry", "").encode()), 0
        while True:
            cursor, names = await self._db.scan(cursor, pattern)
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hmget(name, ("state", "expires_at"))
            rows = await self._db.do(pipe.execute()) if names else []
            found = {name[start:].decode(): int(float(expires) * 1000)
                     for name, (state, expires) in zip(names, rows) if state == b"unknown" and expires}
            if found:
                await self._db.do(client.zadd(self._db.key("quarantined"), found))
            if cursor == 0:
                break
        await self._db.do(client.set(marker, b"1"))

    async def count_quarantined(self) -> int:
        # by their expiry (ms): one quarantined past its retention is not counted, before the purge
        return await self._db.do(self._db.client.zcount(self._db.key("quarantined"), f"({int(time.time() * 1000)}",
                                                        "+inf"))

    async def generation(self) -> int:
        return int(await self._db.do(self._db.client.get(self._db.key("generation"))) or 0)

    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not runs:
            return {}
        pipe = self._db.client.pipeline(transaction=False)
        for namespace, run in runs:
            pipe.zcard(self._db.key("steps", run_ref(namespace, run)))
        counts = await self._db.do(pipe.execute())
        return {ref: n for ref, n in zip(runs, counts) if n}
