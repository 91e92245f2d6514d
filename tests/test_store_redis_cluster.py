"""The store on a real Redis Cluster (3 masters, 3 replicas: tests/redis_cluster.py): the
whole store contract, and what only a cluster has (the one slot, sharded notifications).

The contract's tests are imported here, so they run once more with ``store_url`` naming a
fresh key prefix on the cluster; the cluster is started once for this module.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from idemproxy.proxy.config import StoreSettings
from idemproxy.proxy.store import make_store
from idemproxy.proxy.store.redis.cluster import hash_tagged, seeds, slot_of
from redis_cluster import RedisCluster
from test_store_contract import *  # noqa: F401,F403 - the contract, run again on the cluster
from test_store_contract import claim_of, scope


@pytest.fixture(scope="module")
def cluster():
    started = RedisCluster().start()
    yield started
    started.destroy()


@pytest.fixture
def store_url(cluster):
    return f"{cluster.url}/?prefix=t{uuid.uuid4().hex[:10]}:"


async def test_every_key_of_a_deployment_is_in_its_prefixs_slot(store_url, cluster):
    store = make_store(StoreSettings(url=store_url))
    await store.open()
    try:
        claim = claim_of(scope())
        assert (await store.journal.claim(claim)).won
        await store.runs.upsert(__import__("test_store_contract").new_run())
        prefix = store.connection.prefix
        master = cluster.master_of(prefix)
        client = redis.Redis(port=master)
        keys = list(client.scan_iter(match=prefix.replace("{", "\\{").replace("}", "\\}") + "*"))
        client.close()
        assert len(keys) >= 4
        assert {slot_of(key.decode()) for key in keys} == {slot_of(hash_tagged(prefix.strip("{}")))}
    finally:
        await store.aclose()


def test_cluster_urls_name_their_seeds():
    assert seeds("redis+cluster://u:p@a:1,b:2/?prefix=x:") == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError):
        seeds("redis+cluster://a:1/3")
    with pytest.raises(ValueError):
        seeds("redis+cluster://a,b:2")
