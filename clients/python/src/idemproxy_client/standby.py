"""A standby: this process was started ahead by the supervisor and waits to be told its run.

With ``[hooks.NAME] standby = N`` the supervisor keeps N processes of the hook's command
started, imported and idle. Such a process has ``IDEM_STANDBY=1`` and no ``IDEM_RUN_ID`` in
its environment, and its stdin is a private channel to the supervisor. When the hook fires,
the supervisor sends it the ``IDEM_*`` facts a spawned hook finds in its environment;
:func:`wait_for_assignment` puts them into ``os.environ``, and from then on the process is
exactly a hook-started agent. ``Run()`` and ``AsyncRun()`` call it, so an agent on this
library needs nothing more: its imports happen before the restart instead of after it.

Call it yourself only in code that reads ``IDEM_*`` before constructing a run, after the
imports it wants paid ahead.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from typing import Mapping

import httpx

from .tls import shared_context

STANDBY_ENV = "IDEM_STANDBY"
READY = b"ready\n"
CHANNEL_FD = 0  # the supervisor hands the channel in as stdin
_lock = threading.Lock()


class StandbyDismissed(SystemExit):
    """The supervisor let this standby go without a run (it stopped, or died: a standby
    never outlives its supervisor idle): the process has nothing to do and exits with
    code 0, unless caught."""

    def __init__(self) -> None:
        super().__init__(0)


def is_standby(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a standby still waiting for its run."""
    env = os.environ if env is None else env
    return env.get(STANDBY_ENV) == "1" and not env.get("IDEM_RUN_ID")


def wait_for_assignment() -> dict[str, str] | None:
    """If this process is a standby, block until the supervisor names its run, put the
    ``IDEM_*`` facts into ``os.environ`` and return them; otherwise return None at once.

    Raises :class:`StandbyDismissed` (a ``SystemExit(0)``) when the supervisor goes away
    first, and RuntimeError when ``IDEM_STANDBY`` is set but stdin is not a channel from
    a supervisor (the variable was copied by hand).
    """
    with _lock:  # a second thread waits for the first one's assignment, then sees none due
        if not is_standby():
            return None
        try:
            if not stat.S_ISSOCK(os.fstat(CHANNEL_FD).st_mode):
                raise OSError("not a socket")
            _pay_ahead()
            os.write(CHANNEL_FD, READY)
        except (BrokenPipeError, ConnectionResetError):  # the supervisor is gone already
            _stdin_from_devnull()
            raise StandbyDismissed() from None
        except OSError as exc:
            raise RuntimeError(f"{STANDBY_ENV}=1, but stdin is not a supervisor's standby channel "
                               f"({exc}); unset {STANDBY_ENV}") from None
        facts = _facts(_read_line())
        os.environ.update(facts)
        del os.environ[STANDBY_ENV]  # not handed on to what this agent starts
        _stdin_from_devnull()  # as a spawned hook's; the channel is closed
        return facts


def _pay_ahead() -> None:
    """What this library's first run would pay before its first request, paid while idle: the
    shared TLS context (45 ms of CPU, measured) and the modules httpx imports when its first
    client is built (httpcore, h11, anyio...: 120 ms)."""
    httpx.Client(verify=shared_context()).close()


def _read_line() -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(CHANNEL_FD, 65536)
        if not chunk:
            _stdin_from_devnull()
            raise StandbyDismissed()
        line += chunk
    return line


def _facts(line: bytes) -> dict[str, str]:
    facts = json.loads(line)
    if (not isinstance(facts, dict) or not facts.get("IDEM_RUN_ID")
            or not all(k.startswith("IDEM_") and isinstance(v, str) for k, v in facts.items())):
        raise RuntimeError(f"not a standby assignment: {line[:200]!r}")
    return facts


def _stdin_from_devnull() -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(devnull, CHANNEL_FD)
    finally:
        os.close(devnull)
