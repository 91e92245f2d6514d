"""The process behind a held connection, when it runs on this host: its death is seen, not guessed.

The grace after a drop (``[runs] attach_grace_s``) exists because a closed socket may be a
network blip. When the agent's process shares this proxy's host and PID namespace, there is
nothing to guess: the client library names its process in ``Idem-Process`` (Linux)::

    Idem-Process: <boot id> <pid namespace inode> <pid> <start time in clock ticks>

and the proxy looks at ``/proc/<pid>/stat`` while the grace runs. A process gone, a zombie,
or another process under that pid (its start time differs) ends the grace at once: a blip
cannot kill a process, so the attempt is lost now. A process that lives (its link was cut
by something in between: a load balancer, a relay) waits out the grace as before.

Another host (its boot id differs) or another PID namespace (a container of its own) sees
other pids: the header is then ignored, and the grace is all there is.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..problems import Problem

HEADER = "Idem-Process"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
GONE_STATES = frozenset("ZXx")  # zombie (exited, not yet reaped), dead


@functools.cache
def this_host() -> tuple[str, int] | None:
    """(boot id, PID namespace inode) of this proxy's process; None off Linux."""
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class LocalProcess:
    """An attached agent's process on this host, as its client named it."""
    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat): tells a reused pid apart

    @classmethod
    def from_header(cls, value: str | None) -> LocalProcess | None:
        """The process ``Idem-Process`` names if it is on this host and in this PID namespace;
        None without the header or for a process elsewhere. A malformed header is refused."""
        if value is None:
            return None
        try:
            boot, namespace, pid, start = value.split()
            named = cls(int(pid), int(start))
            host = (boot, int(namespace))
        except ValueError:
            raise Problem("invalid-header", f"{HEADER} is '<boot id> <pid namespace> <pid> <start "
                          "ticks>' (the client library sends it)") from None
        if named.pid <= 0 or named.start < 0:
            raise Problem("invalid-header", f"{HEADER}: pid and start time must be positive")
        return named if host == this_host() else None

    def gone(self) -> bool:
        """Whether the process has exited (or its pid belongs to another process now)."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # no such pid: exited and reaped
            return True
        # "pid (comm) state ... starttime ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(b")") + 2:].split()
        return fields[0].decode() in GONE_STATES or int(fields[19]) != self.start
