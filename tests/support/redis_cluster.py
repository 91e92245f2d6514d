"""A real Redis Cluster for tests and benchmarks: 3 masters, 3 replicas, from the installed
``redis-server`` and ``redis-cli``, on free ports in a temporary folder.

    cluster = RedisCluster().start()      # blocks until cluster_state:ok on every node
    cluster.url                           # "redis+cluster://127.0.0.1:p1,127.0.0.1:p2,..."
    port = cluster.master_of(b"{idem:}")  # the master serving that key's slot
    cluster.kill(port)                    # SIGKILL it ...
    new = cluster.wait_promoted(port)     # ... and wait until its replica serves the slots
    cluster.restart(port)                 # back, as the new master's replica
    cluster.move_slot(b"{idem:}", other)  # reshard: that key's slot, and its keys, to another master
    cluster.destroy()                     # stop every node, delete the folder
    shared_url()                          # one cluster per test process, stopped at exit

``appendonly`` and ``appendfsync`` are passed to every node, ``node_timeout_ms`` is the
cluster's ``cluster-node-timeout``: a dead master's replica is promoted about two of them
after the kill. Clusters that no test fails over use ``STEADY_MS``: a busy machine's stalls
then start no failover nobody asked for. Importable from bench scripts (``sys.path`` to tests/support/) as well as tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from services import free_port, reachable

MASTERS, REPLICAS_EACH = 3, 1
STEADY_MS = 5000  # a node timeout for clusters no test fails over


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server)")
    return path


class RedisCluster:
    """Six nodes; see the module docstring."""

    def __init__(self, appendonly: bool = False, appendfsync: str = "everysec", node_timeout_ms: int = 1000):
        self.dir = tempfile.mkdtemp(prefix="idem-redis-cluster-")
        self.ports = [_cluster_port() for _ in range(MASTERS * (1 + REPLICAS_EACH))]
        self.procs: dict[int, subprocess.Popen] = {}  # the live nodes
        self._slots_of: dict[int, list[tuple[int, int]]] = {}  # a killed node's slots when it died
        self._options = ["--appendonly", "yes" if appendonly else "no", "--appendfsync", appendfsync,
                         "--cluster-node-timeout", str(node_timeout_ms), "--save", "",
                         # a replica takes over however long ago it last heard its master
                         "--cluster-replica-validity-factor", "0",
                         "--repl-diskless-sync-delay", "0"]  # replicas sync at once

    @property
    def url(self) -> str:
        """The store URL naming every node as a seed (the store needs one that answers)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout: float = 60.0) -> "RedisCluster":
        for port in self.ports:
            os.mkdir(os.path.join(self.dir, str(port)))
            self._launch(port)
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while not reachable(f"tcp://127.0.0.1:{port}", 0.2):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis node {port} did not start")
                time.sleep(0.05)
        subprocess.run([_binary("redis-cli"), "--cluster", "create",
                        *(f"127.0.0.1:{port}" for port in self.ports),
                        "--cluster-replicas", str(REPLICAS_EACH), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
        self._until(lambda: all(self._ok(port) for port in self.ports), deadline, "cluster_state:ok")
        self._until(self._replicas_synced, deadline, "every replica in sync")
        return self

    def _replicas_synced(self) -> bool:
        replicas = [info for info in (self.cli(port, "info", "replication") for port in self.ports)
                    if "role:slave" in info]
        return len(replicas) == MASTERS * REPLICAS_EACH and all("master_link_status:up" in i for i in replicas)

    def _launch(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(
            [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
             "--dir", os.path.join(self.dir, str(port)), "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", *self._options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again: it rejoins (a dead master, as its successor's replica);
        returns once every replica is in sync."""
        self._launch(port)
        deadline = time.monotonic() + timeout
        self._until(lambda: self._ok(port), deadline, f"node {port} back in the cluster")
        self._until(self._replicas_synced, deadline, "every replica in sync")

    def cli(self, port: int, *args: str) -> str:
        """A redis-cli command's output on one node ("" if the node does not answer)."""
        done = subprocess.run([_binary("redis-cli"), "-p", str(port), *args], capture_output=True, text=True,
                              timeout=10)
        return done.stdout if done.returncode == 0 else ""

    def _ok(self, port: int) -> bool:
        return "cluster_state:ok" in self.cli(port, "cluster", "info")

    @staticmethod
    def _until(predicate, deadline: float, what: str) -> None:
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: not {what} in time")
            time.sleep(0.1)

    def _nodes(self) -> list[tuple[int, str, list[tuple[int, int]]]]:
        """(port, flags, slot ranges) of every node, as a live node sees them (CLUSTER NODES)."""
        alive = [port for port in self.ports if port in self.procs]
        nodes = []
        for line in self.cli(alive[0], "cluster", "nodes").splitlines():
            fields = line.split()
            ranges = []
            for span in fields[8:]:
                if not span.startswith("["):  # "[slot->-id]": a slot being migrated
                    low, _, high = span.partition("-")
                    ranges.append((int(low), int(high or low)))
            nodes.append((int(fields[1].split(":")[1].split("@")[0]), fields[2], ranges))
        return nodes

    def master_of(self, key: bytes | str) -> int:
        """The port of the master now serving ``key``'s slot (as a live node sees it)."""
        key = key.decode() if isinstance(key, bytes) else key
        alive = [port for port in self.ports if port in self.procs]
        slot = int(self.cli(alive[0], "cluster", "keyslot", key))
        for port, flags, ranges in self._nodes():
            if "master" in flags and "fail" not in flags and any(lo <= slot <= hi for lo, hi in ranges):
                return port
        raise RuntimeError(f"no master serves slot {slot}")

    def masters(self) -> list[int]:
        """The ports of the live masters that serve slots, in order."""
        return sorted(port for port, flags, ranges in self._nodes()
                      if port in self.procs and "master" in flags and "fail" not in flags and ranges)

    def _node_id(self, port: int) -> str:
        return self.cli(port, "cluster", "myid").strip()

    def move_slot(self, key: bytes | str, to: int) -> None:
        """Move ``key``'s slot, with its keys, from its master to the master on port ``to``, as
        ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING, MIGRATE, then SETSLOT NODE."""
        key = key.decode() if isinstance(key, bytes) else key
        source = self.master_of(key)
        slot = self.cli(source, "cluster", "keyslot", key).strip()
        source_id, target_id = self._node_id(source), self._node_id(to)
        self.cli(to, "cluster", "setslot", slot, "importing", source_id)
        self.cli(source, "cluster", "setslot", slot, "migrating", target_id)
        while keys := self.cli(source, "cluster", "getkeysinslot", slot, "100").split():
            self.cli(source, "migrate", "127.0.0.1", str(to), "", "0", "5000", "keys", *keys)
        for port in self.procs:
            if "master" in self.cli(port, "role").split("\n", 1)[0]:
                self.cli(port, "cluster", "setslot", slot, "node", target_id)

    def kill(self, port: int) -> None:
        """SIGKILL one node: no shutdown, no last write to its files."""
        self._slots_of[port] = next((ranges for p, _, ranges in self._nodes() if p == port), [])
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def wait_promoted(self, dead: int, timeout: float = 30.0) -> int:
        """Wait until the slots of the killed master ``dead`` are served by a live master (its
        promoted replica) and every live node says cluster_state:ok; returns that master's port."""
        deadline = time.monotonic() + timeout
        lost = self._slots_of.get(dead)
        if not lost:
            raise ValueError(f"{dead} was not a master killed by kill()")
        promoted: list[int] = []

        def done() -> bool:
            promoted[:] = [port for port, flags, ranges in self._nodes()
                           if port in self.procs and "master" in flags and lost[0] in ranges]
            return bool(promoted) and all(self._ok(port) for port in self.procs)

        self._until(done, deadline, f"the replica of {dead} promoted")
        return promoted[0]

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_shared: list[RedisCluster] = []


def shared_url() -> str:
    """The URL of a cluster shared by a whole test process (``IDEMPROXY_TEST_BACKENDS=redis-cluster``
    runs every store test on it), started at the first call and destroyed at exit."""
    if not _shared:
        _shared.append(RedisCluster(node_timeout_ms=STEADY_MS).start())
        atexit.register(_shared[0].destroy)
    return _shared[0].url
