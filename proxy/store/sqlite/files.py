"""The SQLite store's file before any connection is made: created private, its errors of
opening told apart (retried, or refused for good), its schema checked without a write.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import stat
from typing import Iterator
from urllib.parse import quote

from ..errors import SchemaNotCurrent, StoreMisconfigured, StoreUnavailable
from .schema import SCHEMA_VERSION

log = logging.getLogger("idemproxy.store")

# Why a file cannot be opened, for good: a folder that is not there, not ours, read-only
PERMANENT_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                    errno.ENAMETOOLONG, errno.ELOOP}


@contextlib.contextmanager
def opening(path: str) -> Iterator[None]:
    """Errors of opening ``path``: a lock another process holds is StoreUnavailable (retried);
    a missing folder, a denied permission, a file that is not a database, StoreMisconfigured."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise StoreUnavailable(f"cannot open {path}: {exc}") from exc
        raise StoreMisconfigured(f"cannot open {path}: {exc}") from exc
    except sqlite3.Error as exc:  # DatabaseError: "file is not a database"
        raise StoreMisconfigured(f"cannot open {path}: {exc}") from exc
    except OSError as exc:
        kind = StoreMisconfigured if exc.errno in PERMANENT_ERRNOS else StoreUnavailable
        raise kind(f"cannot open {path}: {exc.strerror or exc}") from exc


def make_private(path: str) -> None:
    """Create the database file 0600 before SQLite opens it: it holds every tenant's bodies
    and the tenant HMAC key. SQLite would create it 0644 (less the umask); its -wal and
    -shm files take the database file's mode when SQLite creates them, so they are 0600 too.

    A file that already exists keeps its owner and group bits but loses any for others,
    as do its -wal and -shm: a group (a backup job's, say) may be meant to read it; the
    world never is.
    """
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        pass
    for name in (path, path + "-wal", path + "-shm"):
        _close_to_others(name)


def _close_to_others(name: str) -> None:
    try:
        st = os.stat(name)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISREG(st.st_mode) and mode & 0o007:
            os.chmod(name, mode & ~0o007)
            log.warning("%s was open to every user (mode %o); now %o", name, mode, mode & ~0o007)
    except FileNotFoundError:
        pass
    except OSError as exc:  # not ours to change: say so, and go on
        log.warning("cannot take the permissions of others from %s: %s", name, exc)


def check_schema(path: str, timeout: float) -> None:
    """Without a write (not even the WAL switch a connection makes): the file is there, at
    our schema version."""
    if not os.path.exists(path):
        raise SchemaNotCurrent(f"no journal at {path} yet")
    conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=timeout)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()
    if version < SCHEMA_VERSION:
        raise SchemaNotCurrent(f"{path} is at schema version {version}, this idemproxy needs "
                               f"{SCHEMA_VERSION}" if version else f"{path} has no idemproxy tables")
