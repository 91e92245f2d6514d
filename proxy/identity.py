"""Who a request is: its idempotency key, run, epoch, policy override and tenant.

Header syntax follows draft-ietf-httpapi-idempotency-key-header: the key is a
Structured Field String (RFC 8941 §3.3.3); we also accept a bare token, as most
clients send one.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from .config import RUNS_SHARED, Settings, shares_anonymous
from .policy import Policy
from .problems import Problem

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
        """Whose journal entries a request's are: its trusted tenant, else its credential's.
        ``namespace`` is what :meth:`namespace` answered for the same headers."""
        if self._header in headers:  # named by a trusted source: namespace() checked it
            return "t:" + namespace
        return self.of_credential(headers) if self._shared_runs else namespace

    def namespace(self, headers: CIMultiDictProxy[str], peer: str | None, *, derive: bool = True) -> str:
        """The run namespace: the trusted tenant header, else the credential's tenant (or
        ``default`` with shared runs). ``derive=False`` checks a tenant header all the same
        but answers "" where the namespace would be the credential's HMAC: a passthrough
        outside a run never uses it, and its HMAC would be most of a passthrough's own work."""
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

    def check_recordable(self, headers: CIMultiDictProxy[str], namespace: str, upstream: str) -> None:
        """Refuse to record a call whose tenant would be ``anonymous`` (see :meth:`tenant`)
        unless ``upstream`` lets credential-less callers share it: raises ``credential-required``."""
        if upstream in self._shared_anonymous or self.tenant(headers, namespace) != ANONYMOUS:
            return
        wanted = ", ".join(self._credential_headers) or "none configured"
        if self._credential_cookies:
            wanted += "; cookies: " + ", ".join(sorted(self._credential_cookies))
        raise Problem("credential-required", f"a recorded call needs a credential ({wanted}): callers "
                      "without one would see each other's records. Send one, or let such callers "
                      f"share records with anonymous = \"shared\" under [upstreams.{upstream}] or [tenants]",
                      headers=CHALLENGE)

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
