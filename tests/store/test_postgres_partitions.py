"""PostgreSQL's journal partitioned by expiry: ranges dropped whole, never rows deleted; the
migration from the unpartitioned journal; ``partition_interval = "1s"`` through a proxy."""

from __future__ import annotations

import asyncio
import math
import time

import asyncpg
import pytest

import services
from idemproxy.proxy.config import ConfigError, load_settings
from idemproxy.proxy.store.model import Claim, EntryState, Recorded, Run, Scope
from idemproxy.proxy.store.postgres.partitions import RANGES, parse_bound
from idemproxy.proxy.store.postgres import sql
from idemproxy.proxy.store.postgres.schema import MIGRATIONS
from test_store_postgres import open_pg, raw, schema  # noqa: F401 - fixtures

PARTITIONED = 10  # the migration that partitions the journal
# Every row deleted from the journal, by any statement: retention must delete none.
WATCH_DELETES = """
CREATE TABLE deleted (kid TEXT);
CREATE FUNCTION note_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO deleted VALUES (OLD.kid); RETURN OLD; END $$;
CREATE TRIGGER watch AFTER DELETE ON journal FOR EACH ROW EXECUTE FUNCTION note_delete();"""


@pytest.fixture
def open_partitioned(open_pg):  # noqa: F811
    """Factory: an open PostgreSQL store on the test's schema, in one-second partitions."""
    return lambda retention=3600.0: open_pg(partition_interval=1.0, retention=retention)


def claim_of(key: str, retention_s: float = 3600.0, owner: str = "o") -> Claim:
    return Claim(Scope("tenant", "run-1", "tools", key), "fp", owner, 30.0, retention_s, namespace="ns")


async def ranges(conn: asyncpg.Connection) -> list[tuple[str, tuple[float, float]]]:
    return sorted(((name, parse_bound(bound)) for name, bound, *_ in await conn.fetch(RANGES)),
                  key=lambda named: named[1])


async def until_past(expiry: float) -> None:
    """Sleep until the one-second range holding ``expiry`` lies wholly before now."""
    await asyncio.sleep(max(0.0, math.floor(expiry) + 1 - time.time()) + 0.05)


async def test_a_purge_drops_whole_expired_partitions_and_deletes_no_row(schema, open_partitioned):  # noqa: F811
    store = await open_partitioned()
    conn = await raw(schema)
    try:
        await conn.execute(WATCH_DELETES)
        expired = [claim_of(f"old-{i}", retention_s=0.2) for i in range(20)]
        for claim in expired:
            assert (await store.journal.claim(claim)).won
        await store.journal.append_partial(expired[0].scope.kid, "o", 0, b"half a stream")
        live = [claim_of(f"live-{i}") for i in range(3)]
        for claim in live:
            assert (await store.journal.claim(claim)).won
        await store.journal.complete(live[0].scope.kid, "o", Recorded(200, [], b"kept"))
        later = time.time() + 2.0  # a purge two seconds on: every range of the expired ones is behind it
        held = {name for name, _ in await ranges(conn)}
        assert await store.journal.purge(later) == len(expired)
        assert await conn.fetchval("SELECT count(*) FROM deleted") == 0, "a purge deleted rows"
        left = {name for name, _ in await ranges(conn)}
        assert held - left, "no partition was dropped"
        assert await conn.fetchval("SELECT count(*) FROM journal") == len(live)
        assert await store.journal.read_partial(expired[0].scope.kid, -1) == []
        assert (await store.journal.get(live[0].scope.kid)).response.body == b"kept"
        assert await store.journal.purge(later) == 0
        # an expired key runs as new, in a range of its own
        assert (await store.journal.claim(claim_of("old-0", owner="again"))).won
    finally:
        await conn.close()


async def test_a_claim_whose_expiry_has_no_range_yet_gets_one(schema, open_partitioned):  # noqa: F811
    """Ranges are made ahead for the configured retention; a claim that keeps its entry
    longer (or a range another replica dropped) makes its own before it inserts."""
    store = await open_partitioned(retention=60.0)
    far = claim_of("far", retention_s=30 * 86400.0)
    assert (await store.journal.claim(far)).won
    conn = await raw(schema)
    try:
        expiry = await conn.fetchval("SELECT expires_at FROM journal WHERE key = 'far'")
        assert any(lo <= expiry < hi for _, (lo, hi) in await ranges(conn))
        name = await conn.fetchval("SELECT tableoid::regclass::text FROM journal WHERE key = 'far'")
        await conn.execute(f'DROP TABLE "{name}"')  # as if another replica's purge had dropped it
        assert (await store.journal.claim(claim_of("far-2", retention_s=30 * 86400.0))).won
    finally:
        await conn.close()


async def _previous_schema(schema: str) -> asyncpg.Connection:  # noqa: F811
    """A schema as the release before the partitioned journal left it."""
    conn = await raw(schema)
    await conn.execute(f'CREATE SCHEMA "{schema}"')
    await conn.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
                       "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
    for version, statements in MIGRATIONS:
        if version < PARTITIONED:
            await conn.execute(statements)
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", version)
    return conn


async def test_the_migration_keeps_every_entry_and_drops_the_old_table_whole(schema, open_partitioned):  # noqa: F811
    conn = await _previous_schema(schema)
    try:
        now = time.time()
        # a thousand recorded answers and a call in flight with its stream so far, as the old
        # journal held them; all expire in half a minute
        await conn.execute("""
            INSERT INTO journal (kid, tenant, run, upstream, key, fingerprint, namespace, state, status, body,
                                 headers, created_at, completed_at, expires_at)
            SELECT 'old-' || g, 'tenant', 'run-1', 'tools', 'k' || g, 'fp', 'ns', 'complete', 200,
                   convert_to('answer ' || g, 'UTF8'), '[]', $1::float8, $1, $1 + 30
            FROM generate_series(1, 1000) AS g""", now)
        await conn.execute("INSERT INTO journal (kid, tenant, upstream, key, fingerprint, namespace, state, owner, "
                           "lease_until, created_at, expires_at) VALUES ('streaming', 'tenant', 'tools', 's', 'fp', "
                           "'ns', 'in_flight', 'o', $1::float8 + 60, $1, $1 + 30)", now)
        await conn.execute("INSERT INTO partials VALUES ('streaming', 0, 'half')")
        store = await open_partitioned()  # migrates
        assert await conn.fetchval("SELECT max(version) FROM schema_migrations") >= PARTITIONED
        (name, (lo, hi)), *_ = await ranges(conn)
        assert name == "journal_unpartitioned" and lo == -math.inf and hi > now + 30
        entry = await store.journal.get("old-7")
        assert (entry.state, entry.response.body) == (EntryState.COMPLETE, b"answer 7")
        assert (await store.journal.get("streaming")).state == EntryState.IN_FLIGHT
        assert await store.journal.read_partial("streaming", -1) == [(0, b"half")]
        new = claim_of("new")
        assert (await store.journal.claim(new)).won  # an hour ahead: past the old table's range
        await conn.execute(WATCH_DELETES)
        assert await store.journal.purge(hi) == 1001  # a purge once they all expired
        assert await conn.fetchval("SELECT count(*) FROM deleted") == 0
        assert "journal_unpartitioned" not in {name for name, _ in await ranges(conn)}
        assert await conn.fetchval("SELECT count(*) FROM partials") == 0
        assert (await store.journal.get(new.scope.kid)).state == EntryState.IN_FLIGHT
    finally:
        await conn.close()


async def test_partition_interval_of_one_second_end_to_end(schema, make_proxy, provider, http):  # noqa: F811
    proxy = await make_proxy(f"{services.postgres_url()}?schema={schema}",
                             store={"partition_interval": "1s", "retention": "1s"})
    url = f"{proxy.url}/runs/short/tools/send"
    sent = time.time()
    for replayed in ("false", "true"):
        async with http.post(url, json={"to": "bob"}, headers={"Idempotency-Key": "k1"}) as resp:
            assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == replayed
    await until_past(sent + 1.0 + 0.5)
    async with http.post(f"{proxy.url}/admin/purge", headers={"Authorization": "Bearer test-admin-token"}) as resp:
        assert resp.status == 200 and (await resp.json())["purged"] == 1
    async with http.post(url, json={"to": "bob"}, headers={"Idempotency-Key": "k1"}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"  # expired: runs again
    assert provider.calls["tool:send"] == 2


@pytest.mark.parametrize("interval, error", [("1s", None), ("1d", None), ("1.5s", "whole seconds"),
                                             ("500ms", "whole seconds")])
def test_partition_interval_is_whole_seconds(interval, error):
    if error is None:
        assert load_settings(env={}, overrides={"store.partition_interval": interval}).store.partition_interval >= 1
    else:
        with pytest.raises(ConfigError, match=error):
            load_settings(env={}, overrides={"store.partition_interval": interval})


async def test_claims_racing_to_take_a_key_over_have_one_winner(schema, open_partitioned):  # noqa: F811
    """A takeover replaces the old row instead of updating it (no unique index on the key to
    conflict on): replicas racing for a retried key, or for a dead proxy's lapsed claim, still
    leave one winner and one unexpired row."""
    stores = [await open_partitioned() for _ in range(3)]
    retried, lapsed = claim_of("retried"), Claim(Scope("tenant", "run-1", "tools", "lapsed"), "fp", "dead", 0.01,
                                                 3600.0, namespace="ns")
    for claim in (retried, lapsed):
        assert (await stores[0].journal.claim(claim)).won
    await stores[0].journal.quarantine(retried.scope.kid, "o", "upstream answered 502")
    assert await stores[0].journal.resolve(retried.scope.kid, None)
    await asyncio.sleep(0.05)  # the lapsed claim's lease ends
    for key in ("retried", "lapsed"):
        racers = [claim_of(key, owner=f"racer-{i}") for i in range(12)]
        results = await asyncio.gather(*(stores[i % 3].journal.claim(c) for i, c in enumerate(racers)))
        assert sum(r.won for r in results) == 1, key
        conn = await raw(schema)
        try:
            rows = await conn.fetch("SELECT owner, state FROM journal WHERE key = $1 AND expires_at > $2",
                                    key, time.time())
        finally:
            await conn.close()
        winner = next(c.owner for c, r in zip(racers, results) if r.won)
        assert [tuple(r) for r in rows] == [(winner, EntryState.IN_FLIGHT)]


async def test_claims_of_a_new_key_held_up_together_have_one_winner(schema, open_partitioned):  # noqa: F811
    """Three replicas' claims of one new key, all held up (a restart holding the run's row)
    after they started: each must see the others' insert when it goes on, which only the
    key's lock gives (their statements began before any of them wrote)."""
    stores = [await open_partitioned() for _ in range(3)]
    await stores[0].runs.observe_epoch("ns", "run-1", 0, Run("ns", "run-1"), time.time())
    conn = await raw(schema)
    try:
        async with conn.transaction():  # a supervisor's restart, not yet committed
            await conn.execute("SELECT 1 FROM runs WHERE tenant = 'ns' AND run_id = 'run-1' FOR UPDATE")
            racers = [Claim(Scope("tenant", "run-1", "tools", "new"), "fp", f"racer-{i}", 30.0, 3600.0, epoch=0,
                            namespace="ns") for i in range(3)]
            claims = [asyncio.create_task(store.journal.claim(c)) for store, c in zip(stores, racers)]
            await asyncio.sleep(0.3)
        results = await asyncio.wait_for(asyncio.gather(*claims), 5.0)
        assert sum(r.won for r in results) == 1
        assert await conn.fetchval("SELECT count(*) FROM journal WHERE key = 'new'") == 1
    finally:
        await conn.close()


async def test_a_drop_outlasts_the_store_timeout_when_it_must_wait(schema, open_pg):  # noqa: F811
    """DETACH … CONCURRENTLY waits for the transactions using the journal, and a large range's
    files take seconds to free: the drop is not bound by the request path's timeout."""
    store = await open_pg(timeout=0.5, partition_interval=1.0)
    assert (await store.journal.claim(claim_of("short", retention_s=0.2))).won
    conn = await raw(schema)
    try:
        reading = conn.transaction()
        await reading.start()
        await conn.fetchval("SELECT count(*) FROM journal")  # a reader still in its transaction
        purge = asyncio.create_task(store.journal.purge(time.time() + 2.0))
        await asyncio.sleep(1.0)  # twice the store's timeout
        assert not purge.done()
        await reading.rollback()
        assert await asyncio.wait_for(purge, 5.0) == 1
    finally:
        await conn.close()


async def test_a_key_expired_in_the_first_range_is_claimed_again(schema, open_partitioned):  # noqa: F811
    """The first range keeps the old journal's primary key on kid, and a retention shorter than
    the old one puts new entries in it: a key's expired row there must not refuse the key's next
    claim (it did, with a unique violation: a 500), nor may a live one be replaced."""
    conn = await _previous_schema(schema)
    try:
        now = time.time()
        again, live = claim_of("again", retention_s=60.0), claim_of("live", retention_s=60.0)
        for kid, key, expires_at in ((again.scope.kid, "again", now - 10), (live.scope.kid, "live", now + 30),
                                     ("other", "other", now + 3600)):  # (the old retention: an hour)
            await conn.execute("INSERT INTO journal (kid, tenant, upstream, key, fingerprint, namespace, state, "
                               "status, created_at, expires_at) VALUES ($1, 'tenant', 'tools', $2, 'fp', 'ns', "
                               "'complete', 200, $3::float8 - 100, $4)", kid, key, now, expires_at)
        store = await open_partitioned(retention=60.0)  # migrates
        assert (await store.journal.claim(again)).won
        lost = await store.journal.claim(live)
        assert not lost.won and lost.entry.state == EntryState.COMPLETE
        rows = await conn.fetch("SELECT tableoid::regclass::text, state FROM journal WHERE kid = $1", again.scope.kid)
        assert [tuple(r) for r in rows] == [("journal_unpartitioned", EntryState.IN_FLIGHT)]
    finally:
        await conn.close()


async def test_the_owner_of_a_claim_looks_for_it_in_its_own_range_only(schema, open_partitioned):  # noqa: F811
    """Only a claim's owner records, renews or releases it, and its expiry (the partition key)
    never changes: those statements look in the one range that holds it, not in every live
    range's kid index. Seen through a decoy: a row of the same kid and owner in another range
    (which no claim would make) that they must leave alone."""
    store = await open_partitioned()
    conn = await raw(schema)
    try:
        claims = {name: claim_of(name, owner=f"owner-{name}") for name in ("recorded", "renewed", "released")}
        for claim in claims.values():
            assert (await store.journal.claim(claim)).won
            expiry = await conn.fetchval("SELECT expires_at FROM journal WHERE kid = $1", claim.scope.kid)
            await store.journal.partitions.cover([expiry + 86400])
            await conn.execute(  # the decoy: a day later, so in a range of its own
                "INSERT INTO journal (kid, tenant, run, upstream, key, fingerprint, namespace, state, owner, "
                "lease_until, created_at, expires_at) SELECT kid, tenant, run, upstream, key, fingerprint, "
                "namespace, state, owner, lease_until, created_at, expires_at + 86400 FROM journal WHERE kid = $1",
                claim.scope.kid)
        decoys = "SELECT state, lease_until FROM journal WHERE key = $1 AND expires_at > $2 ORDER BY expires_at DESC"
        later = time.time() + 86400
        assert await store.journal.complete(claims["recorded"].scope.kid, "owner-recorded", Recorded(200, [], b"ok"))
        assert await store.journal.renew(claims["renewed"].scope.kid, "owner-renewed", 600.0)
        await store.journal.release(claims["released"].scope.kid, "owner-released")
        recorded, renewed = [await conn.fetch(decoys, key, 0.0) for key in ("recorded", "renewed")]
        assert [r["state"] for r in recorded] == [EntryState.IN_FLIGHT, EntryState.COMPLETE]
        assert renewed[0]["lease_until"] < renewed[1]["lease_until"]  # the decoy's lease was not renewed
        assert [r["state"] for r in await conn.fetch(decoys, "released", 0.0)] == [EntryState.IN_FLIGHT]
        assert await conn.fetchval("SELECT count(*) FROM journal WHERE expires_at > $1", later) == 3
    finally:
        await conn.close()


async def test_a_record_with_its_expiry_reads_one_range_of_many(schema, open_partitioned):  # noqa: F811
    """The bound is what lets PostgreSQL prune at run time: with the plan the store's sessions
    keep (generic, index scans), a record bounded to its entry's expiry executes one range's
    scan and none of the others'."""
    store = await open_partitioned()
    claims = [claim_of(f"k{i}", retention_s=10.0 + 3 * i, owner=f"o{i}") for i in range(6)]
    for claim in claims:
        assert (await store.journal.claim(claim)).won
    conn = await asyncpg.connect(services.postgres_url(), server_settings={
        "search_path": schema, "plan_cache_mode": "force_generic_plan", "enable_seqscan": "off"})
    try:
        expiry = await conn.fetchval("SELECT expires_at FROM journal WHERE key = 'k0'")
        record = (claims[0].scope.kid, "o0", 200, "[]", b"ok", False, "[]")
        transaction = conn.transaction()
        await transaction.start()
        plan = [row[0] for row in await conn.fetch("EXPLAIN (ANALYZE, COSTS OFF) " + sql.COMPLETE_MANY, [record],
                                                   time.time(), "channel", [expiry], [expiry])]
        await transaction.rollback()
        scans = [line for line in plan if "Scan using journal_" in line]
        assert len(scans) >= 6, plan  # a range per claim at least, all in the plan
        assert [line for line in scans if "never executed" not in line] == [
            next(line for line in scans if "rows=1" in line)], plan
    finally:
        await conn.close()
