"""Who a request is: its idempotency key, run, epoch, policy override and tenant.

Header syntax follows draft-ietf-httpapi-idempotency-key-header: the key is a
Structured Field String (RFC 8941 §3.3.3); we also accept a bare token, as most
clients send one.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multidict import CIMultiDictProxy

from .config import RUNS_SHARED, Settings, shares_anonymous
from .policy import Policy
from .problems import Problem

if TYPE_CHECKING:
    from .store import Store

MAX_KEY_LENGTH = 255
RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
EPOCH = re.compile(r"[0-9]{1,15}")  # exact in every store, Redis's Lua doubles included
TENANT_NAME = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
BARE_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII; a comma means a list, refused below
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="idemproxy"'}  # a 401 names a scheme (RFC 9110 §15.5.2)


@dataclass(frozen=True, slots=True)
class Identity:
    key: str | None
    run: str | None
    epoch: int | None
    policy: Policy | None
    namespace: str  # whose runs these are (TenantResolver.namespace; "" for a passthrough
                    # outside a run, which has none); the tenant, whose journal entries,
                    # is worked out only for recorded calls


def parse_key(values: list[str]) -> str | None:
    """The key from all ``Idempotency-Key`` field lines, or None. Raises ``invalid-key``."""
    if not values:
        return None
    if len(values) > 1:
        raise Problem("invalid-key", "Idempotency-Key must have exactly one value")
    raw = values[0].strip(" \t")
    key = _parse_sf_string(raw) if raw.startswith('"') else _parse_bare(raw)
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise Problem("invalid-key", f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} characters")
    return key


def _parse_bare(raw: str) -> str:
    if "," in raw:
        raise Problem("invalid-key", "Idempotency-Key must have exactly one value")
    if not BARE_KEY.fullmatch(raw):
        raise Problem("invalid-key", "Idempotency-Key must be printable ASCII")
    return raw


def _parse_sf_string(raw: str) -> str:
    out = []
    i, end = 1, len(raw)
    while i < end:
        ch = raw[i]
        if ch == "\\":
            if i + 1 >= end or raw[i + 1] not in '"\\':
                raise Problem("invalid-key", "Idempotency-Key: bad escape in string")
            out.append(raw[i + 1])
            i += 2
            continue
        if ch == '"':
            if i != end - 1:
                raise Problem("invalid-key", "Idempotency-Key must have exactly one value")
            return "".join(out)
        if not " " <= ch <= "~":
            raise Problem("invalid-key", "Idempotency-Key must be printable ASCII")
        out.append(ch)
        i += 1
    raise Problem("invalid-key", "Idempotency-Key: unterminated string")


def parse_run(value: str | None) -> str | None:
    if value is None:
        return None
    if not RUN_ID.fullmatch(value):
        raise Problem("invalid-header", "Idem-Run must be 1-128 characters of [A-Za-z0-9._:-]")
    return value


def parse_epoch(value: str | None) -> int | None:
    if value is None:
        return None
    if not EPOCH.fullmatch(value.strip()):
        raise Problem("invalid-header", "Idem-Epoch must be a non-negative integer")
    return int(value)


def parse_policy(value: str | None) -> Policy | None:
    if value is None:
        return None
    try:
        return Policy(value.strip().lower())
    except ValueError:
        raise Problem("invalid-header", "Idem-Policy must be 'record' or 'passthrough'") from None


DEFAULT_NAMESPACE = "default"  # the one namespace of [tenants] runs = "shared"
ANONYMOUS = "anonymous"  # the tenant, and the namespace, of callers that carry no credential
CREDENTIAL_PREFIX = "k:"  # tenants (and namespaces) that are the HMAC of a credential
# The namespace of a run registered by a caller with no credential: its own, reachable only
# with the run's token, so that callers without a credential never share runs.
PRIVATE_PREFIX = "r:"
RUN_TOKEN_HEADER = "Idem-Run-Token"
RUN_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,400}\.[0-9a-f]{32}")


async def tenant_secret(settings: Settings, store: "Store") -> bytes:
    """The key of tenants' HMACs and of run tokens: configured, else generated once and kept in
    the store, so tenant ids and tokens survive restarts and are the same on every replica."""
    if settings.tenants.secret:
        return str(settings.tenants.secret).encode()
    return await store.secret("tenant-hmac", os.urandom(32))


def private_namespace() -> str:
    """A new namespace for one run registered without a credential."""
    return PRIVATE_PREFIX + secrets.token_hex(12)


class TenantResolver:
    """Tenant = HMAC(secret, credential), or a trusted header from a trusted source.

    Hashing the credential means two API keys never share journal entries, and that
    the store never holds the credential itself. The credential is the values of
    ``credential_headers`` and of the cookies in ``credential_cookies``. A caller with
    none would share the tenant ``anonymous`` with every other such caller, so it may
    record only through upstreams that allow that (``anonymous = "shared"``).

    Runs live in a *namespace* (docs/security.md): the trusted tenant header where one is given;
    else the caller's credential's tenant, so another credential never reaches them; or,
    where ``[tenants] runs = "shared"`` says so, ``default`` for every caller.
    """

    def __init__(self, secret: bytes, credential_headers: tuple[str, ...], header: str,
                 trusted_sources: tuple[str, ...], *, shared_runs: bool = False,
                 credential_cookies: tuple[str, ...] = (), shared_anonymous: frozenset[str] = frozenset()):
        # keyed once; each credential hashes on a copy (see of_credential)
        self._keyed = hmac.new(secret, digestmod="sha256")
        self._credential_headers = credential_headers
        self._credential_cookies = frozenset(credential_cookies)
        self._shared_anonymous = shared_anonymous  # names of upstreams anonymous callers may record through
        self._header = header
        self._trusted = tuple(ipaddress.ip_network(s, strict=False) for s in trusted_sources)
        self._shared_runs = shared_runs

    @classmethod
    def from_settings(cls, secret: bytes, settings: Settings) -> TenantResolver:
        t = settings.tenants
        return cls(secret, t.credential_headers, t.header, t.trusted_sources,
                   shared_runs=t.runs == RUNS_SHARED, credential_cookies=t.credential_cookies,
                   shared_anonymous=frozenset(name for name, up in settings.upstreams.items()
                                              if shares_anonymous(up, t)))

    def tenant(self, headers: CIMultiDictProxy[str], namespace: str) -> str:
        """Whose journal entries a request's are, from its namespace (what :meth:`namespace`
        answered for the same request): a credential's (``k:``) or a private run's (``r:``)
        namespace is its own tenant, as is ``anonymous``; with shared runs, the credential's
        tenant; a trusted tenant's name, ``t:`` and that name."""
        if namespace.startswith((CREDENTIAL_PREFIX, PRIVATE_PREFIX)) or namespace == ANONYMOUS:
            return namespace
        if not namespace or (self._shared_runs and namespace == DEFAULT_NAMESPACE):
            return self.of_credential(headers)
        return "t:" + namespace

    def namespace(self, headers: CIMultiDictProxy[str], peer: str | None, *, derive: bool = True,
                  run: str | None = None, token: str | None = None) -> str:
        """The run namespace: a run token's, for its run (``token``, else the
        ``Idem-Run-Token`` header); the trusted tenant header; else the credential's tenant
        (or ``default`` with shared runs). ``derive=False`` checks a tenant header all the
        same but answers "" where the namespace would be the credential's HMAC: a passthrough
        outside a run never uses it, and its HMAC would be most of a passthrough's own work."""
        token = token or headers.get(RUN_TOKEN_HEADER)
        if token is not None:
            return self.token_namespace(token, run)
        named = headers.get(self._header)
        if named is None:
            if self._shared_runs:
                return DEFAULT_NAMESPACE
            return self.of_credential(headers) if derive else ""
        if not self._is_trusted(peer):
            raise Problem("untrusted-tenant", f"{self._header} is accepted only from trusted sources")
        if not TENANT_NAME.fullmatch(named):
            raise Problem("invalid-header", f"{self._header} must be 1-128 of [A-Za-z0-9._:@/-]")
        if named in (ANONYMOUS, DEFAULT_NAMESPACE) or named.startswith(CREDENTIAL_PREFIX):
            # "default" is the namespace every caller shares under runs = "shared": a trusted
            # tenant of that name would share its runs with every untrusted caller
            raise Problem("invalid-header", f"{self._header}: {ANONYMOUS!r}, {DEFAULT_NAMESPACE!r} and names "
                          f"that start with {CREDENTIAL_PREFIX!r} are reserved namespaces, not tenant names")
        return named

    def run_token(self, namespace: str, run: str) -> str:
        """The capability of run ``run`` of ``namespace``: whoever holds it is that run's, whatever
        credential its calls carry (the supervisor hands it to hooks). An HMAC under the tenant
        secret, so every replica and supervisor mints and checks the same one, with nothing stored."""
        name = base64.urlsafe_b64encode(namespace.encode()).rstrip(b"=").decode()
        return f"{name}.{self._token_mac(namespace, run)}"

    def token_namespace(self, token: str, run: str | None) -> str:
        """The namespace a run token stands for, when it is ``run``'s; else 403 ``invalid-run-token``."""
        if run is None:
            raise Problem("invalid-header", f"{RUN_TOKEN_HEADER} needs a run (Idem-Run or /runs/{{run_id}}/...)")
        if RUN_TOKEN.fullmatch(token):
            name, _, mac = token.partition(".")
            try:
                namespace = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
            except (binascii.Error, UnicodeDecodeError):
                namespace = None
            if namespace is not None and hmac.compare_digest(mac, self._token_mac(namespace, run)):
                return namespace
        raise Problem("invalid-run-token", f"this {RUN_TOKEN_HEADER} is not run {run!r}'s")

    def _token_mac(self, namespace: str, run: str) -> str:
        keyed = self._keyed.copy()
        keyed.update(b"run-token\0" + namespace.encode() + b"\0" + run.encode())
        return keyed.hexdigest()[:32]

    def check_recordable(self, tenant: str, upstream: str) -> None:
        """Refuse to record a call whose ``tenant`` (:meth:`tenant`) is ``anonymous`` unless
        ``upstream`` lets credential-less callers share it: raises ``credential-required``."""
        if upstream in self._shared_anonymous or tenant != ANONYMOUS:
            return
        wanted = ", ".join(self._credential_headers) or "none configured"
        if self._credential_cookies:
            wanted += "; cookies: " + ", ".join(sorted(self._credential_cookies))
        raise Problem("credential-required", f"a recorded call needs a credential ({wanted}): callers "
                      "without one would see each other's records. Send one, or let such callers "
                      f"share records with anonymous = \"shared\" under [upstreams.{upstream}] or [tenants]",
                      headers=CHALLENGE)

    def connection_key(self, headers: CIMultiDictProxy[str]) -> str:
        """What keeps a passthrough outside a run on its own upstream connections: its
        credential's text, which parts callers as finely as their tenant (its HMAC) would,
        without an HMAC a passthrough otherwise never computes. Held in memory only, as the
        request's headers are, and never written anywhere."""
        material = self._material(headers)
        return "m:" + material if material else ANONYMOUS

    def of_credential(self, headers: CIMultiDictProxy[str]) -> str:
        material = self._material(headers)
        if not material:
            return ANONYMOUS
        # surrogateescape: aiohttp reads header bytes that are not UTF-8 as lone surrogates
        raw = material.encode("utf-8", "surrogateescape")
        # A copy of the keyed HMAC, not hmac.digest: OpenSSL's one-shot HMAC releases the GIL,
        # and the SQLite writer's thread then takes it for tens of microseconds; the copy keeps it
        keyed = self._keyed.copy()
        keyed.update(raw)
        return CREDENTIAL_PREFIX + keyed.hexdigest()[:32]

    def _material(self, headers: CIMultiDictProxy[str]) -> str:
        """What identifies the caller: its credential headers and cookies, "" for none."""
        named = []
        for h in self._credential_headers:
            value = headers.get(h)
            if value is not None and value.strip():  # an empty value is no credential
                named.append(f"{h}={value}")
        material = "\n".join(named)
        if self._credential_cookies and "Cookie" in headers:
            # every value of a named cookie, in order: `s=A; s=B` is not the caller `s=A`
            material += "".join(f"\ncookie:{name}={value}" for name, value in _cookies(headers)
                                if name in self._credential_cookies and value)
        return material

    def _is_trusted(self, peer: str | None) -> bool:
        if not peer or not self._trusted:
            return False
        try:
            addr = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(addr in net for net in self._trusted)


def _cookies(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The (name, value) pairs of every Cookie line (RFC 6265 §5.4: ``a=1; b=2``)."""
    pairs = []
    for line in headers.getall("Cookie"):
        for pair in line.split(";"):
            name, eq, value = pair.strip().partition("=")
            if eq:
                pairs.append((name.strip(), value.strip()))
    return pairs
