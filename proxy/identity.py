"""Who a request is: its idempotency key, run, epoch, policy override and tenant.

Header syntax follows draft-ietf-httpapi-idempotency-key-header: the key is a
Structured Field String (RFC 8941 §3.3.3); we also accept a bare token, as most
clients send one.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from .policy import Policy
from .problems import Problem

MAX_KEY_LENGTH = 255
RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
EPOCH = re.compile(r"[0-9]{1,15}")  # exact in every store, Redis's Lua doubles included
TENANT_NAME = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
BARE_KEY = re.compile(r"[\x21-\x7e]+")  # visible ASCII; a comma means a list, refused below


@dataclass(frozen=True, slots=True)
class Identity:
    key: str | None
    run: str | None
    epoch: int | None
    policy: Policy | None
    namespace: str  # whose runs these are (TenantResolver.namespace); the tenant, whose
                    # journal entries, is worked out only for recorded calls


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
    the store never holds the credential itself.

    Runs live in a *namespace* (SPEC §11): the trusted tenant header where one is given;
    else the caller's credential's tenant, so another credential never reaches them; or,
    where ``[tenants] runs = "shared"`` says so, ``default`` for every caller.
    """

    def __init__(self, secret: bytes, credential_headers: tuple[str, ...], header: str,
                 trusted_sources: tuple[str, ...], *, shared_runs: bool = False):
        self._secret = secret
        self._credential_headers = credential_headers
        self._header = header
        self._trusted = tuple(ipaddress.ip_network(s, strict=False) for s in trusted_sources)
        self._shared_runs = shared_runs

    def tenant(self, headers: CIMultiDictProxy[str], namespace: str) -> str:
        """Whose journal entries a request's are: its trusted tenant, else its credential's.
        ``namespace`` is what :meth:`namespace` answered for the same headers."""
        if self._header in headers:  # named by a trusted source: namespace() checked it
            return "t:" + namespace
        return self.of_credential(headers) if self._shared_runs else namespace

    def namespace(self, headers: CIMultiDictProxy[str], peer: str | None) -> str:
        """The run namespace: the trusted tenant header, else the credential's tenant (or
        ``default`` with shared runs)."""
        named = headers.get(self._header)
        if named is None:
            return DEFAULT_NAMESPACE if self._shared_runs else self.of_credential(headers)
        if not self._is_trusted(peer):
            raise Problem("untrusted-tenant", f"{self._header} is accepted only from trusted sources")
        if not TENANT_NAME.fullmatch(named):
            raise Problem("invalid-header", f"{self._header} must be 1-128 of [A-Za-z0-9._:@/-]")
        if named == ANONYMOUS or named.startswith(CREDENTIAL_PREFIX):
            raise Problem("invalid-header", f"{self._header}: {ANONYMOUS!r} and names that start with "
                          f"{CREDENTIAL_PREFIX!r} are the namespaces of credentials, not tenant names")
        return named

    def of_credential(self, headers: CIMultiDictProxy[str]) -> str:
        material = "\n".join(f"{h}={headers[h]}" for h in self._credential_headers if h in headers)
        if not material:
            return ANONYMOUS
        return CREDENTIAL_PREFIX + hmac.new(self._secret, material.encode(), hashlib.sha256).hexdigest()[:32]

    def _is_trusted(self, peer: str | None) -> bool:
        if not peer or not self._trusted:
            return False
        try:
            addr = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(addr in net for net in self._trusted)
