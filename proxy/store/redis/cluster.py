"""Redis Cluster (``redis+cluster://host:port[,host:port...]/?prefix=idem:``, ``rediss+cluster://``
for TLS): the seed nodes and the client.

A deployment's keys are grouped in shards, each a hash tag (:mod:`.shards`), as a Lua script
may touch the keys of one slot only. Notifications are sharded pub/sub (SPUBLISH from the
scripts, SSUBSCRIBE), one channel a shard in its slot: they stay on that shard instead of
crossing the whole cluster bus.

redis-py's cluster client routes every ordinary call and follows MOVED/ASK and topology
changes; the request path's pipelines (:meth:`.connection.RedisConnection.pipeline`) go to
their shards' masters directly, and ask for a fresh slot map after any failure there.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot

SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def hash_tagged(prefix: str) -> str:
    """The prefix as a hash tag: shard 0's, and every shard's of a deployment laid out in one."""
    return "{" + prefix + "}"


def slot_of(key: str) -> int:
    return key_slot(key.encode())


def seeds(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each seed node in a cluster URL's comma-separated netloc."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    found = []
    for seed in hosts.split(","):
        host, _, port = seed.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a Redis Cluster seed must be host:port, got {seed!r}")
        found.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0"):
        raise ValueError("Redis Cluster has database 0 only: leave the URL's path empty")
    return found


def cluster_client(url: str, timeout: float) -> RedisCluster:
    """The cluster client for a ``redis+cluster://`` URL (``prefix`` already taken out).

    Its own retries (a few, quick) are what carry a call over a failover: it refreshes the
    slot map and asks the promoted replica; every call stays bounded by the store's timeout.
    """
    parts = urlsplit(url)
    nodes = seeds(url)
    userinfo = parts.netloc.rpartition("@")[0]
    host, port = nodes[0]
    # redis-py reads the credentials and TLS options from a one-node URL of the same scheme
    first = urlunsplit((SCHEMES[parts.scheme], f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}",
                        "", parts.query, ""))
    options: dict[str, Any] = dict(
        startup_nodes=[ClusterNode(h, p) for h, p in nodes], socket_timeout=timeout,
        socket_connect_timeout=timeout, decode_responses=False,
        require_full_coverage=False,  # a deployment needs its own slot served, not every slot
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 6))
    return RedisCluster.from_url(first, **options)
