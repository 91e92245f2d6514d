"""The store's errors. A driver's errors are translated inside each backend, the way httpx
maps its transport's exceptions at one edge::

    StoreError
    ├── StoreUnavailable    the store cannot be reached or did not answer in time: retried
    ├── StoreMisconfigured  the store answered that it never will serve this URL as it is
    │                       (no such database or folder, a database index out of range,
    │                       credentials refused): not retried, start-up fails at once
    ├── SchemaNotCurrent    opened without migrating, the store has no schema or an older
    │                       one: ``idemproxy migrate`` (or ``serve``) brings it up to date
    └── (programming errors are not translated)
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """The store cannot be reached, or did not answer within its timeout."""


class StoreMisconfigured(StoreError):
    """The store answered, and will never serve this URL as it is: retrying cannot help."""


class SchemaNotCurrent(StoreError):
    """Opened with ``migrate=False``, the store has no schema yet, or an older one."""
