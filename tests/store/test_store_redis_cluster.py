"""The store on a real Redis Cluster (3 masters, 3 replicas: tests/support/redis_cluster.py): the
whole store contract, and what only a cluster has (shards, sharded notifications).

The contract's tests are imported here, so they run twice more with ``store_url`` naming a
fresh key prefix on the cluster, with and without ``redis_wait_replicas``; the cluster is
started once for this module.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
from redis.asyncio.connection import SSLConnection

from idemproxy.proxy.config import ConfigError, StoreSettings
from idemproxy.proxy.store import StoreUnavailable, make_store
from idemproxy.proxy.store.errors import StoreMisconfigured
from idemproxy.proxy.store.model import Run, Scope
from idemproxy.proxy.store.redis.cluster import cluster_client, seeds, slot_of
from idemproxy.proxy.store.redis.connection import POLL_S
from idemproxy.proxy.store.redis.shards import DEFAULT_SHARDS
from idemproxy.proxy.store.redis.values import run_ref
from conftest import until
from redis_cluster import STEADY_MS, RedisCluster
from run_cli import idemproxy
from test_store_contract import *  # noqa: F401,F403 - the contract, run again on the cluster
from test_store_contract import NS, REPLY, claim_of, new_run, scope


@pytest.fixture(scope="module")
def cluster():
    started = RedisCluster(node_timeout_ms=STEADY_MS).start()
    yield started
    started.destroy()


@pytest.fixture
def store_url(cluster):
    return f"{cluster.url}/?prefix=t{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=[0, 1], ids=["wait-0", "wait-1"])
def store_settings(store_url, request) -> StoreSettings:
    """The contract, as is and with every write confirmed by a replica (redis_wait_replicas)."""
    return StoreSettings(url=store_url, redis_wait_replicas=request.param)


async def test_a_deployment_is_spread_over_its_shards_and_every_master(store_url, cluster):
    """Sixteen shards by default, spread over the three masters; an entry lives in its kid's
    shard and a run in its name's, and every key of one shard is in that shard's slot."""
    store = make_store(StoreSettings(url=store_url))
    await store.open()
    try:
        layout = store.connection.layout
        assert len(layout.shards) == DEFAULT_SHARDS
        masters = {cluster.master_of(shard.prefix) for shard in layout.shards}
        assert masters == set(cluster.ports[:3])
        for i in range(40):
            sc = scope(f"step-{i}", run=f"run-{i % 8}")
            assert (await store.journal.claim(claim_of(sc))).won
        for i in range(8):
            await store.runs.upsert(new_run(f"run-{i}"))
        slots = {slot_of(shard.prefix): shard for shard in layout.shards}
        assert len(slots) == DEFAULT_SHARDS
        found = []
        for port in set(cluster.ports[:3]):
            client = redis.Redis(port=port)
            found += list(client.scan_iter(match="\\{" + store.connection.root + "*"))
            client.close()
        for key in found:
            shard, rest = layout.owning(key)
            assert slots[slot_of(key.decode())] is shard, key
            name = rest.partition(":")[2]
            if rest.startswith(("entry:", "run:", "steps:")):
                assert layout.of(name) is shard, key
        assert len({layout.owning(key)[0] for key in found}) > 8  # 40 entries and 8 runs: most shards used
    finally:
        await store.aclose()


async def test_a_deployments_shards_are_chosen_once(cluster, tmp_path):
    """The layout is stored when a deployment is first opened: a URL asking for another number
    is refused, ``idemproxy check`` writes none, and a deployment an earlier version left (one
    shard, no layout stored) keeps its one shard."""
    base = f"{cluster.url}/?prefix=t{uuid.uuid4().hex[:10]}:"
    checked = idemproxy("check", "--store", base + "&shards=8", cwd=tmp_path)  # stores no layout of 8
    assert checked.returncode == 0, checked.stderr
    first = make_store(StoreSettings(url=base + "&shards=4"))
    await first.open()
    again = make_store(StoreSettings(url=base))  # no shards said: the stored layout
    await again.open()
    try:
        assert len(again.connection.layout.shards) == 4
        assert [s.prefix for s in again.connection.layout.shards] == [s.prefix for s in first.connection.layout.shards]
        other = make_store(StoreSettings(url=base + "&shards=8"))
        with pytest.raises(StoreMisconfigured, match="laid out in 4 shard"):
            await other.open()
    finally:
        await first.aclose()
        await again.aclose()

    root = f"t{uuid.uuid4().hex[:10]}:"
    earlier = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    earlier.set("{" + root + "}generation", 3)  # as an earlier version's serve leaves it: one slot, no layout
    earlier.set("{" + root + "}layout:quarantined", 1)
    earlier.close()
    store = make_store(StoreSettings(url=f"{cluster.url}/?prefix={root}"))
    await store.open()
    try:
        assert [s.prefix for s in store.connection.layout.shards] == ["{" + root + "}"]
        assert await store.journal.generation() == 3
    finally:
        await store.aclose()
    with pytest.raises(StoreMisconfigured, match="laid out in 1 shard"):
        await make_store(StoreSettings(url=f"{cluster.url}/?prefix={root}&shards=16")).open()


def _apart(layout, together: bool) -> Scope:
    """A run's step whose entry lies in its run's shard, or in another."""
    for i in range(1000):
        sc = scope(f"step-{i}", run="fenced")
        if (layout.of(sc.kid) is layout.of(run_ref(NS, "fenced"))) == together:
            return sc
    raise AssertionError("no such step")


@pytest.mark.parametrize("together", [True, False], ids=["one-shard", "two-shards"])
async def test_a_superseded_attempt_claims_nothing_whether_its_entry_is_in_its_runs_shard_or_not(
        open_store, together):
    store = await open_store()
    await store.runs.upsert(new_run("fenced"))
    now = time.time()
    assert await store.runs.new_attempt(NS, "fenced", 0, now, "restart", True)  # epoch 1
    sc = _apart(store.connection.layout, together)
    stale = await store.journal.claim(claim_of(sc, owner="old", epoch=0))
    assert (stale.won, stale.stale_epoch) == (False, 1)
    current = await store.journal.claim(claim_of(sc, owner="new", epoch=1))
    assert current.won  # the stale claim left the key free
    assert [e.kid for e in await store.journal.entries(NS, "fenced")] == [sc.kid]
    assert await store.journal.complete(sc.kid, "new", REPLY)
    replayed = await store.journal.claim(claim_of(sc, owner="old", epoch=0))
    assert (replayed.won, replayed.stale_epoch) == (False, 1)  # a replay is refused to it too
    await store.journal.release(sc.kid, "nobody")  # not the owner: nothing changes
    assert [e.kid for e in await store.journal.entries(NS, "fenced")] == [sc.kid]


async def test_a_step_a_crash_left_out_of_its_runs_journal_is_listed_by_the_next_claim_of_it(open_store):
    """Between a claim and its run's check (two shards), a process may die: the entry is then in
    no run's journal. An attempt's next claim of it (a replay) checks the run and lists it again."""
    store = await open_store()
    await store.runs.upsert(new_run("fenced"))
    sc = _apart(store.connection.layout, together=False)
    assert (await store.journal.claim(claim_of(sc, epoch=0))).won
    assert await store.journal.complete(sc.kid, "owner-1", REPLY)
    run_shard = store.connection.layout.of(run_ref(NS, "fenced"))
    await store.connection.do(store.connection.client.delete(run_shard.key("steps", run_ref(NS, "fenced"))))
    assert await store.journal.entries(NS, "fenced") == []  # as a crash between the two scripts leaves it
    replayed = await store.journal.claim(claim_of(sc, owner="again", epoch=0))
    assert not replayed.won and replayed.entry.response.body == REPLY.body
    assert [e.kid for e in await store.journal.entries(NS, "fenced")] == [sc.kid]


class Held:
    """Holds the store's next call of one script until ``go()``: another caller's claim runs
    between the two steps of a change that crosses shards (no mock: the script runs, later)."""

    def __init__(self, connection, name: str):
        self.reached, self._go = asyncio.Event(), asyncio.Event()
        original = connection.script

        def script(called, keys, args):
            if called != name or self._go.is_set():
                return original(called, keys, args)

            async def later():
                self.reached.set()
                await self._go.wait()
                return await original(called, keys, args)
            return later()
        connection.script = script

    def go(self) -> None:
        self._go.set()


async def _release(store, sc):
    await store.journal.release(sc.kid, "owner-1")


async def _purge(store, sc):
    await asyncio.sleep(1.3)  # the first claim's entry (a second's retention) has expired
    await store.journal.purge(time.time())


async def _delete(store, sc):
    assert await store.journal.delete_run(NS, "fenced") == 1


@pytest.mark.parametrize("change, held, retention_s", [(_release, "unindex_step", 3600.0),
                                                       (_purge, "purge_steps", 1.0),
                                                       (_delete, "delete_steps", 3600.0)],
                         ids=["release", "purge", "delete-run"])
async def test_a_claim_between_the_two_steps_of_a_change_stays_in_its_runs_journal(
        open_store, change, held, retention_s):
    """A release, a purge and a run's deletion change the entry's shard, then the run's index.
    A claim of the same step in between (another replica's) keeps its place in the run's
    journal, and a deletion of the run after it deletes it."""
    store, other = await open_store(), await open_store()
    await store.runs.upsert(new_run("fenced"))
    sc = _apart(store.connection.layout, together=False)
    assert (await store.journal.claim(claim_of(sc, epoch=0, retention_s=retention_s))).won
    if change is not _release:
        assert await store.journal.complete(sc.kid, "owner-1", REPLY)
    pause = Held(store.connection, held)
    changing = asyncio.create_task(change(store, sc))
    await asyncio.wait_for(pause.reached.wait(), 10)
    again = await other.journal.claim(claim_of(sc, owner="other", epoch=0))
    assert again.won and await other.journal.complete(sc.kid, "other", REPLY)
    pause.go()
    await changing
    assert [e.kid for e in await other.journal.entries(NS, "fenced")] == [sc.kid]
    assert list((await other.journal.recorded(NS, "fenced", 10 ** 6))[0]) == [sc.kid]
    assert await other.journal.delete_run(NS, "fenced") == 1
    assert await other.journal.get(sc.kid) is None


async def test_a_superseded_attempt_leaves_an_entry_an_operator_retried_as_it_was(open_store):
    """A claim that would take over an entry (here one an operator retried) checks its run's
    epoch first when they lie in different shards: a superseded attempt changes nothing."""
    store = await open_store()
    await store.runs.upsert(new_run("fenced"))
    sc = _apart(store.connection.layout, together=False)
    assert (await store.journal.claim(claim_of(sc, epoch=0))).won
    await store.journal.quarantine(sc.kid, "owner-1", "the proxy stopped mid-call", {"why": "evidence"})
    assert await store.journal.resolve(sc.kid, None)  # retry
    assert await store.runs.new_attempt(NS, "fenced", 0, time.time(), "restart", True)
    stale = await store.journal.claim(claim_of(sc, owner="stale", epoch=0))
    assert (stale.won, stale.stale_epoch) == (False, 1)
    entry = await store.journal.get(sc.kid)
    assert (entry.state, entry.detail, entry.evidence) == ("retried", "the proxy stopped mid-call", {"why": "evidence"})
    assert (await store.journal.claim(claim_of(sc, owner="current", epoch=1))).won  # the current one takes it over


async def test_the_supervisor_claims_no_more_runs_than_it_asks_for_across_shards(open_store):
    store = await open_store()
    past = time.time() - 1000
    for i in range(40):
        await store.runs.upsert(new_run(f"silent-{i}", last_seen=past, started_at=past, created_at=past))
    now = time.time()
    first = await store.runs.silent(now, 7, claim_s=60)
    second = await store.runs.silent(now, 50, claim_s=60)
    assert len(first) == 7 and len(second) == 33
    assert not {r.run_id for r in first} & {r.run_id for r in second}
    assert await store.runs.silent(now, 50, claim_s=60) == []
    assert len(await store.runs.list(limit=25)) == 25 and (await store.runs.count())["running"] == 40


async def woken_by_a_message(writer, waiter) -> bool:
    """Whether a record made through ``writer`` wakes a wait on ``waiter`` sooner than its poll
    would (so by the sharded notification)."""
    try:
        won = await writer.journal.claim(claim_of(scope(f"wake-{uuid.uuid4().hex[:6]}")))
        wait = asyncio.create_task(waiter.journal.wait(won.entry.kid, 5.0))
        await asyncio.sleep(0.05)
        changed = time.monotonic()
        await writer.journal.complete(won.entry.kid, won.entry.owner, REPLY)
        await wait
        return time.monotonic() - changed < POLL_S / 2
    except StoreUnavailable:  # a failover under way: its first calls fail, closed
        return False


async def test_a_record_wakes_a_waiter_on_another_instance_by_a_sharded_message(open_store):
    writer, waiter = await open_store(), await open_store()
    assert await woken_by_a_message(writer, waiter)


async def test_more_calls_at_once_than_links_wait_for_one_instead_of_failing(store_url):
    """The cluster client fails a call past its links to a node (MaxConnectionsError, a 503
    to the agent); the store holds its calls at once below them instead: 300 runs
    registered at once through 8 links all succeed."""
    store = make_store(StoreSettings(url=f"{store_url}&max_connections=8"))
    await store.open()
    try:
        now = time.time()
        runs = await asyncio.gather(*(store.runs.upsert(Run("default", f"r{i}", created_at=now))
                                      for i in range(300)))
        assert [run.run_id for run in runs] == [f"r{i}" for i in range(300)]
    finally:
        await store.aclose()


async def test_a_slot_moved_to_another_master_is_followed(open_store, cluster):
    """Resharding moves the deployment's slot, with its keys, to another master: the next calls
    follow it (MOVED: the slot map refreshed, the commands sent again), records included, and so
    do the notifications."""
    store, other = await open_store(), await open_store()
    first = claim_of(scope("before-the-move"))
    assert (await store.journal.claim(first)).won
    assert await store.journal.complete(first.scope.kid, first.owner, REPLY)
    source = cluster.master_of(store.connection.prefix)
    target = next(port for port in cluster.ports[:3] if port != source)  # the first three start as masters
    await asyncio.to_thread(cluster.move_slot, store.connection.prefix, target)
    assert cluster.master_of(store.connection.prefix) == target

    second = claim_of(scope("after-the-move"))
    assert (await store.journal.claim(second)).won  # no error: MOVED is followed, not returned
    assert await store.journal.complete(second.scope.kid, second.owner, REPLY)
    for entry in (first, second):
        assert (await other.journal.get(entry.scope.kid)).response.body == REPLY.body
    await until(lambda: woken_by_a_message(store, other), 10, "a waiter woken by a message after the move")


async def test_cluster_urls_name_their_seeds_credentials_and_tls():
    assert seeds("redis+cluster://u:p@a:1,b:2/?prefix=x:") == [("a", 1), ("b", 2)]
    tls, plain = (cluster_client("rediss+cluster://user:pw@h1:1,h2:2?ssl_cert_reqs=none", 1.0),
                  cluster_client("redis+cluster://h1:1", 1.0))
    options = tls.connection_kwargs
    assert (options["connection_class"], options["ssl_cert_reqs"]) == (SSLConnection, "none")
    assert (options["username"], options["password"]) == ("user", "pw")
    assert [(n.host, n.port) for n in tls.nodes_manager.startup_nodes.values()] == [("h1", 1), ("h2", 2)]
    assert plain.connection_kwargs["connection_class"] is not SSLConnection
    await tls.aclose()
    await plain.aclose()
    with pytest.raises(ValueError):
        seeds("redis+cluster://a:1/3")
    with pytest.raises(ValueError):
        seeds("redis+cluster://a,b:2")
    with pytest.raises(ConfigError, match="seed must be host:port"):
        make_store(StoreSettings(url="rediss+cluster://h1:6379,h2/?prefix=x:"))


CHAT = "/openai/v1/chat/completions"


async def _post(http, proxy, key: str, content: str = "hello") -> tuple[int, dict, bytes, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    async with http.post(proxy.url + CHAT, json=body, headers={"Idempotency-Key": key}) as r:
        return r.status, dict(r.headers), await r.read(), r.headers.get("Content-Type", "")


async def test_a_proxy_records_and_replays_on_the_cluster(store_url, make_proxy, provider, http):
    """Two replicas on one cluster: one records, the other (nothing in memory) replays."""
    proxies = [await make_proxy(store_url, store={"answer_cache_bytes": 0, "replay_cache_bytes": 0}),
               await make_proxy(store_url)]
    status, headers, recorded, _ = await _post(http, proxies[0], "k-1")
    assert status == 200 and headers["Idempotent-Replayed"] == "false"
    for proxy in proxies:
        status, headers, replayed, _ = await _post(http, proxy, "k-1")
        assert status == 200 and headers["Idempotent-Replayed"] == "true" and replayed == recorded
    assert provider.calls["chat"] == 1


@pytest.fixture
def own_cluster():
    """A cluster of the test's own: it kills a master."""
    started = RedisCluster(node_timeout_ms=1500).start()  # a failover within ~3 s of the kill
    yield started
    started.destroy()


@pytest.mark.slow  # a cluster of its own, a master SIGKILLed and started again
async def test_a_master_killed_under_load_loses_nothing_acknowledged(own_cluster, make_proxy, provider, http):
    """The slot's master is SIGKILLed while records stream in; its replica is promoted. The
    same proxies answer again within seconds, with their caches (``cached``) or without any
    (``bare``); ``safe`` (redis_wait_replicas = 1) refuses to acknowledge while the new master
    has no replica, answers again once the old one rejoins as its replica, and every record
    it acknowledged is still there."""
    url, bare_store = f"{own_cluster.url}/?prefix=failover:", {"answer_cache_bytes": 0, "replay_cache_bytes": 0}
    cached = await make_proxy(url, store={"timeout": "2s"})
    bare = await make_proxy(url, store={"timeout": "2s", **bare_store})
    safe = await make_proxy(url, store={"timeout": "2s", "redis_wait_replicas": 1, **bare_store})
    for proxy in (cached, bare, safe):
        assert (await _post(http, proxy, "warm-up"))[0] == 200
    acknowledged: dict[str, bytes] = {}
    refused = 0
    stop = asyncio.Event()

    async def writer(n: int) -> None:
        nonlocal refused
        i = 0
        while not stop.is_set():
            key, i = f"w{n}-{i}", i + 1
            status, _, body, _ = await _post(http, safe, key, key)
            if status == 200:
                acknowledged[key] = body
            else:
                assert status == 503, body
                refused += 1
            await asyncio.sleep(0.01)
    stores = [make_store(StoreSettings(url=url)) for _ in range(2)]
    for store in stores:
        await store.open()
    assert await woken_by_a_message(*stores)
    writers = [asyncio.create_task(writer(n)) for n in range(4)]
    try:
        await until(lambda: asyncio.sleep(0, len(acknowledged) >= 20), 20, "records before the kill")
        master = own_cluster.master_of("{failover:}")
        await asyncio.to_thread(own_cluster.kill, master)
        killed = time.monotonic()
        await asyncio.to_thread(own_cluster.wait_promoted, master)
        promoted = time.monotonic()

        for proxy in (cached, bare):
            async def records_again(proxy=proxy) -> bool:
                return (await _post(http, proxy, f"after-{uuid.uuid4().hex[:6]}"))[0] == 200
            await until(records_again, 10, "a record again after the promotion, with no restart")
        answered = time.monotonic()
        # the notification reader opened before the kill follows the slot to its new master
        await until(lambda: woken_by_a_message(*stores), 10, "a waiter woken by a message after the failover")
        status, _, body, _ = await _post(http, safe, "with-no-replica")
        assert status == 503 and b"store-unavailable" in body  # the new master has no replica yet

        await asyncio.to_thread(own_cluster.restart, master)

        async def safe_again() -> bool:
            return (await _post(http, safe, f"rejoined-{uuid.uuid4().hex[:6]}"))[0] == 200
        await until(safe_again, 15, "redis_wait_replicas = 1 acknowledging again")
    finally:
        stop.set()
        await asyncio.gather(*writers)
        for store in stores:
            await store.aclose()
    print(f"\nfailover: promoted {promoted - killed:.1f} s after the kill, records again "
          f"{answered - promoted:.1f} s after; {len(acknowledged)} acknowledged, {refused} refused")

    calls = provider.calls["chat"]
    for key, body in acknowledged.items():  # each from the store: bare holds nothing in memory
        status, headers, replayed, _ = await _post(http, bare, key, key)
        assert (status, headers.get("Idempotent-Replayed"), replayed) == (200, "true", body), (key, replayed)
    assert provider.calls["chat"] == calls  # nothing acknowledged went upstream twice


def test_check_opens_the_store_on_a_cluster_and_says_what_a_failover_loses(store_url, tmp_path):
    """``idemproxy check`` on a cluster: 0, with the durability that names replication, and what
    redis_wait_replicas changes (a malformed URL or value: test_cluster_urls..., test_store_redis)."""
    result = idemproxy("check", "--store", store_url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "a failover loses the claims and records" in result.stderr
    result = idemproxy("check", "--store", store_url, "--set", "store.redis_wait_replicas=1", cwd=tmp_path)
    assert result.returncode == 0 and "1 replica(s) have it" in result.stderr, result.stderr
