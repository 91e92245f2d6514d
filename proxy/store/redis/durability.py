"""What an acknowledged write survives on Redis: the server's own persistence, and replication
(``[store] redis_wait_replicas``: WAIT on the link that wrote, so a failover to a replica keeps
what was acknowledged).

WAIT counts the writes of the connection it is sent on, so :func:`confirm` is sent on the
link of the pipeline that wrote; writes it cannot confirm fail as :class:`ReplicasBehind`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import hiredis

from ..errors import StoreUnavailable


class ReplicasBehind(StoreUnavailable):
    """WAIT heard fewer replicas than ``redis_wait_replicas`` confirm a write: it is on the
    master only, and a failover now could lose it, so it is not acknowledged."""


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


def replication_of(cluster: bool, wait_replicas: int) -> str:
    """What replication adds to :func:`durability_of`: said for a cluster, or when replicas are awaited."""
    if wait_replicas:
        return (f"; a claim, a record or a run's change is acknowledged once {wait_replicas} replica(s) "
                "have it (redis_wait_replicas), so a failover keeps it")
    if cluster:
        return ("; replication is asynchronous (redis_wait_replicas = 0): a failover loses the claims and "
                "records its master acknowledged in the last moments before it died")
    return ""


async def confirm(conn: Any, results: list[Any], wrote: Callable[[int, Any], bool], replicas: int,
                  wait_ms: int) -> None:
    """WAIT on ``conn`` if any result ``wrote``; short of ``replicas``, those results become
    ReplicasBehind. Nothing is sent for a pipeline that wrote nothing (reads, replays)."""
    written = [i for i, result in enumerate(results) if wrote(i, result)]
    if not written:
        return
    await conn.send_packed_command(hiredis.pack_command(("WAIT", replicas, wait_ms)), check_health=False)
    acked = await conn.read_response(timeout=math.inf)  # the caller bounds the whole pipeline
    if acked < replicas:
        behind = ReplicasBehind(f"redis WAIT: {acked} of the {replicas} replica(s) redis_wait_replicas "
                                f"asks for confirmed the write within {wait_ms} ms")
        for i in written:
            results[i] = behind
