"""Stores by URL scheme. Backends import lazily: asyncpg and redis are optional extras.

Each backend is a package (``sqlite/``, ``postgres/``, ``redis/``) of the same shape: a
``connection`` module shared by its ``journal`` and its ``runs``, composed by the store
class in its ``__init__``.
"""

from __future__ import annotations

from importlib import import_module
from urllib.parse import unquote, urlsplit

from ..config import StoreSettings
from .base import Store, StoreError, StoreUnavailable

__all__ = ["Store", "StoreError", "StoreUnavailable", "make_store"]

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
        raise ValueError(f"unsupported store URL scheme {scheme!r} (use sqlite, postgresql or redis)")
    package, class_name, extra = BACKENDS[scheme]
    try:
        module = import_module(f"{__name__}.{package}")
    except ImportError as exc:
        raise ValueError(f"the {scheme} store needs: pip install 'idemproxy[{extra}]' ({exc})") from exc
    cls = getattr(module, class_name)
    if scheme == "sqlite":
        # sqlite:///relative.db and sqlite:////absolute/path.db, as SQLAlchemy spells them
        path = unquote(settings.url[len("sqlite:///"):]) if settings.url.startswith("sqlite:///") else ""
        if not path:
            raise ValueError("sqlite URL must look like sqlite:///path/to/file.db")
        return cls(path, timeout=settings.timeout)
    return cls(settings.url, timeout=settings.timeout)
