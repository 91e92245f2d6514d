"""Who did an operator action, and the trace it leaves (docs/operations.md).

Every operator action — register (which options, never their values), resolve (retry,
or respond with a status and a body digest), revive, restart, complete, journal delete — is
kept as an :class:`~..store.model.Action` with who and when, for the journal's retention
(``[store] retention``): on the entry it
decided and on its run, shown by ``idemproxy journal show`` and ``runs show``, the admin
API (``actions``) and the console. Who is never a credential:

- the admin API: ``admin:`` and the token's ``[admin] operator`` name, or
  ``admin:token:`` and the first 8 hex digits of its SHA-256;
- the console: the same, and ``via console session`` and the start of the session's id;
- the CLI, which talks to the store itself: ``cli:`` and the user and host it ran as.
"""

from __future__ import annotations

import getpass
import hashlib
import socket

from ..config import AdminSettings


def token_operator(admin: AdminSettings) -> str:
    """Who the admin token acts as: its configured name, or a fingerprint of it."""
    if admin.operator:
        return f"admin:{admin.operator}"
    return "admin:token:" + hashlib.sha256(str(admin.token or "").encode()).hexdigest()[:8]


def console_operator(admin: AdminSettings, session_id: str) -> str:
    """A console session (opened with the admin token): who the token is, and which session."""
    return f"{token_operator(admin)} via console session {session_id[:8]}"


def cli_operator() -> str:
    """The CLI's user, where it ran."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def body_digest(body: bytes) -> str:
    """What the audit keeps of an answer an operator gave: its SHA-256, never the body."""
    return "sha256:" + hashlib.sha256(body).hexdigest()
