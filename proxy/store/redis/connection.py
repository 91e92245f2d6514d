"""The Redis store's connection: the client, its scripts, pipelines and pub/sub.

Every call goes through :meth:`RedisConnection.do` or :meth:`RedisConnection.pipeline`,
where Redis's errors, and no answer within ``timeout``, become :class:`StoreUnavailable`
(:class:`translated`). Waiters are woken by pub/sub, with a slow poll in case a message
is lost; the reader resubscribes by itself after an outage. On Redis Cluster (:mod:`.cluster`)
the same, shard by shard (:mod:`.shards`): each pipeline's commands go to the masters of
their shards, and each shard has its own notification channel.

With ``wait_replicas`` (``[store] redis_wait_replicas``) a pipeline that wrote a claim or a
record, and every script that writes, sends ``WAIT`` on the same link before answering (WAIT
counts the writes of the link it is sent on; :mod:`.durability`): fewer replicas than asked
within half the timeout fail those writes. Reads, and claims that found the key taken
(replays), never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from typing import Any, AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import hiredis
import orjson
import redis.asyncio as redis_asyncio  # the redis-py library: absolute imports never mean this package
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, AuthenticationError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from ...config import mask_url
from ..errors import StoreMisconfigured, StoreUnavailable
from ..waking import RUN_LOST, Bell, Waiters
from .cluster import cluster_client, hash_tagged, is_cluster, seeds, slot_of
from .durability import confirm, durability_of, replication_of
from .scripts import READ_ONLY, SCRIPTS, sharded
from .shards import DEFAULT_SHARDS, MAX_SHARDS, Layout, Shard, cluster_tags
from .values import text

log = logging.getLogger("idemproxy.store")

POLL_S = 0.5  # a waiter looks again this often even when no notification comes
POOL_LINKS = 100  # one Redis's links per process unless the URL says max_connections
LISTEN_S = 1.0  # how long the notification reader blocks per read
# ... with shards on several masters: redis-py reads their subscriptions in turn, each for a
# slice of the wait, so a message waits for its master's turn: up to this long
SHARDED_LISTEN_S = 0.05
RECONNECT_S = (0.1, 2.0)  # notification reader's backoff after losing Redis, first and most


def split_url(url: str) -> tuple[str, str, int | None]:
    """(the URL for redis-py, our key prefix, the shards asked for): ``prefix`` and ``shards``
    are ours, not redis-py options."""
    parts = urlsplit(url)
    prefix, shards, kept = "idem:", None, []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "prefix":
            prefix = value
        elif name == "shards":
            if not value.isdigit() or not 1 <= int(value) <= MAX_SHARDS:
                raise ValueError(f"the Redis URL's shards must be a number from 1 to {MAX_SHARDS}, got {value!r}")
            shards = int(value)
        else:
            kept.append((name, value))
    return urlunsplit(parts._replace(query=urlencode(kept))), prefix, shards


def _glob(text: str) -> str:
    """``text`` matched literally in a SCAN pattern."""
    return re.sub(r"([*?\[\]\\{}])", r"\\\1", text)


async def _closed(conn: Any) -> bool:
    """Whether an idle link was closed by the server (or holds a stray reply: unusable too)."""
    try:
        return await conn.can_read()
    except (RedisError, OSError):
        return True


def _unavailable(what: str, exc: RedisError | OSError) -> StoreUnavailable:
    return StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}")


class translated:
    """``with translated(what, timeout):`` Redis's errors, and no answer within ``timeout``,
    become StoreUnavailable. A class, not @contextmanager, whose generator costs every call more."""
    __slots__ = ("what", "timeout")

    def __init__(self, what: str, timeout: float):
        self.what, self.timeout = what, timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, TimeoutError):
            raise StoreUnavailable(f"{self.what} did not answer within {self.timeout}s") from None
        if isinstance(exc, (RedisError, OSError, RedisClusterException)):
            raise _unavailable(self.what, exc) from exc


class RedisConnection:
    """One client, its scripts and the notification reader; see the module docstring."""

    def __init__(self, url: str, timeout: float, wait_replicas: int = 0):
        self.url, self.root, self._shards_asked = split_url(url)
        self.cluster = is_cluster(url)
        if self.cluster:
            seeds(url)  # ValueError for a malformed list: a configuration error, before any connection
        elif self._shards_asked not in (None, 1):
            raise ValueError("shards is for Redis Cluster: one Redis keeps a deployment in one shard")
        self.timeout = timeout
        self.wait_replicas = wait_replicas
        # one shard until open() reads the deployment's layout (a cluster's may have more)
        self.layout = Layout([hash_tagged(self.root) if self.cluster else self.root])
        self._stale_map = False  # the cluster's slot map may be out of date: refresh it first
        self.durability = "unknown until the store is opened"
        self.waiters = Waiters(POLL_S)
        self.lost = Bell()  # an attempt marked lost, by any process on this prefix
        self._client: redis_asyncio.Redis | None = None
        self._kept: Any = None  # the pipelines' link, out of the pool between them (_send)
        self._scripts: dict[str, Any] = {}
        self._listener: asyncio.Task | None = None
        # On a cluster, calls at once to the slot's master, held below its client's links:
        # that client has no blocking pool, and fails a call past them (MaxConnectionsError).
        self._links: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        return f"RedisConnection({mask_url(self.url)!r}, prefix={self.prefix!r})"

    @property
    def prefix(self) -> str:
        """Shard 0's: what belongs to no run or entry (the generation, secrets, the layout)."""
        return self.layout.first.prefix

    @property
    def anchor(self) -> str:
        return self.layout.first.anchor

    def key(self, *parts: str) -> str:
        """A key of shard 0."""
        return self.layout.first.key(*parts)

    async def open(self, migrate: bool = True) -> None:
        """Connect, read the durability, subscribe. Redis keeps no schema: ``migrate`` changes nothing."""
        # One quick retry on a broken connection; timeouts are not retried, since a command
        # that timed out may have run. Every call is also bounded by `timeout` as a whole.
        if self.cluster:
            client = cluster_client(self.url, self.timeout)
            # two links spare: the notifications' subscription, the slot map's refresh
            self._links = asyncio.Semaphore(max(1, client.nodes_manager.connection_kwargs["max_connections"] - 2))
        else:
            # A blocking pool: past its links (100, or the URL's max_connections) a call waits
            # for one to come back, as long as the timeout allows, where the plain pool fails
            # it at once (128 agents heartbeating together got 503s).
            client = redis_asyncio.Redis.from_pool(redis_asyncio.BlockingConnectionPool.from_url(
                self.url, max_connections=POOL_LINKS, timeout=self.timeout, socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                decode_responses=False))
        where = f"redis at {mask_url(self.url)}"
        try:
            with translated(where, self.timeout * 2):
                async with asyncio.timeout(self.timeout * 2):
                    try:
                        await client.ping()
                    except (ResponseError, AuthenticationError, AuthorizationError) as exc:
                        # Redis refuses the URL itself (a database index out of range, a user or
                        # password it does not know): not retried. BusyLoadingError (a Redis
                        # loading its data set) is a ConnectionError, and is.
                        raise StoreMisconfigured(f"{where}: {exc}") from exc
                    appendonly, appendfsync = await self._persistence(client)
                    self.durability = (durability_of(appendonly, appendfsync)
                                       + replication_of(self.cluster, self.wait_replicas))
                    replicas = await self._replicas(client) if self.wait_replicas else 0
                    if self.cluster:
                        self.layout = Layout(await self._laid_out(client, migrate))
                    pubsub = await self._subscribe(client)
        except (StoreUnavailable, StoreMisconfigured):
            await client.aclose()
            raise
        self._client = client
        self._scripts = {name: client.register_script(sharded(source) if self.cluster else source)
                         for name, source in SCRIPTS.items()}
        self._listener = asyncio.create_task(self._listen(pubsub), name="idemproxy-redis-notifications")
        if (appendonly, appendfsync) != ("yes", "always"):
            log.warning("redis durability: %s", self.durability)
        if replicas < self.wait_replicas:
            log.warning("redis_wait_replicas = %d, but the master has %d replica(s): new keys are refused (503) "
                        "until it has enough", self.wait_replicas, replicas)

    async def _laid_out(self, client: Any, migrate: bool) -> list[str]:
        """The shards' prefixes of the deployment on a cluster (:mod:`.shards`): as stored, or
        chosen now and stored (unless ``migrate`` is off: ``idemproxy check`` writes nothing)."""
        first = hash_tagged(self.root)
        marker = first + "layout:shards"
        stored = await client.get(marker)
        if stored is None:
            # every earlier build's serve set this marker at its first open (index_quarantined);
            # nothing else can tell: a command that opens without migrating may have written
            # the generation of a deployment laid out as chosen below
            earlier = await client.exists(first + "layout:quarantined")
            chosen = [first] if earlier else cluster_tags(self.root, self._shards_asked or DEFAULT_SHARDS)
            if not migrate:
                return chosen
            await client.set(marker, orjson.dumps(chosen), nx=True)
            stored = await client.get(marker)  # another replica's, if it was first
        prefixes = orjson.loads(stored)
        if self._shards_asked is not None and self._shards_asked != len(prefixes):
            raise StoreMisconfigured(
                f"the deployment under prefix {self.root!r} is laid out in {len(prefixes)} shard(s), and a "
                f"deployment's shards never change: remove shards={self._shards_asked} from the URL, "
                "or give it another prefix")
        return prefixes

    def _master(self, client: Any) -> dict[str, Any]:
        """Where a server command goes: on a cluster, to the master of shard 0's slot."""
        return {"target_nodes": client.get_node_from_key(self.anchor)} if self.cluster else {}

    async def _replicas(self, client: Any) -> int:
        return int((await client.info("replication", **self._master(client))).get("connected_slaves", 0))

    async def _persistence(self, client: Any) -> tuple[str | None, str | None]:
        try:
            config = await client.config_get("append*", **self._master(client))
        except ResponseError:  # CONFIG renamed away or refused by an ACL
            return None, None
        config = {text(name): text(value) for name, value in config.items()}
        return config.get("appendonly"), config.get("appendfsync")

    async def ping(self) -> None:
        await self.do(self.client.ping())

    async def secret(self, name: str, generate: bytes) -> bytes:
        key = self.key("secret", name)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(key, generate, nx=True).get(key)
        _, value = await self.do(pipe.execute())
        return value

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._client is not None:
            client, self._client = self._client, None
            if self._kept is not None:
                kept, self._kept = self._kept, None
                await client.connection_pool.release(kept)
            await client.aclose()
        self.waiters.wake_all()

    # -- calls ----------------------------------------------------------------------------

    @property
    def client(self) -> redis_asyncio.Redis:
        if self._client is None:
            raise StoreUnavailable("store is closed")
        return self._client

    async def do(self, awaitable: Awaitable[Any]) -> Any:
        """Await one Redis call; any failure, or no answer within ``timeout``, is StoreUnavailable."""
        with translated("redis", self.timeout):
            async with asyncio.timeout(self.timeout):
                if self._links is None:
                    return await awaitable
                async with self._links:
                    return await awaitable

    def script(self, name: str, keys: list[str], args: list[Any]) -> Awaitable[Any]:
        """A script; one that names no key is routed by :attr:`anchor` (a cluster needs one).
        With ``wait_replicas``, a script that writes answers once WAIT confirms it."""
        if self._client is None:
            raise StoreUnavailable("store is closed")
        keys = keys or [self.anchor]
        if self.wait_replicas and name not in READ_ONLY:
            return self._confirmed_script(name, keys, args)
        return self.do(self._scripts[name](keys=keys, args=args))

    async def _confirmed_script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """The script on one link, then WAIT on it (:meth:`pipeline`)."""
        result, = await self.pipeline([self.evalsha(name, keys, args)], lambda i, result: True)
        if isinstance(result, Exception):
            raise result
        return result

    async def scan(self, start: str) -> AsyncIterator[list[tuple[Shard, str]]]:
        """The deployment's keys whose name after their shard's prefix starts with ``start``,
        a thousand keys' worth of SCAN at a time (it never blocks the server): each as its
        shard and that rest of its name. On a cluster, SCAN goes to every master."""
        if self.layout.sharded:  # one pattern for every shard's tag: {root}, {root#i.j}
            pattern = _glob("{" + self.root) + "*\\}" + _glob(start) + "*"
        else:
            pattern = _glob(self.prefix + start) + "*"
        client = self.client
        nodes = client.get_primaries() if self.cluster else [None]
        for node in nodes:
            cursor = None
            while cursor != 0:
                if node is None:
                    cursor, names = await self.do(client.scan(cursor or 0, match=pattern, count=1000))
                else:
                    cursors, names = await self.do(client.scan(cursor or 0, match=pattern, count=1000,
                                                               target_nodes=node))
                    cursor = next(iter(cursors.values()))  # the cluster client answers {node: cursor}
                found = [owned for name in names if (owned := self.layout.owning(name)) and owned[1].startswith(start)]
                if found:
                    yield found

    def evalsha(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        """The script ``name`` as a command, for :meth:`pipeline`."""
        return ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    async def pipeline(self, commands: list[tuple[Any, ...]],
                       wrote: Callable[[int, Any], bool] | None = None) -> list[Any]:
        """Commands that arrived together, as one pipeline: a result or an error each.
        ``wrote(i, result)``: whether command ``i``'s result is a write ``wait_replicas`` covers.

        Scripts go by their SHA; any the server lost (a restart, SCRIPT FLUSH) are loaded
        again and only their commands re-sent: a NOSCRIPT reply means nothing ran. So does
        a cluster's MOVED or ASK (the slot moved: a failover): the slot map is refreshed and
        those commands re-sent, once.
        """
        results = await self.do(self._send(commands, wrote))
        lost = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if lost:
            for script in self._scripts.values():
                await self.do(self.client.script_load(script.script))
        moved = [i for i, result in enumerate(results) if isinstance(result, AskError)]
        if moved:
            self._stale_map = True
        lost += moved
        if lost:
            def wrote_again(j: int, result: Any) -> bool:
                return wrote is not None and wrote(lost[j], result)
            for i, result in zip(lost, await self.do(self._send([commands[i] for i in lost], wrote_again))):
                results[i] = result
        return [_unavailable("redis", r) if isinstance(r, RedisError) else r for r in results]

    async def _send(self, commands: list[tuple[Any, ...]], wrote: Callable[[int, Any], bool] | None) -> list[Any]:
        """The commands (scripts, by their first key) on one link to each master they go to, at
        once. If one link fails, the whole pipeline fails, as on one Redis: its callers learn
        nothing of the rest, and the store gives back the claims it made (Batches)."""
        if not self.cluster:
            return await self._send_on(None, commands, wrote)
        if self._stale_map:
            await self.client.nodes_manager.initialize()
            self._stale_map = False
        nodes: dict[str, tuple[int, list[int]]] = {}
        try:
            for i, command in enumerate(commands):
                slot = slot_of(text(command[3]))  # EVALSHA sha numkeys key...
                node = self.client.nodes_manager.get_node_from_slot(slot)
                nodes.setdefault(node.name, (slot, []))[1].append(i)
        except RedisClusterException:  # a slot no master serves in the map we have: a failover
            self._stale_map = True
            raise
        if len(nodes) == 1:
            (slot, _), = nodes.values()
            return await self._send_on(slot, commands, wrote)
        groups = list(nodes.values())

        def on_one_node(slot: int, picked: list[int]) -> Awaitable[list[Any]]:
            def wrote_here(j: int, result: Any) -> bool:
                return wrote is not None and wrote(picked[j], result)
            return self._send_on(slot, [commands[i] for i in picked], wrote_here)
        answers = await asyncio.gather(*(on_one_node(slot, picked) for slot, picked in groups),
                                       return_exceptions=True)
        results: list[Any] = [None] * len(commands)
        for (_, picked), answered in zip(groups, answers):
            if isinstance(answered, BaseException):
                raise answered
            for i, answer in zip(picked, answered):
                results[i] = answer
        return results

    async def _send_on(self, slot: int | None, commands: list[tuple[Any, ...]],
                       wrote: Callable[[int, Any], bool] | None) -> list[Any]:
        """Write the commands at once on one link (to the master of ``slot`` on a cluster),
        read every reply, then WAIT if they wrote.

        Packed by hiredis in C: redis-py packs in Python, argument by argument, which was a
        third of a record's store cost (a claim has twenty arguments). Not retried: a
        command whose reply was lost may have run (the pool checks a link before lending it).
        """
        conn, node = await self._borrow(slot)
        intact = False
        try:
            await conn.send_packed_command(b"".join(map(hiredis.pack_command, commands)), check_health=False)
            results = []
            for _ in commands:
                try:
                    # math.inf: no timer per reply; do() bounds the whole pipeline (redis-py's
                    # own per-read timeout would arm and cancel one per reply)
                    results.append(await conn.read_response(timeout=math.inf))
                except ResponseError as exc:  # the server's error reply to this one command
                    results.append(exc)
            if self.wait_replicas and wrote is not None:  # half the timeout: do() bounds the pipeline
                await confirm(conn, results, wrote, self.wait_replicas, max(1, int(self.timeout * 500)))
            intact = True
            return results
        except BaseException:  # broken, timed out or cancelled: replies may still come; drop the link
            await conn.disconnect()
            self._stale_map = self.cluster  # a failover, perhaps: ask for the slot map again
            raise
        finally:
            if node is not None:
                node.release(conn)
            elif (intact and self._kept is None and self._client is not None
                  and self._client.connection_pool.can_get_connection()):
                self._kept = conn  # kept only while the pool has links to spare: else a caller waits on it
            elif self._client is not None:
                await self._client.connection_pool.release(conn)

    async def _borrow(self, slot: int | None) -> tuple[Any, Any]:
        """A link for one pipeline, and the cluster node it is of (None on one Redis)."""
        if slot is not None:
            return await self._borrow_from_master(slot)
        pool = self.client.connection_pool
        # The link of the last pipeline, kept out of the pool (batches go one at a time):
        # the pool's lock and its accounting cost each pipeline as much CPU as the rest of a
        # replay's store call.
        conn, self._kept = self._kept, None
        if conn is None:
            return await pool.get_connection(), None  # checked by the pool
        try:
            await pool.ensure_connection(conn)  # the check the pool gives a link it lends
        except BaseException:
            await pool.release(conn)
            raise
        return conn, None

    async def _borrow_from_master(self, slot: int) -> tuple[Any, Any]:
        """A link to the master of ``slot``. A link that cannot connect has sent nothing, so
        after a failover the slot map is refreshed and the new master tried, once.

        An idle link the server closed meanwhile (its node died, or restarted) is opened
        again first, as the one-Redis pool checks a link it lends: sent on, its commands'
        fate would be unknown, and its callers answered 503 although nothing ran."""
        client = self.client
        for attempt in (1, 2):
            if self._stale_map:
                await client.nodes_manager.initialize()
                self._stale_map = False
            node = client.nodes_manager.get_node_from_slot(slot)
            conn = node.acquire_connection()
            try:
                if conn.is_connected and await _closed(conn):
                    await conn.disconnect()
                if not conn.is_connected:
                    await conn.connect()
                return conn, node
            except (RedisError, OSError):
                node.release(conn)
                self._stale_map = True
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    # -- notifications --------------------------------------------------------------------

    async def _subscribe(self, client: Any):
        """The notification channels' subscription: on a cluster, each shard's sharded channel
        at its master."""
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            channels = [shard.channel for shard in self.layout.shards]
            await (pubsub.ssubscribe if self.cluster else pubsub.subscribe)(*channels)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def _listen(self, pubsub) -> None:
        """Wake local waiters on every change any proxy publishes; resubscribe after an outage."""
        delay = RECONNECT_S[0]
        try:
            while True:
                try:
                    if pubsub is None:
                        if self.cluster:  # the slot may have moved (a failover): ask where it is now
                            await asyncio.wait_for(self.client.nodes_manager.initialize(), self.timeout)
                        pubsub = await asyncio.wait_for(self._subscribe(self.client), self.timeout)
                        log.info("redis notifications resumed")
                        self.waiters.wake_all()  # changes made meanwhile went unheard
                    delay = RECONNECT_S[0]
                    while True:
                        if self.cluster:
                            message = await pubsub.get_sharded_message(
                                timeout=SHARDED_LISTEN_S if self.layout.sharded else LISTEN_S)
                        else:
                            message = await pubsub.get_message(timeout=LISTEN_S)
                        if message is not None and message["type"] in ("message", "smessage"):
                            said = message["data"].decode()
                            if said == RUN_LOST:
                                self.lost.ring()
                            else:
                                self.waiters.wake(said)
                except Exception as exc:  # noqa: BLE001 - the reader must outlive any outage
                    level = logging.WARNING if delay == RECONNECT_S[0] else logging.DEBUG
                    log.log(level, "redis notifications lost (%s); waiters poll meanwhile", exc)
                    if pubsub is not None:
                        with contextlib.suppress(Exception):
                            await pubsub.aclose()
                        pubsub = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_S[1])
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
