"""Console sessions: a signed cookie, never the admin token itself, and CSRF tokens.

After a login with the admin token, the browser holds ``idemproxy_console`` =
``<payload>.<signature>``: the payload names a random session id and its expiry, the
signature is an HMAC under a key derived from a secret kept in the store (the same on every
replica, surviving restarts) *and* the admin token, so changing the token ends every
session. Sessions are not stored: logging out drops the cookie from the browser, and a
copied cookie stays good until it expires (``SESSION_S``).

The cookie is HttpOnly (no script reads it), ``SameSite=Strict`` (no other site's page
sends it), scoped to ``/ui`` and ``Secure`` whenever the request came over https (directly,
or as ``X-Forwarded-Proto: https`` from a TLS-terminating proxy). Over plain http the
browser is sent it without ``Secure``, since it would not send it back otherwise: anyone
who can read that traffic can take the session, so plain http is for loopback only.

Every form that changes something carries the session's CSRF token (an HMAC of its id);
with SameSite=Strict that makes a forged cross-site POST fail twice. The login form has
its own double-submit token in a short-lived cookie.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from ..problems import Problem

COOKIE = "idemproxy_console"
LOGIN_COOKIE = "idemproxy_console_login"
PATH = "/ui"
SESSION_S = 12 * 3600
LOGIN_FORM_S = 3600


@dataclass(frozen=True, slots=True)
class Session:
    sid: str
    expires: float
    csrf: str  # the token every form of this session carries


class Sessions:
    """Issues and checks session cookies under one key (one store secret, one admin token)."""

    def __init__(self, secret: bytes, token: str):
        self._key = hmac.new(secret, b"idemproxy-console\0" + token.encode(), hashlib.sha256).digest()

    def issue(self, now: float | None = None) -> str:
        expires = int((time.time() if now is None else now) + SESSION_S)
        payload = _b64(orjson.dumps({"sid": os.urandom(16).hex(), "exp": expires}))
        return f"{payload}.{self._sign(payload)}"

    def open(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session the cookie carries, or None if it is missing, forged or expired."""
        payload, _, signature = (cookie or "").partition(".")
        if not payload or not hmac.compare_digest(signature, self._sign(payload)):
            return None
        try:
            facts = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            sid, expires = str(facts["sid"]), float(facts["exp"])
        except (binascii.Error, ValueError, KeyError, TypeError):
            return None
        if expires <= (time.time() if now is None else now):
            return None
        return Session(sid, expires, self._sign("csrf\0" + sid))

    def _sign(self, text: str) -> str:
        return _b64(hmac.new(self._key, text.encode(), hashlib.sha256).digest())


def over_https(request: web.Request) -> bool:
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.scheme == "https" or forwarded == "https"


def set_cookie(response: web.StreamResponse, request: web.Request, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path=PATH, httponly=True, samesite="Strict",
                        secure=over_https(request))


def drop_cookie(response: web.StreamResponse, name: str) -> None:
    response.del_cookie(name, path=PATH)


def check_csrf(expected: str, given: str | None) -> None:
    """Refuse a state-changing request that did not come from our own form."""
    if not given or not hmac.compare_digest(given, expected):
        raise Problem("invalid-csrf", "this form is stale or not the console's; reload the page and try again")


def login_token() -> str:
    return os.urandom(16).hex()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
