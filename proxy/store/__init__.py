"""Stores by URL scheme. Backends import lazily: asyncpg and redis are optional extras.

Each backend is a package (``sqlite/``, ``postgres/``, ``redis/``) of the same shape: a
``connection`` module shared by its ``journal`` and its ``runs``, composed by the store
class in its ``__init__``.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import import_module
from typing import Awaitable, Callable, TypeVar
from urllib.parse import unquote, urlsplit

from pathlib import Path

from ..config import ConfigError, Settings, StoreSettings
from .base import Store, StoreError, StoreUnavailable

__all__ = ["Store", "StoreError", "StoreUnavailable", "make_store", "open_store", "retried"]

log = logging.getLogger("idemproxy.store")
T = TypeVar("T")

OPEN_ATTEMPTS = 8
# scheme -> (package, class, extra that installs its driver)
BACKENDS = {
    "sqlite": ("sqlite", "SQLiteStore", None),
    "postgresql": ("postgres", "PostgresStore", "postgres"),
    "postgres": ("postgres", "PostgresStore", "postgres"),
    "redis": ("redis", "RedisStore", "redis"),
    "rediss": ("redis", "RedisStore", "redis"),
}


def make_store(settings: StoreSettings) -> Store:
    """The store for ``settings.url``; not yet opened."""
    scheme = urlsplit(settings.url).scheme
    if scheme not in BACKENDS:
        raise ConfigError(f"unsupported store URL scheme {scheme!r} (use sqlite, postgresql or redis)")
    package, class_name, extra = BACKENDS[scheme]
    try:
        module = import_module(f"{__name__}.{package}")
    except ImportError as exc:
        raise ConfigError(f"the {scheme} store needs: pip install 'idemproxy[{extra}]' ({exc})") from exc
    cls = getattr(module, class_name)
    if scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them
        path = sqlite_path(settings.url)
        if not path:
            raise ConfigError("sqlite URL must look like sqlite:///path/to/file.db")
        return cls(path, timeout=settings.timeout)
    return cls(settings.url, timeout=settings.timeout)


def sqlite_path(url: str) -> str:
    """sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them"""
    return unquote(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else ""


async def open_store(settings: Settings, *, attempts: int = OPEN_ATTEMPTS, create: bool = True) -> Store:
    """Open the configured store, retrying with backoff while it is not reachable yet.

    ``create=False`` (commands that only read, or act on what exists) refuses a SQLite
    journal that is not there instead of creating an empty one."""
    store = make_store(settings.store)
    path = sqlite_path(settings.store.url)
    if not create and path and not Path(path).exists():
        raise StoreUnavailable(f"no journal at {path} (the proxy creates it when it first starts)")
    await retried(store.open, "store not reachable", attempts)
    log.info("store %r open; durability: %s", store, store.durability)
    return store


async def retried(op: Callable[[], Awaitable[T]], what: str, attempts: int = OPEN_ATTEMPTS) -> T:
    """``op()``, tried ``attempts`` times with backoff while the store is unavailable: for
    the steps of starting up, which a store that drops meanwhile must not end."""
    for attempt in range(1, attempts + 1):
        try:
            return await op()
        except StoreUnavailable as exc:
            if attempt == attempts:
                raise
            delay = min(0.25 * 2 ** attempt, 10.0)
            log.warning("%s (attempt %d/%d, next in %.1fs): %s", what, attempt, attempts, delay, exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
