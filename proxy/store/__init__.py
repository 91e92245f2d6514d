"""Stores by URL scheme. Backends import lazily: asyncpg and redis are optional extras.

Each backend is a package (``sqlite/``, ``postgres/``, ``redis/``) of the same shape: a
``connection`` module shared by its ``journal``, its ``runs`` and its ``audit``, which its
``__init__`` composes into the one :class:`~.composed.Store`.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import import_module
from typing import Awaitable, Callable, TypeVar
from urllib.parse import unquote, urlsplit

from ..config import ConfigError, Settings, StoreSettings
from .composed import Store
from .errors import SchemaNotCurrent, StoreError, StoreMisconfigured, StoreUnavailable

__all__ = ["SchemaNotCurrent", "Store", "StoreError", "StoreMisconfigured", "StoreUnavailable", "make_store",
           "open_store", "retried"]

log = logging.getLogger("idemproxy.store")
T = TypeVar("T")

OPEN_ATTEMPTS = 8
# scheme -> (package, the function that composes its store, extra that installs its driver)
BACKENDS = {
    "sqlite": ("sqlite", "sqlite_store", None),
    "postgresql": ("postgres", "postgres_store", "postgres"),
    "postgres": ("postgres", "postgres_store", "postgres"),
    "redis": ("redis", "redis_store", "redis"),
    "rediss": ("redis", "redis_store", "redis"),
    "redis+cluster": ("redis", "redis_store", "redis"),
    "rediss+cluster": ("redis", "redis_store", "redis"),
}


def make_store(settings: StoreSettings) -> Store:
    """The store for ``settings.url``; not yet opened."""
    scheme = urlsplit(settings.url).scheme
    if scheme not in BACKENDS:
        raise ConfigError(f"unsupported store URL scheme {scheme!r} (use sqlite, postgresql or redis)")
    package, factory_name, extra = BACKENDS[scheme]
    try:
        module = import_module(f"{__name__}.{package}")
    except ImportError as exc:
        raise ConfigError(f"the {scheme} store needs: pip install 'idemproxy[{extra}]' ({exc})") from exc
    compose = getattr(module, factory_name)
    if scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them
        path = sqlite_path(settings.url)
        if not path:
            raise ConfigError("sqlite URL must look like sqlite:///path/to/file.db")
        return compose(path, timeout=settings.timeout)
    options = {"wait_replicas": settings.redis_wait_replicas} if package == "redis" else {}
    if package == "postgres":  # its journal's partitions (postgres/partitions.py)
        options = {"partition_interval": settings.partition_interval, "retention": settings.retention}
    try:
        return compose(settings.url, timeout=settings.timeout, **options)
    except ValueError as exc:  # our own URL parameters (postgres ?schema=, ?pool_size=; cluster seeds)
        raise ConfigError(f"store.url: {exc}") from None


def sqlite_path(url: str) -> str:
    """sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them"""
    return unquote(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else ""


async def open_store(settings: Settings, *, attempts: int = OPEN_ATTEMPTS, migrate: bool = True) -> Store:
    """Open the configured store, retrying with backoff while it is not reachable yet; a
    permanent refusal (StoreMisconfigured) ends it at once.

    ``migrate=False`` (``check``, and commands that act on what exists) writes nothing: a
    store without our schema, or with an older one, raises SchemaNotCurrent."""
    store = make_store(settings.store)
    await retried(lambda: store.open(migrate=migrate), "store not reachable", attempts)
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
