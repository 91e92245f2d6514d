"""Redis store (``redis://host:port/db?prefix=idem:``, ``rediss://`` for TLS), or Redis Cluster
(``redis+cluster://host:port,host:port/?prefix=idem:&shards=16``, ``rediss+cluster://``:
:mod:`.cluster`).

Every key starts with ``prefix`` (default ``idem:``), so several deployments, or tests,
share one database. On Redis Cluster, a key starts with its shard's hash tag instead
(:mod:`.shards`): ``{idem:}``, ``{idem:#1.7}``, ...; a run's keys and the indexes below
marked *a shard's* are in the run's shard, an entry's in its kid's, the rest in shard 0.
``rk`` names a run: ``{len(namespace)}:{namespace}:{run_id}``, unambiguous whatever the
namespace holds. The layout::

    entry:{kid}        hash   a journal entry and its response; expires at its retention
    partial:{kid}      hash   a stream in flight: seq -> bytes (0: status and headers as JSON)
    steps:{rk}         zset   kid -> created_at: a run's journal
    steps-expiry       zset   a shard's: "{kid} {rk}" -> expiry (ms): lets purge() clean steps:{rk}
    occ:{rk}           hash   "{epoch}:{tenant} {fingerprint}" -> occurrences (derived keys)
    run:{rk}           hash   a run;  history:{rk}  list  its last 50 events (JSON)
    restarts:{rk}      list   times of the restarts that count towards max_restarts, in its window
    runs, runs:{state} zset   a shard's: rk -> created_at, for listing
    runs-deadline      zset   a shard's: rk -> when a live run is due to a supervisor (run_scripts.py, due)
    runs-named:{id}    set    a shard's: rks of the runs called {id} (one per namespace)
    runs-idle          zset   a shard's: rk -> max(last_seen, ended_at): runs purge() deletes
    secret:{name}      string
    generation         string the journal's invalidation generation (Journal.generation)
    quarantined        zset   a shard's: kid -> expiry (ms) of entries whose outcome is unknown (counted)
    layout:quarantined string set once entries quarantined before that zset was kept are in it
    layout:shards      string on a cluster: the shards' hash tags (JSON), chosen at the first open
    actions:entry:{kid}, actions:run:{rk}
                       list   operator actions (JSON), expiring a retention after the last
    channel {prefix}changed   pub/sub, a shard's: a kid whose entry changed, to wake waiters

- :mod:`.connection`: the client, its scripts, pipelines and the pub/sub reader, shared by
  the journal and the runs; every Redis error becomes StoreUnavailable there. Durability
  is Redis's own (:mod:`.durability`).
- :mod:`.scripts`: the Lua scripts, one per change, so each is atomic: the journal's in
  :mod:`.journal_scripts`, the runs' in :mod:`.run_scripts`.
- :mod:`.shards`: which shard holds a run or an entry.
- :mod:`.values`: how runs are named in keys, and values kept as text in hashes.
- :mod:`.journal`, :mod:`.runs`: the two halves of the store contract over the connection;
  :mod:`.audit`: operator actions.
"""

from __future__ import annotations

from ..composed import Store
from .audit import RedisAudit
from .connection import RedisConnection
from .journal import RedisJournal
from .runs import RedisRuns

__all__ = ["redis_store"]


def redis_store(url: str, timeout: float = 5.0, wait_replicas: int = 0) -> Store:
    """The journal, the runs and the secrets in Redis; see the module docstring."""
    connection = RedisConnection(url, timeout, wait_replicas)
    return Store(connection, RedisJournal(connection), RedisRuns(connection), RedisAudit(connection))
