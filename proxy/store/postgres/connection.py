"""The PostgreSQL store's connection: the pool, the connections kept for batches, LISTEN.

- :meth:`PostgresConnection.use` runs work on a pooled connection, bounded by
  ``timeout``; :func:`translated` turns the driver's errors that mean "the server cannot
  serve us now" into :class:`StoreUnavailable`, in this one place. The pool reconnects on
  its own when the server is back.
- Waiters are woken by ``LISTEN``/``NOTIFY``: statements that settle an entry notify its
  kid at commit, and one listener connection per store wakes the local waiters. A slow
  poll covers a lost notification; the listener reconnects when its connection drops.
- Durability: a commit returns once its WAL is flushed (``synchronous_commit``), turned
  on for our sessions if the server's default is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import orjson

from ...config import mask_url
from ..errors import StoreMisconfigured, StoreUnavailable
from ..waking import RUN_LOST, Bell, Waiters
from . import sql
from .schema import check, migrate

log = logging.getLogger("idemproxy.store")

POLL_S = 0.5  # a waiter looks again this often, in case a notification was lost
LISTENER_CHECK_S = 5.0  # how often the idle listener connection proves it is alive
MIGRATE_TIMEOUT_S = 60.0
# A partition's drop frees its files at commit: seconds per ten gigabytes (docs/sizing.md),
# longer than a request may take, so it runs on a connection without the pool's timeouts.
MAINTENANCE_TIMEOUT_S = 600.0
# SQLSTATE classes that mean "the server cannot serve us now", not "the query is wrong":
# connection (08), transaction rollback (40: deadlock, serialization), resources (53),
# operator intervention, shutdown and our statement_timeout (57), system (58); a read-only
# standby (25006) and our lock_timeout (55P03).
UNAVAILABLE_CLASSES = {"08", "40", "53", "57", "58"}
# What the server answers, at a connection's start, to a URL it will never serve: invalid
# authorization (28: no such role, a wrong password), no such database (3D), a privilege it
# lacks (42501: CREATE SCHEMA, say). Not retried: start-up fails at once.
PERMANENT_AT_OPEN = {"28", "3D", "42"}


def json_text(value: Any) -> str:
    """JSON as text, as asyncpg hands jsonb to the server."""
    return orjson.dumps(value).decode()


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
def translated(what: str, timeout: float) -> Iterator[None]:
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


@contextlib.contextmanager
def refused_for_good() -> Iterator[None]:
    """The server's refusals of the URL itself (PERMANENT_AT_OPEN) become StoreMisconfigured."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        if (getattr(exc, "sqlstate", None) or "")[:2] in PERMANENT_AT_OPEN:
            raise StoreMisconfigured(f"postgres: {exc}") from exc
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
    await conn.set_type_codec("jsonb", encoder=json_text, decoder=orjson.loads, schema="pg_catalog")


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


class PostgresConnection:
    """The pool and the listener of one store; see the module docstring."""

    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self._dsn, self.schema, self._pool_size = _parse_url(url)
        self.channel = f"idemproxy:{self.schema}"[:63]  # NOTIFY channel names are identifiers
        self.durability = "unknown until the store is open"
        self.waiters = Waiters(POLL_S)
        self.lost = Bell()  # an attempt marked lost, by any process on this schema
        self._session: dict[str, str] = {}  # extra server settings for our sessions
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncio.Task | None = None
        self._listening: asyncpg.Connection | None = None  # the listener's connection, now
        self._kept: dict[str, asyncpg.Connection] = {}  # one per kind of batch; see use()

    def _connect_args(self, role: str) -> dict[str, Any]:
        # enable_seqscan=off: every statement of ours reads or writes rows by a key it has an
        # index for. A deployment starts with empty tables, and asyncpg prepares statements,
        # so PostgreSQL plans them once and keeps that plan (until asyncpg or ANALYZE
        # replaces it): for an empty table, a full scan, kept while the table grows
        # (measured: a fresh schema's records cost the server 4x the CPU). Off, a plan
        # uses the index wherever one fits (tests/store/test_store_postgres.py checks ours).
        # plan_cache_mode: a prepared statement keeps one generic plan (index plans, as above)
        # instead of being planned anew for its arguments on every call: PostgreSQL's "auto"
        # kept re-planning the claim, so a replay's one statement cost twice what it does with
        # its plan kept.
        settings = {"search_path": f'"{self.schema}"', "application_name": f"{role}:{self.schema}"[:63],
                    "enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}
        if role == "idemproxy":  # the pool; not the connection that migrates
            # The server gives up when our callers do: a statement that outlived its caller
            # (say, a claim waiting on a lock) must not commit later.
            settings["statement_timeout"] = settings["lock_timeout"] = str(int(self.timeout * 1000))
        return {"timeout": self.timeout, "command_timeout": self.timeout,
                "server_settings": {**settings, **self._session}}

    async def open(self, migrate_schema: bool = True) -> None:
        with refused_for_good(), translated("open", MIGRATE_TIMEOUT_S):
            async with asyncio.timeout(MIGRATE_TIMEOUT_S):
                # The first connection migrates (or, told not to, only looks), reads the
                # settings, then stays as the listener.
                conn = await asyncpg.connect(self._dsn, **self._connect_args("idemproxy-listen"))
                try:
                    if not migrate_schema:
                        await check(conn, self.schema)
                    else:
                        for version in await migrate(conn, self.schema, MIGRATE_TIMEOUT_S):
                            log.info("postgres schema %s: migration %d applied", self.schema, version)
                    sync, fsync = await conn.fetchrow(
                        "SELECT current_setting('synchronous_commit'), current_setting('fsync')")
                    if sync == "off":
                        self._session = {"synchronous_commit": "on"}
                    self.durability = _describe(sync, fsync)
                    if fsync != "on":  # records are promised fsynced: say loudly they are not
                        log.error("postgres durability: %s", self.durability)
                    self._pool = await asyncpg.create_pool(
                        self._dsn, min_size=1, max_size=self._pool_size, init=_init_connection,
                        reset=_keep_session, **self._connect_args("idemproxy"))
                    await conn.add_listener(self.channel, self._on_notify)
                except BaseException:
                    conn.terminate()
                    if self._pool is not None:
                        self._pool.terminate()
                        self._pool = None
                    raise
        self._listening = conn
        self._listener = asyncio.create_task(self._listen(conn), name="idemproxy-pg-listener")

    def __repr__(self) -> str:
        return f"PostgresConnection({mask_url(self.url)!r})"

    async def ping(self) -> None:
        await self.use("ping", lambda c: c.fetchval("SELECT 1"))

    async def secret(self, name: str, generate: bytes) -> bytes:
        return (await self.fetchrow("secret", sql.SECRET, name, generate))[0]

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._listening is not None:
            # a listener cancelled before it first ran never closed its connection (a
            # command that closes the store at once); the loop would wait for it at exit
            self._listening.terminate()
            self._listening = None
        if self._pool is not None:
            pool, self._pool = self._pool, None
            for conn in self._kept.values():
                await pool.release(conn)
            self._kept.clear()
            try:
                await asyncio.wait_for(pool.close(), self.timeout)
            except Exception:  # noqa: BLE001 - a server that is gone cannot be closed politely
                pool.terminate()
        self.waiters.wake_all()

    # -- statements -----------------------------------------------------------------------

    async def use(self, what: str, work: Callable[[asyncpg.Connection], Awaitable[Any]],
                  keep: bool = False) -> Any:
        """Run ``work`` on a pooled connection, bounded by the timeout, errors translated.

        With ``keep``, the connection stays out of the pool for the next call of the same
        ``what``: taking a connection from the pool and giving it back costs as much CPU as
        the statement. One is kept per ``what``, and never more than half the pool
        in all; calls made meanwhile take theirs from the pool and give it back.
        """
        pool = self._pool
        if pool is None:
            raise StoreUnavailable("store is closed")
        with translated(what, self.timeout):
            async with asyncio.timeout(self.timeout):
                conn = self._kept.pop(what, None) if keep else None
                if conn is not None and conn.is_closed():  # the server went away since: a new one
                    await pool.release(conn)
                    conn = None
                if conn is None:
                    conn = await pool.acquire()
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
                        # a link asyncpg already gave back raises here: the error to report is exc
                        with contextlib.suppress(asyncpg.InterfaceError):
                            conn.terminate()
                    raise
                finally:
                    if (keep and usable and what not in self._kept and self._pool is pool
                            and len(self._kept) < pool.get_max_size() // 2):
                        self._kept[what] = conn
                    else:
                        await pool.release(conn)

    async def alone(self, what: str, work: Callable[[asyncpg.Connection], Awaitable[Any]],
                    timeout: float = MAINTENANCE_TIMEOUT_S) -> Any:
        """``work`` on a connection of its own, bounded by ``timeout`` instead of the store's:
        maintenance that may outlast any request (a large partition's drop)."""
        with translated(what, timeout):
            args = self._connect_args("idemproxy-maintain")  # (no statement_timeout: not the pool)
            conn = await asyncpg.connect(self._dsn, **{**args, "command_timeout": timeout})
            try:
                return await work(conn)
            finally:
                await conn.close()

    async def batch(self, what: str, query: str, *args: Any) -> list[asyncpg.Record]:
        """A batch's statement, on the connection kept for batches of its kind."""
        return await self.use(what, lambda c: c.fetch(query, *args), keep=True)

    async def tx(self, what: str, work: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        async def in_transaction(conn: asyncpg.Connection) -> Any:
            async with conn.transaction():
                return await work(conn)
        return await self.use(what, in_transaction)

    async def fetch(self, what: str, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self.use(what, lambda c: c.fetch(query, *args))

    async def fetchrow(self, what: str, query: str, *args: Any, keep: bool = False) -> asyncpg.Record | None:
        return await self.use(what, lambda c: c.fetchrow(query, *args), keep)

    async def execute(self, what: str, query: str, *args: Any) -> str:
        return await self.use(what, lambda c: c.execute(query, *args))

    # -- notifications --------------------------------------------------------------------

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
                self.waiters.wake_all()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            conn = None
            try:
                conn = self._listening = await asyncpg.connect(self._dsn, **self._connect_args("idemproxy-listen"))
                await conn.add_listener(self.channel, self._on_notify)
                log.info("postgres listener reconnected")
                delay = 0.1
                self.waiters.wake_all()
            except Exception as exc:  # noqa: BLE001
                log.warning("postgres listener cannot reconnect (next try in %.1fs): %s", delay, exc)
                if conn is not None:
                    conn.terminate()
                    conn = None

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, kids: str) -> None:
        if kids == RUN_LOST:
            self.lost.ring()
            return
        for kid in kids.split(" "):  # a batch of records tells its kids in one notification
            self.waiters.wake(kid)
