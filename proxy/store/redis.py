"""Redis store (``redis://host:port/db?prefix=idem:``, ``rediss://`` for TLS).

Every key starts with ``prefix`` (default ``idem:``), so several deployments, or tests,
share one database. ``rk`` names a run: ``{len(namespace)}:{namespace}:{run_id}``,
unambiguous whatever the namespace holds. The layout::

    entry:{kid}        hash   a journal entry and its response; expires at its retention
    partial:{kid}      hash   a stream in flight: seq -> bytes (0: status and headers as JSON)
    steps:{rk}         zset   kid -> created_at: a run's journal
    steps-expiry       zset   "{kid} {rk}" -> expiry (ms): lets purge() clean steps:{rk}
    occ:{rk}           hash   "{epoch}:{fingerprint}" -> occurrences (derived keys)
    run:{rk}           hash   a run;  history:{rk}  list  its last 50 events (JSON)
    restarts:{rk}      list   times of the restarts that count towards max_restarts, in its window
    runs, runs:{state} zset   rk -> created_at, for listing
    runs-deadline      zset   rk -> last_seen + timeout_s of live runs: silent-run detection
    runs-named:{id}    set    rks of the runs called {id} (one per namespace)
    secret:{name}      string
    channel {prefix}changed   pub/sub: a kid whose entry changed, to wake waiters

Every change is one Lua script (:mod:`.redis_scripts`), so it is atomic. The calls of the
request path (get, claim, complete) that arrive together go as one pipeline
(:mod:`.batching`). Waiters are woken by pub/sub, with a slow poll in case a message is lost. Durability is Redis's own
(:func:`durability_of`); every Redis error becomes :class:`StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import hiredis
import orjson
import redis.asyncio as redis_asyncio  # the redis-py library: absolute imports never mean this module
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..config import mask_url
from .base import (HISTORY_LIMIT, RUN_STATES, Claim, ClaimResult, Entry, EntryState, Recorded, Run, RunState,
                   StoreUnavailable, Waiters, check_settable)
from .batching import Batches, GiveBack
from .redis_scripts import ENTRY_FIELDS, READ_FIELDS, SCRIPTS

log = logging.getLogger("idemproxy.store")

POLL_S = 0.5  # a waiter looks again this often even when no notification comes
LISTEN_S = 1.0  # how long the notification reader blocks per read
RECONNECT_S = (0.1, 2.0)  # notification reader's backoff after losing Redis, first and most


def durability_of(appendonly: str | None, appendfsync: str | None) -> str:
    """How durable an acknowledged record is, in one plain sentence."""
    if appendonly is None:
        return ("unknown: CONFIG is disabled on this Redis, so its appendonly/appendfsync "
                "settings cannot be read")
    if appendonly != "yes":
        return "Redis appendonly=no: records live in memory only; a Redis restart loses them"
    if appendfsync == "always":
        return "Redis appendonly=yes, appendfsync=always: every write is fsynced before Redis answers"
    if appendfsync == "everysec":
        return ("Redis appendonly=yes, appendfsync=everysec: up to ~1 s of acknowledged records "
                "can be lost on a crash of the Redis host")
    return (f"Redis appendonly=yes, appendfsync={appendfsync}: the OS decides when records reach "
            "the disk; a crash of the Redis host can lose the last ~30 s of acknowledged records")


def split_url(url: str) -> tuple[str, str]:
    """(the URL for redis-py, our key prefix): ``prefix`` is ours, not a redis-py option."""
    parts = urlsplit(url)
    prefix, kept = "idem:", []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "prefix":
            prefix = value
        else:
            kept.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), prefix


def run_ref(namespace: str, run_id: str) -> str:
    """A run's name in keys: the length prefix keeps any namespace apart from the run id."""
    return f"{len(namespace.encode())}:{namespace}:{run_id}"


def _flat(fields: dict[str, Any]) -> list[Any]:
    """{name: value} as [name, value, ...] for HSET; bytes stay bytes, the rest become text."""
    return [x for name, value in fields.items()
            for x in (name, value if isinstance(value, bytes) else str(value))]


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _maybe(kind: type, value: bytes | None) -> Any:
    return None if value is None else kind(value)


def _fields(raw: dict | list) -> dict[str, bytes]:
    """A hash as {name: value}, from HGETALL's dict or a script's flat [name, value, ...]."""
    if isinstance(raw, list):
        raw = dict(zip(raw[::2], raw[1::2]))
    return {_text(name): value for name, value in raw.items()}


def _entry(values: list[bytes | None]) -> Entry:
    """An entry from its hash's values in READ_FIELDS order (a shorter list: no response body)."""
    (kid, tenant, run, epoch, upstream, key, fingerprint, state, owner, lease_until, created_at,
     completed_at, expires_at, replays, detail, method, path, namespace, status, headers, body,
     streamed, timing) = (*values, *[None] * (len(READ_FIELDS) - len(values)))
    entry = Entry(kid.decode(), tenant.decode(), _text(run), _maybe(int, epoch), upstream.decode(),
                  key.decode(), fingerprint.decode(), state.decode(), _text(owner), float(lease_until),
                  float(created_at), _maybe(float, completed_at), float(expires_at), int(replays or 0),
                  _text(detail), _text(method) or "", _text(path) or "", _text(namespace) or "default")
    if status is not None:  # journal() reads the status alone, without headers and body
        entry.response = Recorded(int(status), [tuple(h) for h in orjson.loads(headers or b"[]")],
                                  body or b"", streamed == b"1",
                                  [tuple(t) for t in orjson.loads(timing or b"[]")])
    return entry


def _run(raw: dict | list, history: list[bytes], restart_times: list[bytes]) -> Run:
    f = _fields(raw)
    return Run(_text(f["tenant"]), _text(f["run_id"]), _text(f["state"]), int(f["epoch"]),
               int(f["restarts"]), float(f["last_seen"]), float(f["started_at"]),
               float(f["timeout_s"]), float(f["grace_s"]), int(f["max_restarts"]),
               _text(f.get("hook")), orjson.loads(f.get("metadata") or b"{}"),
               float(f["created_at"]), _maybe(float, f.get("ended_at")),
               float(f.get("next_restart_at") or 0), [orjson.loads(h) for h in history],
               [float(t) for t in restart_times])


def _response_fields(recorded: Recorded, now: float) -> dict[str, Any]:
    return {"state": EntryState.COMPLETE, "status": recorded.status, "headers": orjson.dumps(recorded.headers),
            "body": recorded.body, "streamed": int(recorded.streamed),
            "timing": orjson.dumps(recorded.timing), "completed_at": now}


class RedisStore:
    def __init__(self, url: str, timeout: float = 5.0):
        self.journal = self.runs = self  # one object plays both parts until the split into packages
        self.url, self.prefix = split_url(url)
        self.timeout = timeout
        self.durability = "unknown until the store is opened"
        # The claim script answers a taken key with its entry, but a replay costs 12 µs more
        # through it than through the read script, and a record saves only 8 µs (measured):
        # replays are what a restarted run is made of, so the proxy reads first.
        self.claim_reads = False
        self._channel = self.prefix + "changed"
        self._client: redis_asyncio.Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._listener: asyncio.Task | None = None
        self._waiters = Waiters(POLL_S)
        self._pipelined = Batches("redis", self._pipeline, timeout, self._unanswered)
        self._give_back = GiveBack(self.release)

    def __repr__(self) -> str:
        return f"RedisStore({mask_url(self.url)!r}, prefix={self.prefix!r})"

    # -- connections ----------------------------------------------------------------------

    async def open(self) -> None:
        # One quick retry on a broken connection; timeouts are not retried, since a command
        # that timed out may have run. Every call is also bounded by `timeout` as a whole.
        client = redis_asyncio.Redis.from_url(
            self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=False)
        try:
            async with asyncio.timeout(self.timeout * 2):
                await client.ping()
                appendonly, appendfsync = await self._persistence(client)
                self.durability = durability_of(appendonly, appendfsync)
                pubsub = await self._subscribe(client)
        except (RedisError, OSError) as exc:
            await client.aclose()
            raise StoreUnavailable(f"cannot reach {mask_url(self.url)}: {exc or type(exc).__name__}") from exc
        self._client = client
        self._scripts = {name: client.register_script(source) for name, source in SCRIPTS.items()}
        self._listener = asyncio.create_task(self._listen(pubsub), name="idemproxy-redis-notifications")
        if (appendonly, appendfsync) != ("yes", "always"):
            log.warning("redis durability: %s", self.durability)

    @staticmethod
    async def _persistence(client: redis_asyncio.Redis) -> tuple[str | None, str | None]:
        try:
            config = await client.config_get("append*")
        except ResponseError:  # CONFIG renamed away or refused by an ACL
            return None, None
        config = {_text(name): _text(value) for name, value in config.items()}
        return config.get("appendonly"), config.get("appendfsync")

    async def aclose(self) -> None:
        await self._pipelined.flushed()  # pending records first
        await self._give_back.aclose()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
        self._wake_all()

    async def _do(self, awaitable: Awaitable[Any]) -> Any:
        """Await one Redis call; any failure, or no answer within ``timeout``, is StoreUnavailable."""
        try:
            async with asyncio.timeout(self.timeout):
                return await awaitable
        except TimeoutError:
            raise StoreUnavailable(f"redis did not answer within {self.timeout}s") from None
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc

    @property
    def _redis(self) -> redis_asyncio.Redis:
        if self._client is None:
            raise StoreUnavailable("store is closed")
        return self._client

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Awaitable[Any]:
        if self._client is None:
            raise StoreUnavailable("store is closed")
        return self._do(self._scripts[name](keys=keys, args=args))

    async def _pipeline(self, calls: list[tuple[tuple[Any, ...], Claim | None]]) -> list[Any]:
        """Commands that arrived together, as one pipeline: a result or an error each.

        Scripts go by their SHA; any the server lost (a restart, SCRIPT FLUSH) are loaded
        again and only their commands re-sent: a NOSCRIPT reply means nothing ran.
        """
        commands = [command for command, _ in calls]
        results = await self._do(self._send(commands))
        lost = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if lost:
            for script in self._scripts.values():
                await self._do(self._redis.script_load(script.script))
            for i, result in zip(lost, await self._do(self._send([commands[i] for i in lost]))):
                results[i] = result
        return [StoreUnavailable(f"redis: {type(r).__name__}: {r}") if isinstance(r, RedisError) else r
                for r in results]

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Write the commands at once on one pooled connection, then read every reply.

        Packed by hiredis in C: redis-py packs in Python, ~1 µs per argument, which was a
        third of a record's store cost (a claim has twenty arguments). Not retried: a
        command whose reply was lost may have run (the pool checks a link before lending it).
        """
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(b"".join(map(hiredis.pack_command, commands)), check_health=False)
            results = []
            for _ in commands:
                try:
                    results.append(await conn.read_response())
                except ResponseError as exc:  # the server's error reply to this one command
                    results.append(exc)
            return results
        except BaseException:  # broken, timed out or cancelled: replies may still come; drop the link
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    def _unanswered(self, call: tuple[tuple[Any, ...], Claim | None], outcome: object) -> None:
        """A claim its caller gave up on (or whose pipeline failed) may be written: give it back."""
        _, claim = call
        if claim is not None and not (isinstance(outcome, list) and outcome[0] != b"won"):
            self._give_back.add(claim.scope.kid, claim.owner, claim.lease_s)

    def _pipelined_script(self, name: str, keys: list[str], args: list[Any],
                          claim: Claim | None = None) -> Awaitable[Any]:
        script = self._scripts[name]
        return self._pipelined((("EVALSHA", script.sha, len(keys), *keys, *args), claim))

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- notifications --------------------------------------------------------------------

    async def _subscribe(self, client: redis_asyncio.Redis):
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def _listen(self, pubsub) -> None:
        """Wake local waiters on every change any proxy publishes; resubscribe after an outage."""
        delay = RECONNECT_S[0]
        try:
            while True:
                try:
                    if pubsub is None:
                        pubsub = await asyncio.wait_for(self._subscribe(self._redis), self.timeout)
                        log.info("redis notifications resumed")
                        self._wake_all()  # changes made meanwhile went unheard
                    delay = RECONNECT_S[0]
                    while True:
                        message = await pubsub.get_message(timeout=LISTEN_S)
                        if message is not None and message["type"] == "message":
                            self._notify(message["data"].decode())
                except Exception as exc:  # noqa: BLE001 - the reader must outlive any outage
                    level = logging.WARNING if delay == RECONNECT_S[0] else logging.DEBUG
                    log.log(level, "redis notifications lost (%s); waiters poll meanwhile", exc)
                    if pubsub is not None:
                        with contextlib.suppress(Exception):
                            await pubsub.aclose()
                        pubsub = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_S[1])
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _notify(self, kid: str) -> None:
        self._waiters.wake(kid)

    def _wake_all(self) -> None:
        self._waiters.wake_all()

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def ping(self) -> None:
        await self._do(self._redis.ping())

    async def secret(self, name: str, generate: bytes) -> bytes:
        key = self._key("secret", name)
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(key, generate, nx=True).get(key)
        _, value = await self._do(pipe.execute())
        return value

    # -- journal --------------------------------------------------------------------------

    async def get(self, kid: str) -> Entry | None:
        values = await self._pipelined_script("read", [self._key("entry", kid)], [])
        if values[0] is None:
            return None
        entry = _entry(values)
        return entry if entry.expires_at > time.time() else None

    async def claim(self, claim: Claim) -> ClaimResult:
        scope, now = claim.scope, time.time()
        kid, rk = scope.kid, run_ref(claim.namespace, scope.run) if scope.run else ""
        entry = claim.entry(now)
        fields = {name: str(value) for name in ENTRY_FIELDS if (value := getattr(entry, name)) is not None}
        if rk:
            fields["rk"] = rk  # so release() finds the run's occurrence counters and journal
        fenced = scope.run is not None and claim.epoch is not None
        reply = await self._pipelined_script(
            "claim", [self._key("entry", kid), self._key("partial", kid), self._key("run", rk),
                      self._key("steps", rk), self._key("steps-expiry")],
            [repr(now), claim.epoch if fenced else "", claim.fingerprint, claim.owner, claim.on_expired,
             int(entry.expires_at * 1000), kid, f"{kid} {rk}" if rk else "", orjson.dumps(fields)],
            claim)
        if reply[0] == b"stale":
            return ClaimResult(False, None, stale_epoch=int(reply[1]))
        if reply[0] == b"won":
            return ClaimResult(True, entry)
        return ClaimResult(False, _entry(reply[1]))

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float) -> int:
        key = self._key("occ", run_ref(namespace, run))
        pipe = self._redis.pipeline(transaction=True)
        # the counter outlives, by one retention, the last entry it numbered
        pipe.hincrby(key, f"{-1 if epoch is None else epoch}:{fingerprint}", 1)
        pipe.pexpire(key, int(retention_s * 1000))
        n, _ = await self._do(pipe.execute())
        return n - 1

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        return await self._script("renew", [self._key("entry", kid)],
                                  [owner, repr(time.time() + lease_s)]) == 1

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        try:
            return await self._pipelined_script(
                "complete", [self._key("entry", kid), self._key("partial", kid)],
                [owner, self._channel, kid, *_flat(_response_fields(recorded, time.time()))]) == 1
        finally:
            self._notify(kid)

    async def release(self, kid: str, owner: str) -> None:
        try:
            await self._script("release", [self._key("entry", kid), self._key("partial", kid),
                                           self._key("steps-expiry")],
                               [owner, self._channel, kid, self.prefix])
        finally:
            self._notify(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str) -> None:
        try:
            await self._script("set_state", [self._key("entry", kid), self._key("partial", kid)],
                               [owner or "", state, detail, self._channel, kid])
        finally:
            self._notify(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        answer = []
        if recorded is not None:
            answer = _flat({**_response_fields(recorded, time.time()), "streamed": 0, "timing": "[]",
                            "detail": "resolved by operator"})
        try:
            return await self._script("resolve", [self._key("entry", kid), self._key("steps-expiry")],
                                      [self._channel, kid, self.prefix, *answer]) == 1
        finally:
            self._notify(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._script("append_partial", [self._key("entry", kid), self._key("partial", kid)],
                           [owner, seq, data, self._channel, kid])
        self._notify(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        flat = await self._script("read_partial", [self._key("partial", kid)], [after_seq])
        return list(zip(flat[::2], flat[1::2]))

    async def count_replays(self, counts: dict[str, int]) -> None:
        if counts:
            await self._script("count_replays", [self._key("entry", kid) for kid in counts],
                               list(counts.values()))

    async def purge(self, now: float, batch: int = 1000) -> int:
        """Forget the index entries of expired journal entries (Redis expires the entries)."""
        total = 0
        while True:  # in batches, so no script holds the server for long
            seen, gone = await self._script("purge", [self._key("steps-expiry")],
                                            [int(now * 1000), batch, self.prefix])
            total += gone
            if seen < batch or gone == 0:
                return total

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        kids = await self._do(self._redis.zrange(self._key("steps", run_ref(namespace, run)), 0, -1))
        pipe = self._redis.pipeline(transaction=False)
        for kid in kids:
            pipe.hmget(self._key("entry", kid.decode()), (*ENTRY_FIELDS, "status"))
        rows = await self._do(pipe.execute()) if kids else []
        return [_entry(row) for row in rows if row[0] is not None]

    async def delete_run(self, namespace: str, run: str) -> int:
        rk = run_ref(namespace, run)
        return await self._script("delete_journal", [self._key("steps", rk), self._key("occ", rk),
                                                     self._key("steps-expiry")], [self.prefix, rk])

    # -- runs -----------------------------------------------------------------------------

    async def _runs(self, rks: list[str]) -> list[Run]:
        if not rks:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for rk in rks:
            pipe.hgetall(self._key("run", rk)).lrange(self._key("history", rk), 0, -1)
            pipe.lrange(self._key("restarts", rk), 0, -1)
        replies = await self._do(pipe.execute())
        return [_run(h, history, times)
                for h, history, times in zip(replies[::3], replies[1::3], replies[2::3]) if h]

    @staticmethod
    def _new_run_fields(run: Run) -> dict[str, str | None]:
        fields = {"tenant": run.namespace, "run_id": run.run_id, "state": run.state, "epoch": run.epoch,
                  "restarts": run.restarts, "last_seen": run.last_seen, "started_at": run.started_at,
                  "timeout_s": run.timeout_s, "grace_s": run.grace_s, "max_restarts": run.max_restarts,
                  "hook": run.hook, "metadata": orjson.dumps(run.metadata).decode(),
                  "created_at": run.created_at, "ended_at": run.ended_at,
                  "next_restart_at": run.next_restart_at}
        return {k: None if v is None else str(v) for k, v in fields.items()}

    async def upsert(self, run: Run) -> Run:
        new = self._new_run_fields(run)
        update = {k: new[k] for k in ("timeout_s", "grace_s", "max_restarts", "hook", "metadata")}
        history = [orjson.dumps(event).decode() for event in run.history[-HISTORY_LIMIT:]]
        reply = await self._script("upsert_run", [], [self.prefix, run_ref(run.namespace, run.run_id),
                                                      orjson.dumps(new), orjson.dumps(update),
                                                      orjson.dumps(history),
                                                      *map(repr, run.restart_times)])
        return _run(*reply)

    async def find(self, namespace: str | None, run_id: str) -> list[Run]:
        if namespace is not None:
            return await self._runs([run_ref(namespace, run_id)])
        rks = await self._do(self._redis.smembers(self._key("runs-named", run_id)))
        return await self._runs(sorted(rk.decode() for rk in rks))

    async def list(self, state: str | None = None, limit: int = 1000) -> list[Run]:
        index = self._key("runs", state) if state else self._key("runs")
        rks = await self._do(self._redis.zrevrange(index, 0, limit - 1))
        return await self._runs([rk.decode() for rk in rks])

    async def count(self) -> dict[str, int]:
        pipe = self._redis.pipeline(transaction=False)
        for state in RUN_STATES:
            pipe.zcard(self._key("runs", state))
        counts = await self._do(pipe.execute())
        return {state: n for state, n in zip(RUN_STATES, counts) if n}

    async def count_steps(self, runs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not runs:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for namespace, run in runs:
            pipe.zcard(self._key("steps", run_ref(namespace, run)))
        counts = await self._do(pipe.execute())
        return {ref: n for ref, n in zip(runs, counts) if n}

    async def observe_epoch(self, namespace: str, run_id: str, epoch: int | None, defaults: Run,
                            now: float) -> int:
        rk = run_ref(namespace, run_id)
        current = await self._do(self._redis.hget(self._key("run", rk), "epoch"))
        if current is not None and (epoch is None or epoch <= int(current)):
            return int(current)  # the common case: a known run at its current epoch, no write
        new = Run(namespace, run_id, RunState.RUNNING, epoch or 0, 0, now, now, defaults.timeout_s, defaults.grace_s,
                  defaults.max_restarts, defaults.hook, defaults.metadata, now)
        return int(await self._script("observe_epoch", [], [
            self.prefix, rk, "" if epoch is None else epoch, repr(now),
            orjson.dumps(self._new_run_fields(new))]))

    async def touch(self, beats: dict[tuple[str, str], float]) -> None:
        if beats:
            await self._script("touch", [], [self.prefix, *(x for (namespace, run), at in beats.items()
                                                            for x in (run_ref(namespace, run), repr(at)))])

    async def heartbeat(self, namespace: str, run_id: str, now: float,
                        epoch: int | None = None) -> Run | None:
        reply = await self._script("heartbeat", [], [self.prefix, run_ref(namespace, run_id), repr(now),
                                                     "" if epoch is None else epoch])
        return _run(*reply) if reply else None

    async def end(self, namespace: str, run_id: str, state: str, now: float,
                      epoch: int | None = None) -> Run | None:
        reply = await self._script("end_run", [], [self.prefix, run_ref(namespace, run_id), state, repr(now),
                                                   "" if epoch is None else epoch])
        return _run(*reply) if reply else None

    async def new_attempt(self, namespace: str, run_id: str, expected_epoch: int | None, now: float,
                          reason: str, restart: bool, window_s: float | None = None) -> Run | None:
        reply = await self._script("new_attempt", [], [
            self.prefix, run_ref(namespace, run_id), "" if expected_epoch is None else expected_epoch,
            repr(now), reason, int(restart), "" if window_s is None else repr(float(window_s))])
        return _run(*reply) if reply else None

    async def silent(self, now: float) -> list[Run]:
        rks = await self._do(self._redis.zrangebyscore(self._key("runs-deadline"), "-inf", f"({now!r}"))
        runs = await self._runs([rk.decode() for rk in rks])
        return [r for r in runs if r.state in (RunState.RUNNING, RunState.RESTARTING) and r.last_seen + r.timeout_s < now
                and r.started_at + r.grace_s < now and r.next_restart_at <= now]

    async def set_state(self, namespace: str, run_id: str, state: str | None, now: float,
                            event: dict[str, Any] | None = None, **fields: Any) -> None:
        check_settable(fields)
        changes = {k: None if v is None else str(v) for k, v in fields.items()}
        if state is not None:
            changes["state"] = state
        await self._script("set_run_state", [], [
            self.prefix, run_ref(namespace, run_id), orjson.dumps(changes),
            orjson.dumps({"at": now, **event}) if event else ""])
