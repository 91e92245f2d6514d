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
from urllib.parse import urlsplit, urlunsplit

ENV_PREFIX = "IDEMPROXY_"
MODEL_PROVIDERS = {"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com",
                   "api.mistral.ai", "api.groq.com", "api.together.xyz", "api.deepseek.com"}


class Policy(StrEnum):
    """What the proxy does with a request (SPEC §4): a rule's ``policy``, or ``Idem-Policy``."""
    RECORD = "record"            # claim the key, forward, record the outcome, then answer
    PASSTHROUGH = "passthrough"  # forward, record nothing


# Path words with a meaning of their own in the proxy's routes; no upstream may take these names.
RESERVED_NAMES = frozenset({"runs", "admin", "healthz", "readyz", "metrics", "epochs",
                            "heartbeat", "complete", "fail", "attempts"})


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


SECRET_QUERY = re.compile(r"(?i)((?:^|&)(?:password|passwd|pass|token|secret|key|api[_-]?key)=)[^&]*")


def mask_url(url: str) -> str:
    """The URL with its password and secret-looking query values replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc, query=SECRET_QUERY.sub(r"\1***", parts.query)))


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
    in_flight_wait: float = 30.0
    shutdown_timeout: float = 30.0
    access_log: bool = True


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

    def __repr__(self) -> str:
        return f"StoreSettings(url={mask_url(self.url)!r}, retention={self.retention})"


@dataclass(frozen=True)
class TenantSettings:
    # HMAC key for tenant ids; generated once and kept in the store when unset.
    secret: Secret | None = None
    header: str = "Idem-Tenant"
    trusted_sources: tuple[str, ...] = ()  # CIDRs allowed to name a tenant by header
    credential_headers: tuple[str, ...] = ("authorization", "x-api-key", "api-key", "x-goog-api-key")


@dataclass(frozen=True)
class UpstreamSettings:
    name: str
    url: str
    kind: str = ""  # "model" or "tool"; derived from the host when empty
    on_ambiguous: str = ""  # "retry" or "quarantine"; by kind when empty
    idempotency_header: str | None = None
    rules: tuple[Rule, ...] = ()
    ignore_fields: tuple[IgnoreFields, ...] = ()
    set_headers: Mapping[str, Secret] = field(default_factory=dict)  # e.g. injected credentials
    redact_headers: tuple[str, ...] = ()  # response headers never stored
    connect_timeout: float = 10.0
    read_timeout: float = 300.0  # longest silence between two bytes of the response
    max_connections: int = 256
    # model -> [USD per million input tokens, per million output tokens] ("*" for any model),
    # for the cost that replays saved (idemproxy_cost_saved_usd_total)
    prices: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

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


@dataclass(frozen=True)
class SupervisorSettings:
    enabled: bool = True
    interval_s: float = 1.0
    proxy_url: str | None = None  # what hooks are told; http://{host}:{port} by default


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
        if up.kind not in ("", "model", "tool"):
            raise ConfigError(f"upstreams.{up.name}.kind must be 'model' or 'tool'")
        if up.on_ambiguous not in ("", "retry", "quarantine"):
            raise ConfigError(f"upstreams.{up.name}.on_ambiguous must be 'retry' or 'quarantine'")
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
    for hook in s.hooks.values():
        if bool(hook.command) == bool(hook.url):
            raise ConfigError(f"hooks.{hook.name}: set exactly one of command or url")
    for name in (s.runs.hook, s.runs.on_dead):
        if name and name not in s.hooks:
            raise ConfigError(f"runs: hook {name!r} is not defined under [hooks]")
    if s.server.workers < 1:
        raise ConfigError("server.workers must be at least 1")


def upstream_kind(up: UpstreamSettings) -> str:
    if up.kind:
        return up.kind
    host = urlsplit(up.url).hostname or ""
    return "model" if host in MODEL_PROVIDERS or up.name in ("openai", "anthropic") else "tool"


def ambiguous_policy(up: UpstreamSettings) -> str:
    """What an ambiguous outcome does to the key: model calls retry, tools quarantine."""
    if up.on_ambiguous:
        return up.on_ambiguous
    return "retry" if upstream_kind(up) == "model" else "quarantine"
