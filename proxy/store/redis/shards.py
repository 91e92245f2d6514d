"""How a deployment's keys are spread over Redis Cluster: shards, each one hash tag.

A Lua script may touch keys of one hash slot only, and a run's scripts touch the run, its
history and the indexes it is listed in, all learnt from the data. So the keys are grouped
in shards, each a hash tag: a run lives, with every index a run script keeps, in the shard
of its name (``rk``); a journal entry, with its stream in flight and the index of the
quarantined, in the shard of its ``kid``. What crosses shards (a claim's run, a release's
index, a run's journal) is two scripts in a safe order (:mod:`.journal`); what reads every
shard (the supervisor's due runs, listings, purges) asks each shard once.

- One Redis, or a cluster deployment laid out before shards: one shard, the prefix itself
  (``idem:``, or ``{idem:}`` on a cluster): the layout of every earlier version.
- A new cluster deployment: ``shards`` of them (the URL's ``shards``, 16 by default).
  Shard 0 is ``{prefix}``; shard ``i`` is ``{prefix#i.j}``, with ``j`` the first whose slot
  lies in the ``i``-th slice of the slots after shard 0's: a cluster hands out slots in
  ranges, so the shards spread evenly over its masters.

The layout is chosen once, when a deployment is first opened, and kept in shard 0's
``layout:shards`` (the shards' tags, as JSON): every replica reads it from there, a URL
asking for another number is refused, and a deployment found without it but with data (an
earlier version's) keeps its one shard.
"""

from __future__ import annotations

import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS

from .cluster import slot_of

DEFAULT_SHARDS = 16  # for a new cluster deployment; a deployment's number never changes
MAX_SHARDS = 1024


class Shard:
    """The keys of one shard: every one starts with its prefix (its hash tag on a cluster)."""
    __slots__ = ("prefix", "channel", "anchor")

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.channel = prefix + "changed"  # where its scripts publish the kids they change
        self.anchor = prefix + "generation"  # a key of the shard, to route a script naming none

    def __repr__(self) -> str:
        return f"Shard({self.prefix!r})"

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)


def cluster_tags(root: str, count: int) -> list[str]:
    """The hash tags of ``count`` shards of the prefix ``root``, spread over the slots."""
    tags = ["{" + root + "}"]
    first, width = slot_of(tags[0]), REDIS_CLUSTER_HASH_SLOTS // count
    for i in range(1, count):
        start = (first + i * width) % REDIS_CLUSTER_HASH_SLOTS
        j = 0
        while (slot_of(tag := "{" + f"{root}#{i}.{j}" + "}") - start) % REDIS_CLUSTER_HASH_SLOTS >= width:
            j += 1
        tags.append(tag)
    return tags


class Layout:
    """The shards of a deployment, and which one holds a kid's entry or a run."""
    __slots__ = ("shards", "first")

    def __init__(self, prefixes: list[str]):
        self.shards = [Shard(prefix) for prefix in prefixes]
        self.first = self.shards[0]  # where what belongs to no run or entry lives

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def of(self, name: str) -> Shard:
        """The shard of a kid or a run's rk."""
        if len(self.shards) == 1:
            return self.first
        return self.shards[zlib.crc32(name.encode()) % len(self.shards)]

    def owning(self, key: bytes) -> tuple[Shard, str] | None:
        """The shard a key found by SCAN is of, and the rest of its name; None for another's."""
        name = key.decode()
        for shard in self.shards:  # a few dozen at most; scans are for operators
            if name.startswith(shard.prefix):
                return shard, name[len(shard.prefix):]
        return None
