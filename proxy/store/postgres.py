"""PostgreSQL store: the production store of record (``postgresql://user@host/db``).

Our own URL parameters, removed before the DSN reaches asyncpg: ``schema=NAME`` keeps
the tables in that schema (created if missing; default ``public``) and ``pool_size=N``
caps the connection pool (default 32: fewer connections than concurrent requests made
requests queue for a connection, with p99 in seconds at 32 concurrent in bench/).

- Migrations (:mod:`.postgres_sql`) are numbered and recorded in ``schema_migrations``;
  they run at start in one transaction under ``pg_advisory_xact_lock``, so many
  replicas can start at once.
- A claim is one ``INSERT … ON CONFLICT DO UPDATE … WHERE`` statement that also reads the
  run's epoch ``FOR SHARE``, so a fenced attempt never claims a key.
- Waiters are woken by ``LISTEN``/``NOTIFY``: statements that settle an entry notify its
  kid at commit, and one listener connection per store wakes the local waiters. A slow
  poll covers a lost notification; the listener reconnects when its connection drops.
- Calls that arrive together are one statement (:mod:`.batching`): gets, claims, and
  completes, so N concurrent records share one commit. A claim reads the key's live
  entry first and answers with it, writing nothing: a replay is one read.
- Durability: a commit returns once its WAL is flushed (``synchronous_commit``), turned
  on for our sessions if the server's default is off.
- Connection errors and timeouts become :class:`StoreUnavailable`; every operation is
  bounded by ``timeout``; the pool reconnects on its own when the server is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import orjson

from ..config import mask_url
from . import postgres_sql as sql
from .base import Claim, ClaimResult, Entry, EntryState, Recorded, StoreUnavailable, Waiters
from .batching import Batches, GiveBack
from .postgres_runs import PostgresRuns

log = logging.getLogger("idemproxy.store")

POLL_S = 0.5  # a waiter looks again this often, in case a notification was lost
LISTENER_CHECK_S = 5.0  # how often the idle listener connection proves it is alive
MIGRATE_TIMEOUT_S = 60.0
# SQLSTATE classes that mean "the server cannot serve us now", not "the query is wrong":
# connection (08), transaction rollback (40: deadlock, serialization), resources (53),
# operator intervention, shutdown and our statement_timeout (57), system (58); a read-only
# standby (25006) and our lock_timeout (55P03).
UNAVAILABLE_CLASSES = {"08", "40", "53", "57", "58"}


def _entry(row: asyncpg.Record, response: Recorded | None = None) -> Entry:
    return Entry(*row[:18], response=response)


def _recorded(row: asyncpg.Record) -> Recorded | None:
    if row["status"] is None:
        return None
    return Recorded(row["status"], [tuple(h) for h in row["headers"] or []], row["body"] or b"",
                    row["streamed"], [tuple(t) for t in row["timing"] or []])


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _rows(status: str) -> int:
    """Rows touched, from a command tag such as ``UPDATE 1``."""
    return int(status.rsplit(" ", 1)[-1])


def _unreachable(exc: BaseException) -> bool:
    # ConnectionError is an OSError. InternalClientError: a pooled link caught mid-error by a
    # server going away ("cannot switch to state ..."), seen under load on a fast shutdown.
    if isinstance(exc, (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.InternalClientError)):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", None) or ""
        return state[:2] in UNAVAILABLE_CLASSES or state in ("25006", "55P03")
    return False


@contextlib.contextmanager
def _translated(what: str, timeout: float) -> Iterator[None]:
    """Driver errors that mean the server is out of reach become StoreUnavailable."""
    try:
        yield
    except StoreUnavailable:
        raise
    except Exception as exc:
        if isinstance(exc, TimeoutError):
            raise StoreUnavailable(f"postgres {what}: no answer within {timeout}s") from exc
        if _unreachable(exc):
            raise StoreUnavailable(f"postgres {what}: {type(exc).__name__}: {exc}") from exc
        raise


def _parse_url(url: str) -> tuple[str, str, int]:
    """(asyncpg DSN, schema, pool size) from our URL."""
    parts = urlsplit(url)
    params = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in params if k in ("schema", "pool_size")}
    schema = ours.get("schema", "public")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
        raise ValueError(f"postgres URL: schema must be a plain identifier, got {schema!r}")
    pool_size = int(ours.get("pool_size", "32"))
    dsn = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in params if k not in ours])))
    return dsn, schema, pool_size


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=_json, decoder=orjson.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """We never change session state, so a released connection needs no reset round trip."""


def _describe(sync: str, fsync: str) -> str:
    if fsync != "on":
        return ("PostgreSQL with fsync=off: commits are not forced to disk, so a crash of the "
                "server's machine can lose or corrupt acknowledged records")
    if sync == "off":
        return ("PostgreSQL with fsync=on; the server's synchronous_commit is off, so idemproxy turns it "
                "on for its own sessions: every answer waits for its commit to be flushed to disk")
    return (f"PostgreSQL with fsync=on and synchronous_commit={sync}: every answer waits for its "
            "commit to be flushed to disk")


class PostgresStore(PostgresRuns):
    """The journal, the runs and the secrets in PostgreSQL; see the module docstring."""

    def __init__(self, url: str, timeout: float = 5.0):
        self.journal = self.runs = self  # one object plays both parts until the split into packages
        self.url = url
        self.timeout = timeout
        self._dsn, self.schema, self._pool_size = _parse_url(url)
        self._channel = f"idemproxy:{self.schema}"[:63]  # NOTIFY channel names are identifiers
        self._session: dict[str, str] = {}  # extra server settings for our sessions
        self.durability = "unknown until the store is open"
        self.claim_reads = True  # a taken key's claim is a read, answered with the entry
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncio.Task | None = None
        self._waiters = Waiters(POLL_S)
        self._kept: dict[str, asyncpg.Connection] = {}  # one per kind of batch; see _use
        self._gets = Batches("postgres get", self._get_many, timeout)
        self._claims = Batches("postgres claim", self._claim_many, timeout, self._claim_unanswered)
        self._give_back = GiveBack(self.release)
        self._completes = Batches("postgres complete", self._complete_many, timeout)

    def __repr__(self) -> str:
        return f"PostgresStore({mask_url(self.url)!r})"

    # -- connections ----------------------------------------------------------------------

    def _connect_args(self, role: str) -> dict[str, Any]:
        # enable_seqscan=off: every statement of ours reads or writes rows by a key it has an
        # index for. A deployment starts with empty tables, and asyncpg prepares statements,
        # so PostgreSQL plans them once and keeps that plan (until asyncpg or ANALYZE
        # replaces it): for an empty table, a full scan, kept while the table grows
        # (measured: a fresh schema's records cost the server 4x the CPU). Off, a plan
        # uses the index wherever one fits (tests/test_store_postgres.py checks ours).
        settings = {"search_path": f'"{self.schema}"', "application_name": f"{role}:{self.schema}"[:63],
                    "enable_seqscan": "off"}
        if role == "idemproxy":  # the pool; not the connection that migrates
            # The server gives up when our callers do: a statement that outlived its caller
            # (say, a claim waiting on a lock) must not commit later.
            settings["statement_timeout"] = settings["lock_timeout"] = str(int(self.timeout * 1000))
        return {"timeout": self.timeout, "command_timeout": self.timeout,
                "server_settings": {**settings, **self._session}}

    async def open(self) -> None:
        with _translated("open", MIGRATE_TIMEOUT_S):
            async with asyncio.timeout(MIGRATE_TIMEOUT_S):
                # The first connection migrates, reads the settings, then stays as the listener.
                conn = await asyncpg.connect(self._dsn, **self._connect_args("idemproxy-listen"))
                try:
                    for version in await sql.migrate(conn, self.schema, MIGRATE_TIMEOUT_S):
                        log.info("postgres schema %s: migration %d applied", self.schema, version)
                    sync, fsync = await conn.fetchrow(
                        "SELECT current_setting('synchronous_commit'), current_setting('fsync')")
                    if sync == "off":
                        self._session = {"synchronous_commit": "on"}
                    self.durability = _describe(sync, fsync)
                    if fsync != "on":  # SPEC §7 promises fsynced records; say loudly that they are not
                        log.error("postgres durability: %s", self.durability)
                    self._pool = await asyncpg.create_pool(
                        self._dsn, min_size=1, max_size=self._pool_size, init=_init_connection,
                        reset=_keep_session, **self._connect_args("idemproxy"))
                    await conn.add_listener(self._channel, self._on_notify)
                except BaseException:
                    conn.terminate()
                    if self._pool is not None:
                        self._pool.terminate()
                        self._pool = None
                    raise
        self._listener = asyncio.create_task(self._listen(conn), name="idemproxy-pg-listener")

    async def aclose(self) -> None:
        for batches in (self._completes, self._claims, self._gets):  # pending records first
            await batches.flushed()
        await self._give_back.aclose()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            for conn in self._kept.values():
                await pool.release(conn)
            self._kept.clear()
            try:
                await asyncio.wait_for(pool.close(), self.timeout)
            except Exception:  # noqa: BLE001 - a server that is gone cannot be closed politely
                pool.terminate()
        self._wake_all()

    async def _listen(self, conn: asyncpg.Connection | None) -> None:
        """Keep one LISTEN connection; reconnect with backoff when it drops."""
        delay = 0.1
        while True:
            if conn is not None:
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _: lost.set())
                try:
                    while not lost.is_set():
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(LISTENER_CHECK_S):
                                await lost.wait()
                        if not lost.is_set():  # a silently dead link shows here
                            await conn.fetchval("SELECT 1", timeout=self.timeout)
                except Exception as exc:  # noqa: BLE001 - the listener must outlive any error
                    log.warning("postgres listener lost its connection: %s", exc)
                finally:
                    conn.terminate()
                # Notifications sent while we were deaf are gone: let every waiter look again.
                self._wake_all()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            conn = None
            try:
                conn = await asyncpg.connect(self._dsn, **self._connect_args("idemproxy-listen"))
                await conn.add_listener(self._channel, self._on_notify)
                log.info("postgres listener reconnected")
                delay = 0.1
                self._wake_all()
            except Exception as exc:  # noqa: BLE001
                log.warning("postgres listener cannot reconnect (next try in %.1fs): %s", delay, exc)
                if conn is not None:
                    conn.terminate()
                    conn = None

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, kids: str) -> None:
        for kid in kids.split(" "):  # a batch of records tells its kids in one notification
            self._wake(kid)

    @property
    def poll_s(self) -> float:
        """How long a waiter waits for a notification before it looks for itself."""
        return self._waiters.poll_s

    @poll_s.setter
    def poll_s(self, value: float) -> None:
        self._waiters.poll_s = value

    def _wake(self, kid: str) -> None:
        self._waiters.wake(kid)

    def _wake_all(self) -> None:
        self._waiters.wake_all()

    async def _use(self, what: str, work: Callable[[asyncpg.Connection], Awaitable[Any]],
                   keep: bool = False) -> Any:
        """Run ``work`` on a pooled connection, bounded by the timeout, errors translated.

        With ``keep``, the connection stays out of the pool for the next call of the same
        ``what``: each kind of batch has one in flight at a time, and taking a connection
        from the pool and giving it back costs ~37 µs of CPU, as much as the statement.
        """
        pool = self._pool
        if pool is None:
            raise StoreUnavailable("store is closed")
        with _translated(what, self.timeout):
            async with asyncio.timeout(self.timeout):
                conn = (self._kept.pop(what, None) if keep else None) or await pool.acquire()
                usable = True
                try:
                    return await work(conn)
                except BaseException as exc:
                    # Cut short by the timeout, or the link failed: drop the connection.
                    # Released politely it would wait for the server to confirm the cancel
                    # (a second timeout), or go back to the pool half-dead for the next user.
                    # (Unusable first: asyncpg may have detached a lost link from us already,
                    # and terminate() then raises.)
                    if isinstance(exc, asyncio.CancelledError) or _unreachable(exc):
                        usable = False
                        conn.terminate()
                    raise
                finally:
                    if keep and usable:
                        self._kept[what] = conn
                    else:
                        await pool.release(conn)

    async def _batch(self, what: str, query: str, *args: Any) -> list[asyncpg.Record]:
        """A batch's statement, on the connection kept for batches of its kind."""
        return await self._use(what, lambda c: c.fetch(query, *args), keep=True)

    async def _tx(self, what: str, work: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        async def in_transaction(conn: asyncpg.Connection) -> Any:
            async with conn.transaction():
                return await work(conn)
        return await self._use(what, in_transaction)

    async def _fetch(self, what: str, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self._use(what, lambda c: c.fetch(query, *args))

    async def _fetchrow(self, what: str, query: str, *args: Any) -> asyncpg.Record | None:
        return await self._use(what, lambda c: c.fetchrow(query, *args))

    async def _execute(self, what: str, query: str, *args: Any) -> str:
        return await self._use(what, lambda c: c.execute(query, *args))

    async def ping(self) -> None:
        await self._use("ping", lambda c: c.fetchval("SELECT 1"))

    async def secret(self, name: str, generate: bytes) -> bytes:
        return (await self._fetchrow("secret", sql.SECRET, name, generate))[0]

    # -- journal --------------------------------------------------------------------------

    async def get(self, kid: str) -> Entry | None:
        return await self._gets(kid)

    async def _get_many(self, kids: list[str]) -> list[Entry | None]:
        rows = await self._batch("get", sql.GET_MANY, list(set(kids)), time.time())
        found = {row["kid"]: row for row in rows}
        return [_entry(row, _recorded(row)) if (row := found.get(kid)) else None for kid in kids]

    async def claim(self, claim: Claim) -> ClaimResult:
        kid = claim.scope.kid
        for _ in range(3):
            now = time.time()
            won, run_epoch, live = await self._claims((claim, now))
            if won:
                return ClaimResult(True, claim.entry(now))
            if run_epoch is not None and claim.epoch is not None and run_epoch > claim.epoch:
                return ClaimResult(False, None, stale_epoch=run_epoch)
            lapsed = live is not None and live.state == EntryState.IN_FLIGHT and live.lease_until <= now
            if claim.on_expired == "quarantine" and lapsed:  # its proxy died mid-call: outcome unknown
                quarantined = await self._fetchrow("claim", sql.QUARANTINE_EXPIRED, kid, time.time(),
                                                   "the proxy holding the claim stopped mid-call",
                                                   claim.fingerprint, self._channel)
                if quarantined is not None:
                    self._wake(kid)
                    return ClaimResult(False, _entry(quarantined))
                live = None  # changed meanwhile (completed, or quarantined by another proxy)
            # the entry we lost to, as the claim found it, or as it is now after a race
            existing = live or await self.get(kid)
            if existing is not None:
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
            columns = zip(*((c.scope.kid, c.scope.tenant, c.scope.run, c.epoch, c.scope.upstream,
                             c.scope.key, c.fingerprint, c.method, c.path, c.owner, now + c.lease_s,
                             now, now + c.retention_s, c.namespace) for c, now in (batch[i] for i in members)))
            rows = await self._batch("claim", sql.CLAIM_MANY, *map(list, columns), time.time(), take_over)
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

    async def next_occurrence(self, namespace: str, run: str, epoch: int | None, fingerprint: str,
                              retention_s: float) -> int:
        row = await self._fetchrow("next_occurrence", sql.NEXT_OCCURRENCE, namespace, run,
                                   -1 if epoch is None else epoch, fingerprint, time.time() + retention_s)
        return row[0] - 1

    async def renew(self, kid: str, owner: str, lease_s: float) -> bool:
        return _rows(await self._execute("renew", sql.RENEW, time.time() + lease_s, kid, owner)) == 1

    async def complete(self, kid: str, owner: str, recorded: Recorded) -> bool:
        try:
            return await self._completes((kid, owner, recorded))
        finally:
            self._wake(kid)

    async def _complete_many(self, batch: list[tuple[str, str, Recorded]]) -> list[bool]:
        """Group commit: every complete() queued meanwhile goes in one statement, one commit."""
        # in kid order, as claims lock rows: a takeover batch and this one never wait in a cycle
        columns = zip(*((kid, owner, r.status, _json(r.headers), r.body, r.streamed, _json(r.timing))
                        for kid, owner, r in sorted(batch, key=lambda done: done[0])))
        rows = await self._batch("complete", sql.COMPLETE_MANY, *map(list, columns), time.time(),
                                 self._channel)
        kept = {(row["kid"], row["owner"]) for row in rows}
        return [(kid, owner) in kept for kid, owner, _ in batch]

    async def release(self, kid: str, owner: str) -> None:
        try:
            await self._execute("release", sql.RELEASE, kid, owner, self._channel)
        finally:
            self._wake(kid)

    async def _set_state(self, kid: str, owner: str | None, state: str, detail: str) -> None:
        try:
            await self._execute(state, sql.SET_STATE, kid, state, detail, owner, self._channel)
        finally:
            self._wake(kid)

    async def quarantine(self, kid: str, owner: str | None, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNKNOWN, detail)

    async def mark_unrecordable(self, kid: str, owner: str, detail: str) -> None:
        await self._set_state(kid, owner, EntryState.UNRECORDABLE, detail)

    async def resolve(self, kid: str, recorded: Recorded | None) -> bool:
        try:
            if recorded is None:
                rows = await self._fetch("resolve", sql.RESOLVE_AS_RETRY, kid, self._channel)
            else:
                rows = await self._fetch("resolve", sql.RESOLVE_WITH_ANSWER, kid, recorded.status,
                                         recorded.headers, recorded.body, time.time(), self._channel)
            return len(rows) == 1
        finally:
            self._wake(kid)

    async def append_partial(self, kid: str, owner: str, seq: int, data: bytes) -> None:
        await self._execute("append_partial", sql.APPEND_PARTIAL, kid, seq, data, self._channel)
        self._wake(kid)

    async def read_partial(self, kid: str, after_seq: int) -> list[tuple[int, bytes]]:
        rows = await self._fetch("read_partial", sql.READ_PARTIAL, kid, after_seq)
        return [(r[0], r[1]) for r in rows]

    async def wait(self, kid: str, timeout: float) -> None:
        await self._waiters.wait(kid, timeout)

    async def count_replays(self, counts: dict[str, int]) -> None:
        if counts:  # sorted, so two proxies updating the same rows lock them in one order
            await self._use("count_replays", lambda c: c.executemany(
                sql.COUNT_REPLAYS, [(n, kid) for kid, n in sorted(counts.items())]))

    async def purge(self, now: float, batch: int = 1000) -> int:
        total = 0
        while True:  # short transactions: never hold locks for a whole purge
            n = (await self._fetchrow("purge", sql.PURGE_JOURNAL, now, batch))[0]
            m = _rows(await self._execute("purge", sql.PURGE_OCCURRENCES, now, batch))
            total += n
            if n < batch and m < batch:
                return total

    async def entries(self, namespace: str, run: str) -> list[Entry]:
        rows = await self._fetch("journal", sql.JOURNAL, namespace, run)
        return [_entry(r, None if r["status"] is None else Recorded(r["status"], [], b"")) for r in rows]

    async def delete_run(self, namespace: str, run: str) -> int:
        return (await self._fetchrow("delete_journal", sql.DELETE_JOURNAL, namespace, run))[0]
