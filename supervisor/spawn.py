"""Starting a hook's command detached: the one way both spawned hooks and standbys start.

Its own session (a supervisor that stops or dies takes no agent with it), stdout and stderr
appended to a log file, stdin from /dev/null unless a descriptor is handed in (a standby's
assignment channel). posix_spawn rather than subprocess.Popen: the child is not ours to
kill or wait for when we stop, and Popen objects complain when dropped while running.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Mapping, Sequence


class SpawnError(Exception):
    """The command could not be started; the message says why, for the run's history."""


def spawn_detached(argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                   stdin: int | None = None) -> int:
    """Start ``argv`` in a session of its own, output appended to ``log_path``: its pid."""
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise SpawnError(f"cannot open log file {log_path}: {exc}") from None
    # A descriptor below 3 would be dup2'ed onto itself, which leaves its close-on-exec flag
    # set (the child would lose it): only possible when our own stdio is closed.
    stdin = None if stdin is None else fcntl.fcntl(stdin, fcntl.F_DUPFD_CLOEXEC, 3)
    try:
        first = ((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0) if stdin is None
                 else (os.POSIX_SPAWN_DUP2, stdin, 0))
        return os.posix_spawnp(argv[0], list(argv), dict(env),
                               file_actions=[first, (os.POSIX_SPAWN_DUP2, fd, 1),
                                             (os.POSIX_SPAWN_DUP2, fd, 2)],
                               setsid=True)
    except (OSError, ValueError) as exc:  # ValueError: an `env` name the OS refuses
        raise SpawnError(f"cannot start {argv[0]!r}: {exc}") from None
    finally:
        os.close(fd)
        if stdin is not None:
            os.close(stdin)
