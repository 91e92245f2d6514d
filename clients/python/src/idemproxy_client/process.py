"""This process, named for a proxy on the same host: ``Idem-Process`` on a held connection.

A proxy that runs on this host, in this PID namespace, looks at the process when its held
connection drops, and restarts the run the moment it has exited instead of waiting out
its grace (a blip cannot kill a process). Elsewhere the proxy ignores it. Linux only.
"""

from __future__ import annotations

import functools
import os


@functools.cache  # once per process: a forked child clears it (below), for its own pid
def process_token() -> str | None:
    """``<boot id> <pid namespace inode> <pid> <start time in clock ticks>``; None off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    start = stat[stat.rindex(b")") + 2:].split()[19].decode()  # after "pid (comm) ", field 22
    return f"{boot} {namespace} {os.getpid()} {start}"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=process_token.cache_clear)
