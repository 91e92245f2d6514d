"""What only the Redis store has: durability read from the server, key prefixes, TTLs,
pub/sub wake-ups, and outages of a private Redis that the tests stop and start again.

The behaviour every backend shares is in ``test_store_contract.py``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

import pytest
import redis.asyncio as redis_asyncio

from conftest import until
from idemproxy.proxy.config import ConfigError, Settings, StoreSettings
from idemproxy.proxy.config.validation import validate
from idemproxy.proxy.store.errors import StoreUnavailable
from idemproxy.proxy.store.model import Claim, Recorded, Run, Scope
from idemproxy.proxy.store.composed import Store
from idemproxy.proxy.store.redis import redis_store
from idemproxy.proxy.store.redis.connection import POLL_S, split_url
from idemproxy.proxy.store.redis.durability import ReplicasBehind
from idemproxy.proxy.store.redis.shards import Layout, cluster_tags, slot_of
from services import PrivateRedis, free_port, redis_url

REPLY = Recorded(200, [("content-type", "application/json")], b'{"ok": true}')


@pytest.fixture
def private_redis():
    """Factory: a Redis of the test's own, destroyed at teardown."""
    servers: list[PrivateRedis] = []

    def make(**options) -> PrivateRedis:
        server = PrivateRedis(**options)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.destroy()


@pytest.fixture
async def open_store():
    """Factory: ``await open_store(url, timeout)``; closed at teardown."""
    stores: list[Store] = []

    async def make(url: str, timeout: float = 5.0) -> Store:
        store = redis_store(url, timeout=timeout)
        await store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


@pytest.fixture
def shared_url():
    """A fresh prefix on the shared test Redis, and a raw client to look at its keys."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    yield f"{redis_url()}?prefix={prefix}", prefix


def claim(key: str = "k1", owner: str = "a", retention_s: float = 3600.0, run: str | None = "run-1",
          lease_s: float = 30.0) -> Claim:
    return Claim(Scope("tenant", run, "tools", key), "fp", owner, lease_s, retention_s, "POST", "/x")


# -- configuration ---------------------------------------------------------------------------

def test_prefix_and_shards_are_ours_and_other_parameters_go_to_redis():
    assert split_url("redis://h:6379/2?prefix=app1:&ssl_cert_reqs=none") == (
        "redis://h:6379/2?ssl_cert_reqs=none", "app1:", None)
    assert split_url("rediss://h/0") == ("rediss://h/0", "idem:", None)
    assert split_url("redis+cluster://h:1?shards=64&prefix=x:") == ("redis+cluster://h:1", "x:", 64)
    assert "s3cret" not in repr(redis_store("redis://:s3cret@h:6379/0?prefix=p:"))
    for wrong in ("0", "1025", "x", ""):
        with pytest.raises(ValueError, match="shards must be a number from 1 to 1024"):
            split_url(f"redis+cluster://h:1?shards={wrong}")
    redis_store("redis://h:6379/0?shards=1")  # one Redis: one shard, said or not
    with pytest.raises(ValueError, match="shards is for Redis Cluster"):
        redis_store("redis://h:6379/0?shards=2")


@pytest.mark.parametrize("count", [2, 3, 16, 1024])
def test_shards_take_one_slice_of_the_slots_each(count):
    """Shard i's slot lies in the i-th slice after shard 0's, so a cluster that hands its masters
    even ranges of slots gets an even share of the shards on each."""
    tags = cluster_tags("idem:", count)
    assert tags[0] == "{idem:}" and len(set(tags)) == count
    width, first = 16384 // count, slot_of(tags[0])
    for i, tag in enumerate(tags):
        assert (slot_of(tag) - first) % 16384 // width == i, tag
    assert cluster_tags("idem:", count) == tags  # the same every time: replicas agree


def test_a_layout_places_runs_and_entries_evenly_and_finds_its_own_keys():
    layout = Layout(cluster_tags("idem:", 16))
    placed = [layout.of(f"{i:040x}") for i in range(16000)]
    assert min(placed.count(shard) for shard in layout.shards) > 800  # 1,000 each on average
    assert layout.of("5:tools:run-1") is layout.of("5:tools:run-1")
    shard = layout.shards[5]
    assert layout.owning(shard.key("entry", "ab").encode()) == (shard, "entry:ab")
    assert layout.owning(b"{idem:x}entry:ab") is None  # another deployment's
    one = Layout(["idem:"])
    assert one.of("anything") is one.first and not one.sharded


@pytest.mark.parametrize("appendonly, appendfsync, says, warned", [
    (False, "everysec", "records live in memory only; a Redis restart loses them", True),
    (True, "everysec", "up to ~1 s of acknowledged records can be lost on a crash of the Redis host", True),
    (True, "always", "every write is fsynced before Redis answers", False),
])
@pytest.mark.slow  # private Redis instances
async def test_durability_is_read_from_the_server(private_redis, open_store, caplog, appendonly,
                                                  appendfsync, says, warned):
    server = private_redis(appendonly=appendonly, appendfsync=appendfsync).start()
    with caplog.at_level(logging.WARNING, logger="idemproxy.store"):
        store = await open_store(server.url)
    assert says in store.durability
    assert any("durability" in r.getMessage() for r in caplog.records) == warned


@pytest.mark.slow  # a private Redis instance
async def test_durability_is_unknown_when_config_is_disabled(private_redis, open_store):
    server = private_redis()
    server.args += ["--rename-command", "CONFIG", ""]
    store = await open_store(server.start().url)
    assert store.durability.startswith("unknown")
    await store.ping()


async def test_open_fails_fast_when_nothing_listens():
    store = redis_store(f"redis://127.0.0.1:{free_port()}/0", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.open()
    assert time.monotonic() - started < 2.5
    await store.aclose()


# -- keys ------------------------------------------------------------------------------------

@pytest.mark.slow  # a private Redis instance
async def test_every_key_and_channel_starts_with_the_prefix(private_redis, open_store):
    server = private_redis().start()
    store = await open_store(server.url + "?prefix=app1:")
    won = await store.journal.claim(claim(run="run-1"))
    await store.journal.append_partial(won.entry.kid, "a", 0, b"{}")
    await store.journal.complete(won.entry.kid, "a", REPLY)
    await store.journal.next_occurrence("default", "run-1", 0, "fp", 60, tenant="t")
    await store.secret("tenant-hmac", b"x")
    await store.runs.upsert(Run("default", "run-1", created_at=time.time()))
    await store.runs.end("default", "run-1", "completed", time.time())
    raw = redis_asyncio.Redis.from_url(server.url)
    try:
        keys = await raw.keys("*")
        channels = await raw.pubsub_channels()
    finally:
        await raw.aclose()
    assert len(keys) > 5
    assert all(k.startswith(b"app1:") for k in keys), keys
    assert channels == [b"app1:changed"]


async def test_entries_expire_by_ttl_and_runs_do_not(shared_url, open_store):
    url, prefix = shared_url
    store = await open_store(url)
    won = await store.journal.claim(claim(retention_s=100.0))
    kid = won.entry.kid
    await store.journal.append_partial(kid, "a", 0, b"{}")
    await store.journal.next_occurrence("default", "run-1", 0, "fp", 100.0, tenant="t")
    await store.runs.upsert(Run("default", "run-1", created_at=time.time()))
    raw = redis_asyncio.Redis.from_url(url.split("?")[0])
    try:
        for key in (f"entry:{kid}", f"partial:{kid}", "occ:7:default:run-1"):
            assert 95_000 < await raw.pttl(prefix + key) <= 100_000, key
        assert await raw.pttl(prefix + "run:7:default:run-1") == -1  # runs are kept, until purge()
        await store.journal.complete(kid, "a", REPLY)
        assert 95_000 < await raw.pttl(prefix + f"entry:{kid}") <= 100_000  # the record keeps it
    finally:
        await raw.aclose()


async def test_more_callers_than_links_wait_for_one_instead_of_failing(shared_url, open_store):
    """Past the pool's links, a call waits for one to come back (within the timeout): 300
    runs registered at once, through 8 links, all succeed. The plain pool failed every call
    past its 100th with MaxConnectionsError, a 503 to the agent."""
    url, _ = shared_url
    store = await open_store(f"{url}&max_connections=8")
    now = time.time()
    runs = await asyncio.gather(*(store.runs.upsert(Run("default", f"r{i}", created_at=now)) for i in range(300)))
    assert [run.run_id for run in runs] == [f"r{i}" for i in range(300)]


async def test_the_pipelines_kept_link_goes_back_when_the_pool_has_none_to_spare(shared_url, open_store):
    """The link pipelines keep between batches is one the pool cannot lend: with two links
    (one is the notifications' subscription), a call after a pipeline would wait out its
    timeout for it."""
    url, _ = shared_url
    store = await open_store(f"{url}&max_connections=2", timeout=1.0)
    now = time.time()
    await store.runs.upsert(Run("default", "r", created_at=now))
    await store.runs.heartbeat("default", "r", now + 1)  # a pipeline
    assert [run.run_id for run in await store.runs.find("default", "r")] == ["r"]


# -- notifications ---------------------------------------------------------------------------

async def test_a_change_on_one_instance_wakes_a_waiter_on_another(shared_url, open_store):
    url, prefix = shared_url
    waiter_store, writer = await open_store(url), await open_store(url)
    elsewhere = await open_store(url.replace(prefix, "other" + prefix))  # another prefix: not told
    won = await writer.journal.claim(claim())
    kid = won.entry.kid
    waits = [asyncio.create_task(s.journal.wait(kid, 5.0)) for s in (waiter_store, elsewhere)]
    await asyncio.sleep(0.05)
    changed = time.monotonic()
    await writer.journal.complete(kid, "a", REPLY)
    await asyncio.wait_for(waits[0], 2.0)
    assert time.monotonic() - changed < POLL_S / 2  # woken by the message, not the poll
    assert not waits[1].done()
    await waits[1]


# -- outages ---------------------------------------------------------------------------------

async def _fails_within(operation, limit: float) -> float:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await operation
    elapsed = time.monotonic() - started
    assert elapsed < limit, f"took {elapsed:.2f}s"
    return elapsed


async def _eventually(check, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if await check():
                return
        except StoreUnavailable:
            pass
        assert time.monotonic() < deadline, "the store did not recover"
        await asyncio.sleep(0.1)


@pytest.mark.slow  # a private Redis stopped and started
async def test_stopped_redis_fails_fast_and_the_store_recovers_by_itself(private_redis, open_store):
    server = private_redis().start()
    store = await open_store(server.url, timeout=1.0)
    other = await open_store(server.url, timeout=1.0)
    assert (await store.journal.claim(claim("before"))).won

    server.stop()
    for operation in (store.journal.get(claim("before").scope.kid), store.journal.claim(claim("during")),
                      store.journal.complete(claim("before").scope.kid, "a", REPLY), store.ping(),
                      store.runs.observe_epoch("default", "run-1", 0, Run("default", "run-1"), time.time()),
                      store.journal.next_occurrence("default", "run-1", 0, "fp", 60, tenant="t")):
        await _fails_within(operation, 1.5)
    started = time.monotonic()
    await store.journal.wait("some-kid", 0.3)  # waiting never hangs either
    assert time.monotonic() - started < 1.0

    server.start()  # same port, empty (no persistence): the same store object works again
    await _eventually(lambda: store.journal.claim(claim("after")))
    assert (await store.journal.get(claim("after").scope.kid)).owner == "a"

    async def woken_by_message() -> bool:  # the notification reader resubscribed by itself
        kid = (await other.journal.claim(claim(f"wake-{uuid.uuid4().hex}"))).entry.kid
        waiting = asyncio.create_task(store.journal.wait(kid, 5.0))
        await asyncio.sleep(0.05)
        changed = time.monotonic()
        await other.journal.complete(kid, "a", REPLY)
        await waiting
        return time.monotonic() - changed < POLL_S / 2
    await _eventually(woken_by_message, within=8.0)


@pytest.mark.slow  # a private Redis instance
async def test_scripts_the_server_forgot_are_loaded_again(private_redis, open_store):
    """Requests in one pipeline after SCRIPT FLUSH: each runs once, none fails."""
    server = private_redis().start()
    store = await open_store(server.url)
    raw = redis_asyncio.Redis.from_url(server.url)
    try:
        await raw.script_flush()
        claims = [claim(f"k{i}", owner=f"o{i}") for i in range(10)]
        results = await asyncio.gather(*(store.journal.claim(c) for c in claims), store.journal.get("no-such-kid"))
        assert all(r.won for r in results[:10]) and results[10] is None
        await raw.script_flush()
        kept = await asyncio.gather(*(store.journal.complete(c.scope.kid, c.owner, REPLY) for c in claims))
        assert kept == [True] * 10
        assert (await store.journal.get(claims[0].scope.kid)).response.body == REPLY.body
    finally:
        await raw.aclose()


@pytest.mark.slow  # a private Redis frozen with SIGSTOP
async def test_a_frozen_redis_never_hangs_an_operation(private_redis, open_store):
    """A server that accepts connections but never answers: every call ends within the timeout."""
    server = private_redis().start()
    store = await open_store(server.url, timeout=0.5)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        await _fails_within(store.journal.claim(claim("frozen")), 1.5)
        await _fails_within(store.journal.get(claim("frozen").scope.kid), 1.5)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    await _eventually(lambda: store.journal.claim(claim("thawed")))


@pytest.mark.slow  # a private Redis frozen with SIGSTOP
async def test_a_proxy_stops_in_bounded_time_on_a_frozen_redis(private_redis, make_proxy, provider, http):
    """A stop writes what is pending (here, replay counts) and closes the store, each call
    bounded by the store's timeout, and each of the two parts by twice that and a second."""
    server = private_redis().start()
    proxy = await make_proxy(server.url + "?prefix=proxy:", store={"timeout": "1s"})
    chat, body = "/openai/v1/chat/completions", {"model": "m", "messages": []}
    for _ in range(3):  # a record, then two replays whose counts are written at the stop
        async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": "k"}) as r:
            assert r.status == 200
    server.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        await proxy.server.close()
        assert time.monotonic() - started < 2 * (2 * 1.0 + 1) + 2  # and a second each to cancel
    finally:
        server.proc.send_signal(signal.SIGCONT)


@pytest.mark.slow  # a private Redis stopped and started
async def test_proxy_on_a_stopped_redis_fails_closed_and_recovers(private_redis, make_proxy, provider, http):
    """Through a real proxy: 503 within the timeout, nothing forwarded, passthrough up, then back."""
    server = private_redis().start()
    proxy = await make_proxy(server.url + "?prefix=proxy:", store={"timeout": "1s"})
    chat, body = "/openai/v1/chat/completions", {"model": "m", "messages": []}
    async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": "before"}) as r:
        assert r.status == 200

    server.stop()
    for key in ("during-1", "during-2"):
        started = time.monotonic()
        async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": key}) as r:
            assert r.status == 503
            assert (await r.json())["type"].endswith("/store-unavailable")
        assert time.monotonic() - started < 2.5
    assert provider.calls["chat"] == 1  # never forwarded unjournaled
    async with http.get(proxy.url + "/raw/echo/still-up") as r:
        assert r.status == 200  # passthrough needs no store
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 503

    server.start()

    async def records_again() -> bool:
        async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": "after"}) as r:
            return r.status == 200
    deadline = time.monotonic() + 5.0
    while not await records_again():
        assert time.monotonic() < deadline, "the proxy did not recover by itself"
        await asyncio.sleep(0.2)
    async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": "after"}) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
    async with http.get(proxy.url + "/readyz") as r:
        assert r.status == 200
    assert provider.calls["chat"] == 2


async def test_a_new_key_costs_two_scripts_and_a_replay_from_the_store_one(private_redis, make_proxy, provider,
                                                                          http):
    """The proxy asks for a claim first, on Redis too: the claim script answers a taken key
    with its entry. A record is then two scripts (claim, complete), not three (a read first)."""
    server = private_redis().start()
    calls = redis_asyncio.Redis.from_url(server.url)

    async def scripts() -> int:
        return (await calls.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    try:
        proxies = [await make_proxy(server.url), await make_proxy(server.url)]  # two replicas, one store
        body = {"model": "m", "messages": [{"role": "user", "content": "count my store calls"}]}
        for key in ("warm-up", "counted"):  # the warm-up loads the scripts (a first EVALSHA fails, NOSCRIPT)
            headers = {"Idempotency-Key": key, "Authorization": "Bearer sk-a"}
            before = await scripts()
            async with http.post(f"{proxies[0].url}/openai/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
            recorded = await scripts()
            # the other replica has nothing in memory: its replay asks the store, once
            async with http.post(f"{proxies[1].url}/openai/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200 and r.headers["Idempotent-Replayed"] == "true"
        assert recorded - before == 2
        assert await scripts() - recorded == 1
        assert provider.calls["chat"] == 2
    finally:
        await calls.aclose()


async def test_entries_quarantined_before_the_upgrade_are_counted_after_a_migrating_open(open_store, shared_url):
    """The quarantined zset came with the audit release: a migrating open indexes the entries
    that older proxies quarantined (once: its marker), so the gauge counts them too."""
    url, prefix = shared_url
    store = await open_store(url)
    for key in ("old-1", "old-2"):
        await store.journal.claim(claim(key))
        await store.journal.quarantine(claim(key).scope.kid, "a", "upstream answered 502")
    raw = redis_asyncio.Redis.from_url(redis_url())
    try:
        await raw.delete(f"{prefix}quarantined", f"{prefix}layout:quarantined")  # as an older release left it
        assert await store.journal.count_quarantined() == 0
        reopened = await open_store(url)
        assert await reopened.journal.count_quarantined() == 2
        assert await raw.get(f"{prefix}layout:quarantined") == b"1"
    finally:
        await raw.aclose()


async def test_wait_replicas_acknowledges_nothing_no_replica_has_and_replays_never_wait(shared_url, make_proxy,
                                                                                        provider, http, caplog):
    """redis_wait_replicas = 1 on a Redis with no replica (said at start): a new key's claim is not
    acknowledged (503, nothing forwarded, the key given back), while a replay answers at once."""
    url, _ = shared_url
    plain = await make_proxy(url)
    with caplog.at_level(logging.WARNING, "idemproxy.store"):
        waiting = await make_proxy(url, store={"redis_wait_replicas": 1, "timeout": "1s", "answer_cache_bytes": 0,
                                               "replay_cache_bytes": 0})
    assert "redis_wait_replicas = 1, but the master has 0 replica(s)" in caplog.text
    chat, body = "/openai/v1/chat/completions", {"model": "m", "messages": []}

    async def post(proxy, key: str) -> tuple[int, str, dict]:
        async with http.post(proxy.url + chat, json=body, headers={"Idempotency-Key": key}) as r:
            return r.status, r.headers.get("Idempotent-Replayed", ""), await r.json()
    assert (await post(plain, "old"))[:2] == (200, "false")
    assert (await post(waiting, "old"))[:2] == (200, "true")
    status, _, problem = await post(waiting, "new")
    assert status == 503 and problem["type"].endswith("/store-unavailable")
    assert provider.calls["chat"] == 1

    async def given_back() -> bool:  # the claim WAIT did not confirm is released, not left to its lease
        return (await post(plain, "new"))[:2] == (200, "false")
    await until(given_back, 5, "the unconfirmed claim given back")


def test_wait_replicas_is_validated():
    with pytest.raises(ConfigError, match="for a Redis store"):
        validate(Settings(store=StoreSettings(url="sqlite:///x.db", redis_wait_replicas=1)))
    with pytest.raises(ConfigError, match="redis_wait_replicas"):
        validate(Settings(store=StoreSettings(url="redis://127.0.0.1:6379/0", redis_wait_replicas=-1)))


async def test_with_wait_replicas_every_write_waits_and_no_read_does(shared_url):
    """Not only claims and records: a run's change, a quarantine, a release are confirmed by WAIT
    too (none here: the Redis has no replica), while reads answer."""
    url, _ = shared_url
    store = redis_store(url, timeout=1.0, wait_replicas=1)
    await store.open()
    try:
        for write in (store.runs.upsert(Run("default", "run-1", created_at=time.time())),
                      store.journal.quarantine("0" * 64, None, "unknown"),
                      store.journal.release("0" * 64, "nobody")):
            with pytest.raises(ReplicasBehind):
                await write
        assert await store.journal.get("0" * 64) is None
        assert await store.journal.recorded("default", "run-1", 1 << 20) == ({}, True)
    finally:
        await store.aclose()
