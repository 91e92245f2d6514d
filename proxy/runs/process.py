"""The process behind a held connection, when it runs on this host: its death is seen, not guessed.

The grace after a drop (``[runs] attach_grace_s``) exists because a closed socket may be a
network blip. When the agent's process shares this proxy's host and PID namespace, there is
nothing to guess: the client library names its process in ``Idem-Process`` (Linux)::

    Idem-Process: <boot id> <pid namespace inode> <pid> <start time in clock ticks>

When the connection drops, the proxy opens a pidfd for that pid (it becomes readable the
moment the process exits; no polling) and checks the start time, so a pid taken by another
process since counts as the named one gone. An exit within the grace ends the grace at
once: a blip cannot kill a process. A process that lives (its link was cut by something in
between: a load balancer, a relay) waits out the grace as before.

The header is ignored, and the grace is all there is, for a process elsewhere (another
host: its boot id differs; a container of its own: its PID namespace differs), and for one
this proxy cannot see as named when the connection is made (``/proc`` hidden from it, a
pid not running, another start time): what cannot be looked at is never taken for dead.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
from dataclasses import dataclass

from ..problems import Problem

HEADER = "Idem-Process"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
TOKEN = re.compile(r"([0-9A-Za-z-]{1,64}) ([0-9]{1,20}) ([0-9]{1,10}) ([0-9]{1,20})")


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
        """The process ``Idem-Process`` names, if it runs on this host, in this PID namespace,
        and this proxy sees it there now; else None. A malformed header is refused."""
        if value is None:
            return None
        parsed = TOKEN.fullmatch(value)
        if parsed is None or int(parsed[3]) == 0:
            raise Problem("invalid-header", f"{HEADER} is '<boot id> <pid namespace> <pid> <start ticks>', "
                          "numbers in decimal, the pid not 0 (the client library sends it)")
        boot, namespace, pid, start = parsed.groups()
        if (boot, int(namespace)) != this_host():
            return None
        named = cls(int(pid), int(start))
        return named if start_ticks(named.pid) == named.start else None

    async def exits_within(self, seconds: float) -> bool:
        """Whether the process exits (or has exited) within ``seconds``. False also when it
        cannot be watched (no pidfd here, /proc unreadable): only a seen exit counts."""
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # exited and reaped
            return True
        except (AttributeError, OSError):  # too old a kernel, or a sandbox refusing pidfds
            await asyncio.sleep(seconds)
            return False
        try:
            started = start_ticks(self.pid)  # read after the pidfd: it is of this pid's process
            if started is not None and started != self.start:
                return True  # the named process is gone; another one has its pid
            return await pidfd_exit(fd, seconds)
        finally:
            os.close(fd)


async def pidfd_exit(fd: int, timeout: float | None = None) -> bool:
    """Wait for the process of pidfd ``fd`` to exit (the kernel makes the pidfd readable
    then): True once it has, False after ``timeout`` seconds. The caller closes ``fd``."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(True))
    try:
        return await asyncio.wait_for(exited, timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def start_ticks(pid: int) -> int | None:
    """When ``pid``'s process started (field 22 of /proc/<pid>/stat), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) state ... starttime ...": comm may hold spaces and parentheses
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None
