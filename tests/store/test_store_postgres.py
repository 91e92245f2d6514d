"""What only the PostgreSQL store has: migrations, NOTIFY, row locks, a server to lose."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import pytest

import services
from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import StoreUnavailable, make_store
from idemproxy.proxy.store.model import Claim, EntryState, Recorded, Run, Scope
from idemproxy.proxy.store.composed import Store
from idemproxy.proxy.store.postgres import postgres_store, sql
from idemproxy.proxy.store.postgres.connection import PostgresConnection
from idemproxy.proxy.store.postgres.schema import MIGRATIONS

REPLY = Recorded(200, [("content-type", "text/plain")], b"done")


@pytest.fixture
def schema():
    """A fresh schema on the shared server, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:10]}"
    yield name

    async def drop():
        conn = await asyncpg.connect(services.postgres_url())
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            await conn.close()
    asyncio.run(drop())


@pytest.fixture
async def open_pg(schema):
    """Factory: ``await open_pg(url=None, timeout=5.0, **options)`` -> an open PostgreSQL store (options:
    its partition_interval, retention); closed at teardown."""
    opened: list[Store] = []

    async def make(url: str | None = None, timeout: float = 5.0, **options) -> Store:
        store = postgres_store(url or f"{services.postgres_url()}?schema={schema}", timeout=timeout, **options)
        await store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.aclose()


async def raw(schema: str, url: str | None = None) -> asyncpg.Connection:
    return await asyncpg.connect(url or services.postgres_url(), server_settings={"search_path": schema})


async def transactions(schema: str, table: str, where: str = "", *args) -> int:
    """How many transactions last wrote the rows: rows written by one carry its id (xmin)."""
    conn = await raw(schema)
    try:
        return await conn.fetchval(f"SELECT count(DISTINCT xmin::text) FROM {table} {where}", *args)
    finally:
        await conn.close()


def claim_of(key: str, owner: str = "o", epoch: int | None = None) -> Claim:
    return Claim(Scope("tenant", "run-1", "tools", key), "fp", owner, 30.0, 3600.0, epoch=epoch,
                 namespace="ns")


async def test_many_replicas_migrate_at_once(schema, open_pg):
    stores = await asyncio.gather(*(open_pg() for _ in range(8)))
    conn = await raw(schema)
    try:
        versions = [r[0] for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")]
    finally:
        await conn.close()
    assert versions == [v for v, _ in MIGRATIONS]
    assert await stores[0].secret("s", b"1") == b"1" and await stores[7].secret("s", b"2") == b"1"
    again = await open_pg()  # a later start finds everything done
    await again.ping()


async def test_our_url_parameters_are_ours(schema, open_pg):
    store = make_store(StoreSettings(url=f"postgres://postgres@127.0.0.1:1/postgres?schema={schema}"
                                         "&pool_size=3&sslmode=disable"))
    assert isinstance(store.connection, PostgresConnection) and store.connection.schema == schema
    dsn = store.connection._dsn
    assert "schema" not in dsn and "pool_size" not in dsn and "sslmode=disable" in dsn
    with pytest.raises(ValueError):
        postgres_store("postgresql://h/db?schema=x;drop")
    assert "secret-pw" not in repr(postgres_store("postgresql://u:secret-pw@h/db"))


async def test_durability_is_read_from_the_server(open_pg):
    store = await open_pg()
    assert "fsync=on" in store.durability and "synchronous_commit=on" in store.durability


async def test_a_waiter_is_woken_by_notify_from_another_instance(open_pg):
    waiter_store, writer = await open_pg(), await open_pg()
    waiter_store.connection.waiters.poll_s = 30.0  # so only a notification can wake it in time
    owner = (await writer.journal.claim(claim_of("k"))).entry.owner
    kid = claim_of("k").scope.kid
    waiter = asyncio.create_task(waiter_store.journal.wait(kid, 20.0))
    await asyncio.sleep(0.1)
    changed = time.monotonic()
    assert await writer.journal.complete(kid, owner, REPLY)
    await asyncio.wait_for(waiter, 5.0)
    assert time.monotonic() - changed < 2.0
    assert (await waiter_store.journal.get(kid)).state == EntryState.COMPLETE


async def test_records_committed_together_wake_every_waiter(open_pg):
    """One notification names all the kids a batch of completes recorded."""
    waiter_store, writer = await open_pg(), await open_pg()
    waiter_store.connection.waiters.poll_s = 30.0
    claims = [claim_of(f"k{i}", owner=f"o{i}") for i in range(150)]  # more than one payload's worth
    await asyncio.gather(*(writer.journal.claim(c) for c in claims))
    waiters = [asyncio.create_task(waiter_store.journal.wait(c.scope.kid, 20.0)) for c in claims]
    await asyncio.sleep(0.1)
    changed = time.monotonic()
    assert all(await asyncio.gather(*(writer.journal.complete(c.scope.kid, c.owner, REPLY) for c in claims)))
    await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
    assert time.monotonic() - changed < 2.0


async def test_the_listener_comes_back_when_its_connection_is_killed(schema, open_pg):
    waiter_store, writer = await open_pg(), await open_pg()
    waiter_store.connection.waiters.poll_s = 30.0
    conn = await raw(schema)
    try:
        killed = await conn.fetchval("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                     "WHERE application_name = $1", f"idemproxy-listen:{schema}")
    finally:
        await conn.close()
    assert killed == 2  # one listener per store instance
    deadline = time.monotonic() + 15
    for i in range(100):  # the listener reconnects with backoff; try until it hears us
        key = f"k{i}"
        owner = (await writer.journal.claim(claim_of(key))).entry.owner
        waiter = asyncio.create_task(waiter_store.journal.wait(claim_of(key).scope.kid, 20.0))
        await asyncio.sleep(0.3)
        await writer.journal.complete(claim_of(key).scope.kid, owner, REPLY)
        done, _ = await asyncio.wait([waiter], timeout=1.0)
        if done:
            return
        waiter.cancel()
        assert time.monotonic() < deadline, "the listener did not come back"


async def test_concurrent_records_share_one_commit(schema, open_pg):
    store = await open_pg()
    kids = []
    for i in range(20):
        result = await store.journal.claim(claim_of(f"k{i}", owner=f"o{i}"))
        kids.append((result.entry.kid, f"o{i}"))
    kept = await asyncio.gather(*(store.journal.complete(kid, owner, REPLY) for kid, owner in kids))
    assert kept == [True] * 20
    assert await transactions(schema, "journal", "WHERE kid = ANY($1)", [kid for kid, _ in kids]) <= 2


async def test_concurrent_claims_share_one_transaction(schema, open_pg):
    store = await open_pg()
    results = await asyncio.gather(*(store.journal.claim(claim_of(f"k{i}", owner=f"o{i}")) for i in range(20)))
    assert all(r.won for r in results)
    assert await transactions(schema, "journal") <= 2  # the first claim alone, then the nineteen queued behind it


async def test_concurrent_heartbeats_share_one_transaction(schema, open_pg):
    """The runs API's heartbeats: twenty agents beating at once cost two commits, not twenty
    (each a WAL flush: the cost that kept 100,000 runs from beating every 5 s)."""
    store = await open_pg()
    now = time.time()
    for i in range(20):
        await store.runs.upsert(Run("ns", f"r{i}", last_seen=now, started_at=now, created_at=now))
    beats = await asyncio.gather(*(store.runs.heartbeat("ns", f"r{i}", now + 1) for i in range(20)))
    assert [b.last_seen for b in beats] == [now + 1] * 20
    assert await transactions(schema, "runs") <= 2  # the first beat alone, then the nineteen queued behind it


# What the request path and the background loops run, with how many parameters.
HOT_STATEMENTS = ("CLAIM_MANY", "GET_MANY", "COMPLETE_MANY", "RELEASE", "RENEW", "SET_STATE",
                  "QUARANTINE_EXPIRED", "READ_PARTIAL", "COUNT_REPLAYS", "RAISE_EPOCH", "RUN_EPOCH",
                  "TOUCH", "HEARTBEAT_MANY", "GET_RUNS", "PURGE_OCCURRENCES", "JOURNAL", "COUNT_STEPS",
                  "DELETE_JOURNAL", "SILENT_RUNS", "PURGE_RUNS", "ATTACH", "LOSE")


@pytest.mark.parametrize("take_over, commit", [(True, "off"), (False, "on")])
async def test_a_claim_waits_for_the_wal_flush_only_where_a_lapsed_one_is_quarantined(schema, open_pg,
                                                                                      take_over, commit):
    """Under on_ambiguous = retry (take_over), a claim a server crash lost and one whose proxy
    died both end in the call going upstream again, so its commit skips the WAL flush; under
    quarantine, the claim must outlive the crash to quarantine the key."""
    store = await open_pg()  # made the schema
    now = time.time()
    args = ([("k", "t", None, None, "tools", "k", "fp", "POST", "/p", "o", now + 60, now, now + 3600, "default")],
            now, take_over)
    async with store.connection._pool.acquire() as conn:  # a session as the store configures it
        transaction = conn.transaction()  # the setting as the claim's own commit would see it
        await transaction.start()
        try:
            assert (await conn.fetch(sql.CLAIM_MANY, *args))[0]["won"]
            assert await conn.fetchval("SHOW synchronous_commit") == commit
        finally:
            await transaction.rollback()


async def test_statements_use_their_index_even_planned_on_empty_tables(schema, open_pg):
    """A new deployment's tables are empty when its statements are first planned; a plan
    kept from then must still find rows by index once the tables are large."""
    store = await open_pg()
    async with store.connection._pool.acquire() as conn:  # a session as the store configures it
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        for name in HOT_STATEMENTS:
            query = getattr(sql, name)
            params = len((await conn.prepare(query)).get_parameters())
            await conn.execute(f"PREPARE hot AS {query}")
            try:
                plan = "\n".join(r[0] for r in await conn.fetch(
                    f"EXPLAIN (COSTS OFF) EXECUTE hot({', '.join(['NULL'] * params)})"))
            finally:
                await conn.execute("DEALLOCATE hot")
            for table in ("journal", "runs", "partials", "occurrences"):
                assert f"Seq Scan on {table}" not in plan, f"{name} scans {table}:\n{plan}"


async def test_our_sessions_plan_a_statement_once_not_per_call(schema, open_pg):
    """PostgreSQL's default plans a prepared statement anew for its arguments on its first
    calls and keeps doing so when its generic plan looks dearer, as the claim's does: a
    replay's claim then cost twice a read. Our sessions keep the generic plan."""
    store = await open_pg()
    await store.journal.claim(claim_of("k"))
    now = time.time()
    args = ([("k", "t", None, None, "openai", "k", "fp", "POST", "/p", "o2", now + 60, now, now + 3600, "default")],
            now, True)
    async with store.connection._pool.acquire() as conn:
        for _ in range(8):
            await conn.fetch(sql.CLAIM_MANY, *args)
        custom, generic = await conn.fetchrow(
            "SELECT custom_plans, generic_plans FROM pg_prepared_statements WHERE statement = $1", sql.CLAIM_MANY)
    assert (custom, generic) == (0, 8)


async def test_a_claim_its_caller_gave_up_on_leaves_the_key_free(schema, open_pg):
    """A claim stuck behind a lock past the store timeout: the caller hears 503, and the
    key must not be held later by that claim (the agent's retry goes upstream at once)."""
    store = await open_pg(timeout=0.5)
    await store.runs.observe_epoch("ns", "run-1", 0, Run("ns", "run-1"), time.time())
    blocker = await raw(schema)
    try:
        locking = blocker.transaction()
        await locking.start()
        await blocker.execute("SELECT 1 FROM runs WHERE tenant = 'ns' AND run_id = 'run-1' FOR UPDATE")
        with pytest.raises(StoreUnavailable):
            await store.journal.claim(claim_of("stuck", owner="gone", epoch=0))
        await asyncio.sleep(0.2)
        await locking.rollback()
    finally:
        await blocker.close()
    deadline = time.monotonic() + 5
    while (entry := await store.journal.get(claim_of("stuck").scope.kid)) is not None:
        assert time.monotonic() < deadline, f"the abandoned claim still holds the key: {entry}"
        await asyncio.sleep(0.1)
    assert (await store.journal.claim(claim_of("stuck", owner="retry", epoch=0))).won


async def test_a_claim_waits_for_a_restart_in_progress_and_sees_its_epoch(schema, open_pg):
    store = await open_pg()
    await store.runs.observe_epoch("ns", "run-1", 0, Run("ns", "run-1"), time.time())
    conn = await raw(schema)
    try:
        async with conn.transaction():  # a supervisor's restart, not yet committed
            await conn.execute("UPDATE runs SET epoch = 1 WHERE tenant = 'ns' AND run_id = 'run-1'")
            claim = asyncio.create_task(store.journal.claim(claim_of("k", epoch=0)))
            await asyncio.sleep(0.3)
            assert not claim.done(), "the claim must wait for the epoch it would be fenced by"
        result = await asyncio.wait_for(claim, 5.0)
    finally:
        await conn.close()
    assert (result.won, result.stale_epoch) == (False, 1)
    assert await store.journal.get(claim_of("k").scope.kid) is None


async def test_open_fails_fast_when_nothing_listens():
    store = postgres_store(f"postgresql://postgres@127.0.0.1:{services.free_port()}/postgres", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.open()
    assert time.monotonic() - started < 3.0
    with pytest.raises(StoreUnavailable):
        await store.ping()


@pytest.fixture
def private_postgres():
    server = services.PrivatePostgres().start()
    yield server
    server.destroy()


@pytest.mark.slow  # a private PostgreSQL stopped and started
async def test_a_stopped_server_fails_fast_and_the_store_recovers(private_postgres, open_pg):
    url = f"{private_postgres.url}?schema=outage"
    store, writer = await open_pg(url, timeout=1.0), await open_pg(url, timeout=1.0)
    store.connection.waiters.poll_s = 30.0
    owner = (await store.journal.claim(claim_of("before"))).entry.owner
    assert await store.journal.complete(claim_of("before").scope.kid, owner, REPLY)

    await asyncio.to_thread(private_postgres.stop)
    for op in (lambda: store.journal.claim(claim_of("during")), lambda: store.journal.get(claim_of("before").scope.kid),
               lambda: store.journal.complete(claim_of("x").scope.kid, "o", REPLY), store.ping):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await op()
        assert time.monotonic() - started < 2.5
    started = time.monotonic()
    await store.journal.wait(claim_of("during").scope.kid, 0.5)  # waiting never hangs either
    assert time.monotonic() - started < 1.5

    await asyncio.to_thread(private_postgres.start)
    deadline = time.monotonic() + 15
    while True:  # the pool reconnects by itself
        try:
            await store.ping()
            break
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the store did not recover"
            await asyncio.sleep(0.2)
    assert (await store.journal.get(claim_of("before").scope.kid)).response.body == b"done"  # nothing lost
    for i in range(100):  # and the listener is back: a write elsewhere wakes a waiter here
        key = f"after-{i}"
        result = await writer.journal.claim(claim_of(key))
        waiter = asyncio.create_task(store.journal.wait(claim_of(key).scope.kid, 20.0))
        await asyncio.sleep(0.3)
        await writer.journal.complete(claim_of(key).scope.kid, result.entry.owner, REPLY)
        done, _ = await asyncio.wait([waiter], timeout=1.0)
        if done:
            break
        waiter.cancel()
        assert time.monotonic() < deadline, "the listener did not come back"
