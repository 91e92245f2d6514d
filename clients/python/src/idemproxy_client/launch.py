"""What the supervisor hands a process it restarts, read from the environment.

The supervisor's ``command`` hook starts the agent with ``IDEM_RUN_ID``,
``IDEM_EPOCH``, ``IDEM_ATTEMPT``, ``IDEM_PROXY_URL``, ``IDEM_RUN_BASE`` and
``IDEM_NAMESPACE``. A process started with them continues that run at that epoch: the
supervisor has already started the new attempt and fenced the old one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

DEFAULT_PROXY_URL = "http://127.0.0.1:8787"
DEFAULT_NAMESPACE = "default"


def tenant_of(namespace: str | None) -> str | None:
    """The ``Idem-Tenant`` to send for a run's namespace: only a trusted tenant's name. The
    shared ``default`` namespace and a credential's (``anonymous``, ``k:…``) come from the
    request itself (its credential), so naming them is neither needed nor accepted."""
    if not namespace or namespace in (DEFAULT_NAMESPACE, "anonymous") or namespace.startswith(("k:", "r:")):
        return None
    return namespace


@dataclass(frozen=True)
class Launch:
    """The ``IDEM_*`` facts of this process; every field is None when not set."""

    run_id: str | None = None
    epoch: int | None = None
    attempt: int | None = None
    proxy_url: str | None = None
    namespace: str | None = None
    token: str | None = None  # IDEM_RUN_TOKEN: the run's capability, from the supervisor

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Launch:
        """Read ``IDEM_*`` variables (``os.environ`` by default); raise ValueError if malformed."""
        env = os.environ if env is None else env
        return cls(
            run_id=env.get("IDEM_RUN_ID") or None,
            epoch=_integer(env, "IDEM_EPOCH"),
            attempt=_integer(env, "IDEM_ATTEMPT"),
            proxy_url=(env.get("IDEM_PROXY_URL") or "").rstrip("/") or None,
            namespace=env.get("IDEM_NAMESPACE") or None,
            token=env.get("IDEM_RUN_TOKEN") or None,
        )


def _integer(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return value
