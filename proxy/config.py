"""Settings: frozen values per concern, loaded once.

Loading order: the TOML file (``config/default.toml`` when none is named), then
``IDEMPROXY_*`` environment variables, then CLI overrides. Every option is declared once,
as a dataclass field below; the environment name is derived from it
(``[server] port`` -> ``IDEMPROXY_SERVER_PORT``, ``[upstreams.openai] url`` ->
``IDEMPROXY_UPSTREAMS_OPENAI_URL``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import ipaddress
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

ENV_PREFIX = "IDEMPROXY_"
MODEL_PROVIDERS = {"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com",
                   "api.mistral.ai", "api.groq.com", "api.together.xyz", "api.deepseek.com"}


class Policy(StrEnum):
    """What the proxy does with a request (SPEC §4): a rule's ``policy``, or ``Idem-Policy``."""
    RECORD = "record"            # claim the key, forward, record the outcome, then answer
    PASSTHROUGH = "passthrough"  # forward, record nothing


ANONYMOUS_CHOICES = ("refuse", "shared")  # [tenants] and [upstreams.*] anonymous
MAX_STANDBY = 64  # [hooks.*] standby: idle processes per hook and supervisor

# Path words with a meaning of their own in the proxy's routes; no upstream may take these names.
RESERVED_NAMES = frozenset({"runs", "admin", "healthz", "readyz", "metrics", "epochs",
                            "heartbeat", "complete", "fail", "attempts", "ui"})


RUNS_PER_CREDENTIAL, RUNS_SHARED = "credential", "shared"  # [tenants] runs


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which option and why."""


class Secret(str):
    """A string that never shows itself in a repr or a log line."""

    def __repr__(self) -> str:
        return "'***'"


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``"250ms"``, ``"30s"``, ``"5m"``, ``"7d"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*", str(value))
    if not m:
        raise ValueError(f"not a duration: {value!r}")
    unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]
    return float(m.group(1)) * unit


# Query parameters shown as *** by a part of their name: secrets, and where to find them
# (libpq's password, sslpassword, passfile, sslkey; its options, which may carry
# `-c password=…`; api_key, access_token, client_secret, sig, …).
SECRET_PARAM = re.compile(r"(?i)pass|secret|token|key|auth|cred|sig|options")
QUERY_PARAM = re.compile(r"(^|[&;])([^=&;]*)=([^&;]*)")


def mask_url(url: str) -> str:
    """The URL with its password and every secret-looking query value replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL we can take apart: show none of it
        return "***"
    # Edited in place, not rebuilt: urlunsplit would drop the `//` of sqlite:///path.
    masked = url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        masked = masked.replace(parts.netloc, f"{userinfo.partition(':')[0]}:***@{hostport}", 1)
    if parts.query or parts.fragment:  # a fragment may carry one too (#access_token=…)
        before = masked.partition("?" if parts.query else "#")[0]
        query = f"?{QUERY_PARAM.sub(_mask_param, parts.query)}" if parts.query else ""
        fragment = f"#{QUERY_PARAM.sub(_mask_param, parts.fragment)}" if parts.fragment else ""
        masked = before + query + fragment
    return masked


def _mask_param(m: re.Match) -> str:
    name = m.group(2)
    return m.group(0) if not SECRET_PARAM.search(unquote(name)) else f"{m.group(1)}{name}=***"


def _repr_masking_urls(self) -> str:
    """A dataclass's repr with its ``*url`` fields masked (a Secret masks itself)."""
    shown = (f"{f.name}={(mask_url(v) if f.name.endswith('url') and isinstance(v, str) else v)!r}"
             for f in dataclasses.fields(self) if f.repr for v in (getattr(self, f.name),))
    return f"{type(self).__name__}({', '.join(shown)})"


@dataclass(frozen=True)
class Rule:
    """``match = "POST /v1/*"`` (method optional, path glob) -> ``policy``."""
    match: str
    policy: str


@dataclass(frozen=True)
class IgnoreFields:
    """JSON fields (dotted paths) left out of the fingerprint for requests matching ``match``."""
    match: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8787
    workers: int = 1
    max_request_bytes: int = 10 * 1024 * 1024
    max_record_bytes: int = 32 * 1024 * 1024
    # A recorded call still streaming this long after it was sent is unrecordable; it goes
    # on only while an agent listens (an hour covers the longest model answers).
    max_record_seconds: float = 3600.0
    in_flight_wait: float = 30.0
    shutdown_timeout: float = 30.0
    access_log: bool = True
    # Client connections (connections.py): a request head must arrive whole within
    # header_timeout, a body may fall silent for body_timeout, a connection idle between
    # requests closes after idle_timeout; past max_connections (0: half the open-file
    # limit) new connections get 503.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    max_connections: int = 0
    # CIDRs of proxies in front of us whose X-Forwarded-For / Forwarded claims are kept
    # (the peer is appended); from any other peer they are replaced (forwarded.py).
    trusted_proxies: tuple[str, ...] = ()
    # "text": one readable line per request; "json": one JSON object per line (run, epoch, kid,
    # outcome, upstream, proxy and upstream ms, model, tokens) for a log pipeline
    log_format: str = "text"


@dataclass(frozen=True)
class StoreSettings:
    url: str = "sqlite:///idemproxy.db"
    retention: float = 7 * 86400.0
    # A claim is a lease renewed every lease/3 while its call is in flight, so a dead
    # proxy's claims free up within one lease instead of one upstream timeout.
    lease: float = 60.0
    timeout: float = 5.0
    purge_interval: float = 60.0
    # A restarted attempt's replays answered from its run's journal, loaded in one read
    # (proxy/replaycache.py): at most this many bytes of bodies held per process (0: off),
    # each attempt's for at most replay_cache_ttl.
    replay_cache_bytes: int = 64 * 1024 * 1024
    replay_cache_ttl: float = 10.0
    # Complete entries answered from memory (proxy/answercache.py): at most about this many
    # bytes per process (bodies, headers, ~0.5 KiB each besides; 0: off).
    answer_cache_bytes: int = 32 * 1024 * 1024
    # How long both caches trust their last look at the journal's generation (proxy/freshness.py);
    # a journal delete waits this long before it answers. Every replica must use the same.
    cache_lease: float = 1.0

    def __repr__(self) -> str:
        return f"StoreSettings(url={mask_url(self.url)!r}, retention={self.retention})"


@dataclass(frozen=True)
class TenantSettings:
    # HMAC key for tenant ids; generated once and kept in the store when unset.
    secret: Secret | None = None
    header: str = "Idem-Tenant"
    trusted_sources: tuple[str, ...] = ()  # CIDRs allowed to name a tenant by header
    credential_headers: tuple[str, ...] = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
    # Whose runs a caller reaches (SPEC §11): "credential", the namespace of the tenant of its
    # credential (or of the trusted tenant header); "shared", one namespace ("default") for every
    # caller without a trusted tenant header: a deliberate choice, for one trusted agent.
    runs: str = RUNS_PER_CREDENTIAL
    credential_cookies: tuple[str, ...] = ()  # cookie names whose values are credentials too
    # A recorded call with no credential: "refuse" it (401 credential-required), or let all
    # such callers share one tenant, "shared" (they see each other's records). Per upstream too.
    anonymous: str = "refuse"


@dataclass(frozen=True)
class UpstreamSettings:
    name: str
    url: str
    kind: str = ""  # "model", "tool" or "mcp" (an MCP server); derived from the host when empty
    on_ambiguous: str = ""  # "retry" or "quarantine"; by kind when empty
    idempotency_header: str | None = None
    rules: tuple[Rule, ...] = ()
    ignore_fields: tuple[IgnoreFields, ...] = ()
    set_headers: Mapping[str, Secret] = field(default_factory=dict)  # e.g. injected credentials
    redact_headers: tuple[str, ...] = ()  # response headers never stored
    anonymous: str = ""  # "refuse" or "shared" (see TenantSettings); [tenants] anonymous when empty
    connect_timeout: float = 10.0
    read_timeout: float = 300.0  # longest silence between two bytes of the response
    max_connections: int = 256
    # model -> [USD per million input tokens, per million output tokens] ("*" for any model),
    # overriding the genai-prices database (proxy/pricing.py);
    # for the cost that replays saved (idemproxy_cost_saved_usd_total)
    prices: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # kind = "mcp": the policy of a tools/call by the tool's annotations (learned from tools/list),
    # the first that applies; any other tool is recorded
    read_only_tools: str = "passthrough"   # readOnlyHint: true
    idempotent_tools: str = "record"       # idempotentHint: true
    non_destructive_tools: str = "record"  # destructiveHint: false

    def __repr__(self) -> str:
        return (f"UpstreamSettings(name={self.name!r}, url={mask_url(self.url)!r}, kind={self.kind!r}, "
                f"on_ambiguous={self.on_ambiguous!r})")


@dataclass(frozen=True)
class RunSettings:
    timeout_s: float = 60.0
    grace_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 600.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    hook: str | None = None
    on_dead: str | None = None
    # What a registration (POST /runs/{id}) may ask for; the defaults above are the operator's
    # and are not held to these.
    min_timeout_s: float = 1.0
    min_grace_s: float = 1.0
    max_restarts_limit: int = 100
    max_metadata_bytes: int = 64 * 1024
    # A held connection (POST /runs/{id}/attach) that stays gone this long marks its attempt
    # lost: long enough for a client to reconnect after a blip, short next to timeout_s.
    attach_grace_s: float = 1.0
    attach_keepalive_s: float = 5.0  # a line down each held connection this often


@dataclass(frozen=True)
class HookSettings:
    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    secret: Secret | None = None
    log_dir: str = "idemproxy-logs"
    retries: int = 5
    env: Mapping[str, Secret] = field(default_factory=dict)  # added to a command hook's environment
    # When set, the only variables a command hook inherits (IDEM_* and `env` are still given).
    pass_env: tuple[str, ...] | None = None
    # Namespaces whose own registrations (and runs their traffic creates) may arm this hook;
    # otherwise only the admin API can (README "Who may do what").
    allow_tenants: tuple[str, ...] = ()
    # The command is the agent: its exit without complete/fail restarts the run at once.
    # False for a launcher that hands the agent to something else and exits (kubectl, systemd-run).
    watch_exit: bool = True
    # Processes of `command` kept started ahead, imported and waiting to be told their run
    # (agents on the client library only); 0: each restart spawns the command.
    standby: int = 0

    __repr__ = _repr_masking_urls


@dataclass(frozen=True)
class SupervisorSettings:
    enabled: bool = True
    interval_s: float = 1.0
    proxy_url: str | None = None  # what hooks are told; http://{host}:{port} by default
    max_hook_processes: int = 16  # command hooks running at once, started by this process
    max_restarts_per_minute: int = 60  # restarts this supervisor makes, over any 60 s

    __repr__ = _repr_masking_urls


@dataclass(frozen=True)
class AdminSettings:
    token: Secret | None = None


@dataclass(frozen=True)
class Settings:
    server: ServerSettings = ServerSettings()
    store: StoreSettings = StoreSettings()
    tenants: TenantSettings = TenantSettings()
    upstreams: Mapping[str, UpstreamSettings] = field(default_factory=dict)
    runs: RunSettings = RunSettings()
    hooks: Mapping[str, HookSettings] = field(default_factory=dict)
    supervisor: SupervisorSettings = SupervisorSettings()
    admin: AdminSettings = AdminSettings()

    def may_arm(self, hook: str | None, namespace: str) -> bool:
        """Whether a run of ``namespace`` may arm ``hook`` by itself (without the admin token)."""
        return hook is not None and hook in self.hooks and namespace in self.hooks[hook].allow_tenants

    def default_hook(self, namespace: str) -> str | None:
        """The ``[runs] hook`` a new run of ``namespace`` gets: none unless it may arm it."""
        return self.runs.hook if self.may_arm(self.runs.hook, namespace) else None

    @property
    def proxy_url(self) -> str:
        if self.supervisor.proxy_url:
            return self.supervisor.proxy_url.rstrip("/")
        host = "127.0.0.1" if self.server.host in ("0.0.0.0", "::", "") else self.server.host
        return f"http://{host}:{self.server.port}"


SECTIONS = {"server": ServerSettings, "store": StoreSettings, "tenants": TenantSettings,
            "runs": RunSettings, "supervisor": SupervisorSettings, "admin": AdminSettings}
NAMED_SECTIONS = {"upstreams": UpstreamSettings, "hooks": HookSettings}


def load_settings(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """TOML file, then ``IDEMPROXY_*`` variables, then ``overrides`` (dotted keys)."""
    raw = _read_toml(path)
    for dotted, value in _env_overrides(raw, os.environ if env is None else env):
        _set_dotted(raw, dotted, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(raw, dotted, value)
    return _build(raw)


def _read_toml(path: str | os.PathLike | None) -> dict:
    try:
        if path is None:
            text = resources.files("idemproxy.proxy").joinpath("default.toml").read_text()
        else:
            text = Path(path).read_text()
        return tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read configuration {path or 'default.toml'}: {exc}") from exc


def _env_overrides(raw: dict, env: Mapping[str, str]):
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        for section, cls in SECTIONS.items():
            if rest.startswith(section + "_") and rest[len(section) + 1:] in _field_names(cls):
                yield f"{section}.{rest[len(section) + 1:]}", value
        for section, cls in NAMED_SECTIONS.items():
            if not rest.startswith(section + "_"):
                continue
            tail = rest[len(section) + 1:]
            # The longest field name that ends the variable wins, so entry names may
            # themselves contain underscores.
            for fname in sorted(_field_names(cls), key=len, reverse=True):
                if tail.endswith("_" + fname) and len(tail) > len(fname) + 1:
                    yield f"{section}.{tail[:-len(fname) - 1]}.{fname}", value
                    break


# IDEMPROXY_* variables that are not settings: the config file's name, and the test suite's
NOT_SETTINGS = ("IDEMPROXY_CONFIG", "IDEMPROXY_TEST_")


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """``IDEMPROXY_*`` variables that set nothing (a typo, or an option that does not exist)."""
    raw: dict = {}
    known = {ENV_PREFIX + dotted.replace(".", "_").upper() for dotted, _ in _env_overrides(raw, env)}
    return sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known
                  and not name.startswith(NOT_SETTINGS))


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a table")
    if isinstance(value, str):
        value = _parse_scalar(value)
    node[leaf] = value


def _parse_scalar(text: str) -> Any:
    """Environment and CLI values use TOML syntax where they can (numbers, lists, booleans)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name != "name"}


def _build(raw: dict) -> Settings:
    unknown = set(raw) - set(SECTIONS) - set(NAMED_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values[section] = _make(cls, raw.get(section, {}), section)
    for section, cls in NAMED_SECTIONS.items():
        table = raw.get(section, {})
        values[section] = {name: _make(cls, {**body, "name": name}, f"{section}.{name}")
                           for name, body in table.items()}
    settings = Settings(**values)
    _validate(settings)
    return settings


def _make(cls, table: Any, where: str):
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"[{where}] unknown option(s): {', '.join(sorted(unknown))}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in table and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"[{where}] needs {', '.join(missing)}")
    kwargs = {}
    for key, value in table.items():
        try:
            kwargs[key] = _coerce(hints[key], value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.{key}: {exc}") from None
    return cls(**kwargs)


def _coerce(hint, value):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or value == "":
            return None
        return _coerce(next(a for a in args if a is not type(None)), value)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise TypeError(f"expected a boolean, got {value!r}")
        return value
    if hint is float:
        return parse_duration(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {value!r}")
        return int(value)
    if hint in (str, Secret):
        if not isinstance(value, (str, int, float)):
            raise TypeError(f"expected a string, got {value!r}")
        return hint(value)
    if origin is tuple:
        items = [value] if isinstance(value, (str, dict)) else list(value)
        return tuple(_coerce(args[0], item) for item in items)
    if origin in (Mapping, collections.abc.Mapping):  # get_origin gives the abc, not typing's alias
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {value!r}")
        return {str(k): _coerce(args[1], v) for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _make(hint, value, hint.__name__)
    raise TypeError(f"unsupported option type {hint}")


def _validate(s: Settings) -> None:
    for up in s.upstreams.values():
        parts = urlsplit(up.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"upstreams.{up.name}.url must be an http(s) URL, got {up.url!r}")
        if up.kind not in ("", "model", "tool", "mcp"):
            raise ConfigError(f"upstreams.{up.name}.kind must be 'model', 'tool' or 'mcp'")
        for option in ("read_only_tools", "idempotent_tools", "non_destructive_tools"):
            if getattr(up, option) not in tuple(Policy):
                raise ConfigError(f"upstreams.{up.name}.{option} must be 'record' or 'passthrough'")
        if up.on_ambiguous not in ("", "retry", "quarantine"):
            raise ConfigError(f"upstreams.{up.name}.on_ambiguous must be 'retry' or 'quarantine'")
        if up.anonymous not in ("", *ANONYMOUS_CHOICES):
            raise ConfigError(f"upstreams.{up.name}.anonymous must be 'refuse' or 'shared'")
        for model, price in up.prices.items():
            if len(price) != 2:
                raise ConfigError(f"upstreams.{up.name}.prices.{model} must be [input, output] USD per "
                                  "million tokens")
        for rule in up.rules:
            if rule.policy not in tuple(Policy):
                raise ConfigError(f"upstreams.{up.name}.rules: unknown policy {rule.policy!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.~-]+", up.name) or up.name in RESERVED_NAMES:
            raise ConfigError(f"upstream name {up.name!r} is not usable in a path "
                              f"(reserved: {', '.join(sorted(RESERVED_NAMES))})")
    if s.tenants.anonymous not in ANONYMOUS_CHOICES:
        raise ConfigError("tenants.anonymous must be 'refuse' or 'shared'")
    for hook in s.hooks.values():
        if bool(hook.command) == bool(hook.url):
            raise ConfigError(f"hooks.{hook.name}: set exactly one of command or url")
        if not 0 <= hook.standby <= MAX_STANDBY or (hook.standby and not hook.command):
            raise ConfigError(f"hooks.{hook.name}: standby is for command hooks, from 0 to {MAX_STANDBY}")
    for name in (s.runs.hook, s.runs.on_dead):
        if name and name not in s.hooks:
            raise ConfigError(f"runs: hook {name!r} is not defined under [hooks]")
    if not 0 < s.runs.attach_keepalive_s <= 60 or s.runs.attach_grace_s <= 0:
        raise ConfigError("runs.attach_grace_s must be positive and runs.attach_keepalive_s from 0 to 60 s")
    if s.server.log_format not in ("text", "json"):
        raise ConfigError(f"server.log_format must be 'text' or 'json', got {s.server.log_format!r}")
    if s.server.workers < 1:
        raise ConfigError("server.workers must be at least 1")
    if s.tenants.runs not in (RUNS_PER_CREDENTIAL, RUNS_SHARED):
        raise ConfigError(f"tenants.runs must be {RUNS_PER_CREDENTIAL!r} or {RUNS_SHARED!r}")
    for name in ("max_hook_processes", "max_restarts_per_minute"):
        if getattr(s.supervisor, name) < 1:
            raise ConfigError(f"supervisor.{name} must be at least 1")
    for name in ("header_timeout", "body_timeout", "idle_timeout"):
        if getattr(s.server, name) <= 0:
            raise ConfigError(f"server.{name} must be more than 0")
    if s.server.max_connections < 0:
        raise ConfigError("server.max_connections must be 0 (automatic) or more")
    for name in ("replay_cache_bytes", "answer_cache_bytes", "cache_lease"):
        if getattr(s.store, name) < 0:
            raise ConfigError(f"store.{name} must be 0 (off) or more")
    for cidr in s.server.trusted_proxies:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ConfigError(f"server.trusted_proxies: {cidr!r} is not an address or CIDR") from None


def upstream_kind(up: UpstreamSettings) -> str:
    if up.kind:
        return up.kind
    host = urlsplit(up.url).hostname or ""
    return "model" if host in MODEL_PROVIDERS or up.name in ("openai", "anthropic") else "tool"


def shares_anonymous(up: UpstreamSettings, tenants: TenantSettings) -> bool:
    """Whether callers with no credential may record through ``up``, sharing one tenant."""
    return (up.anonymous or tenants.anonymous) == "shared"


def ambiguous_policy(up: UpstreamSettings) -> str:
    """What an ambiguous outcome does to the key: model calls retry, tools quarantine."""
    if up.on_ambiguous:
        return up.on_ambiguous
    return "retry" if upstream_kind(up) == "model" else "quarantine"
