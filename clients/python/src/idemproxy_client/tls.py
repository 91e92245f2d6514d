"""One TLS context for the HTTP clients this library makes.

httpx builds a TLS context for every client (it loads the CA bundle: ~50 ms of CPU), even
for a proxy reached over plain ``http://``. An agent restarted after a crash makes three or
four of them before its first call (the runs API, heartbeats, the held connection, its
upstream clients), so it shares one: what each would have built, built once.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx

# A caller who passes any of these chooses the client's TLS (or transport) itself.
OWN_TLS = frozenset({"verify", "cert", "trust_env", "transport"})


@functools.cache
def shared_context() -> ssl.SSLContext:
    """httpx's default context (its CA bundle, SSL_CERT_FILE/SSL_CERT_DIR honoured), once."""
    return httpx.create_ssl_context()


def client_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for an httpx client, with the shared context unless they choose their own."""
    return kwargs if OWN_TLS & kwargs.keys() else {**kwargs, "verify": shared_context()}
