"""The settings: frozen values per concern, each option declared once as a field.

The environment name of every option is derived from its field (``[server] port`` ->
``IDEMPROXY_SERVER_PORT``, ``[upstreams.openai] url`` -> ``IDEMPROXY_UPSTREAMS_OPENAI_URL``);
loading.py reads the file and the environment into these, validation.py checks them whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping
from urllib.parse import urlsplit

from ..upstream.egress import FROM_ENVIRONMENT
from .masking import Secret, mask_url, repr_masking_urls

ENV_PREFIX = "IDEMPROXY_"
MODEL_PROVIDERS = {"api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com",
                   "api.mistral.ai", "api.groq.com", "api.together.xyz", "api.deepseek.com"}


class Policy(StrEnum):
    """What the proxy does with a request (docs/concepts.md): a rule's ``policy``, or ``Idem-Policy``."""
    RECORD = "record"            # claim the key, forward, record the outcome, then answer
    PASSTHROUGH = "passthrough"  # forward, record nothing


# [upstreams.*] keepalive_timeout by kind: under gunicorn's 2 s for tool servers
MODEL_KEEPALIVE_S, TOOL_KEEPALIVE_S = 30.0, 1.5
ANONYMOUS_CHOICES = ("refuse", "shared")  # [tenants] and [upstreams.*] anonymous
MAX_STANDBY = 64  # [hooks.*] standby: idle processes per hook and supervisor

# Path words with a meaning of their own in the proxy's routes; no upstream may take these names.
RESERVED_NAMES = frozenset({"runs", "admin", "healthz", "readyz", "metrics", "epochs", "cap",
                            "heartbeat", "complete", "fail", "attempts", "ui"})


RUNS_PER_CREDENTIAL, RUNS_SHARED = "credential", "shared"  # [tenants] runs


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which option and why."""


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
class IgnoreOrder:
    """JSON arrays (dotted paths) whose order the fingerprint ignores for requests matching
    ``match``: sets sent as lists, in an order that may change between processes."""
    match: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8787
    workers: int = 1
    max_request_bytes: int = 10 * 1024 * 1024
    max_record_bytes: int = 32 * 1024 * 1024
    # Of a quarantined call, what the operator decides on: the request body, and the first
    # bytes of the upstream's partial or error answer, each kept up to this (0: neither)
    max_evidence_bytes: int = 64 * 1024
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
    # PostgreSQL: the journal's partitions span this much expiry each (whole seconds, 1s at
    # least); a purge drops a partition once all of it has expired (docs/sizing.md).
    partition_interval: float = 86400.0
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
    # Redis: a claim, a record or a run's change is acknowledged only once WAIT says this many
    # replicas have it (else 503), so a failover cannot lose it; 0: asynchronous (docs/deployment.md).
    redis_wait_replicas: int = 0

    def __repr__(self) -> str:
        return f"StoreSettings(url={mask_url(self.url)!r}, retention={self.retention})"


@dataclass(frozen=True)
class TenantSettings:
    # HMAC key for tenant ids; generated once and kept in the store when unset.
    secret: Secret | None = None
    header: str = "Idem-Tenant"
    trusted_sources: tuple[str, ...] = ()  # CIDRs allowed to name a tenant by header
    credential_headers: tuple[str, ...] = ("authorization", "x-api-key", "api-key", "x-goog-api-key")
    # Whose runs a caller reaches (docs/security.md): "credential", the namespace of the tenant of its
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
    # The OpenAI Agents SDK builds the Responses API's `include` from a Python set: its order
    # follows PYTHONHASHSEED, so a restarted process's calls would miss the journal.
    ignore_order: tuple[IgnoreOrder, ...] = ()
    set_headers: Mapping[str, Secret] = field(default_factory=dict)  # e.g. injected credentials
    redact_headers: tuple[str, ...] = ()  # response headers never stored
    anonymous: str = ""  # "refuse" or "shared" (see TenantSettings); [tenants] anonymous when empty
    connect_timeout: float = 10.0
    read_timeout: float = 300.0  # longest silence between two bytes of the response
    max_connections: int = 256
    # How long an idle connection is kept for reuse (0: never reused); by kind when unset:
    # model providers' front doors keep idle connections for minutes, while common tool
    # servers close them after 2 s (gunicorn) or 5 s (uvicorn, Node). A request that crosses
    # the server's close fails, and a recorded call must not be sent again, so a tool's
    # connection is let go first. A server's `Keep-Alive: timeout=N` lowers it to N - 1 s.
    keepalive_timeout: float | None = None
    # The most an answer's head may hold (status line and fields; 502 past either), as
    # nginx's proxy_buffer_size bounds it: what an upstream sends cannot grow the proxy.
    max_head_bytes: int = 64 * 1024
    max_head_fields: int = 256
    # model -> [USD per million input tokens, per million output tokens] ("*" for any model),
    # overriding the genai-prices database (proxy/observability/pricing.py);
    # for the cost that replays saved (idemproxy_cost_saved_usd_total)
    prices: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # kind = "mcp": the policy of a tools/call by the tool's annotations (learned from tools/list),
    # the first that applies; any other tool is recorded
    read_only_tools: str = "passthrough"   # readOnlyHint: true
    idempotent_tools: str = "record"       # idempotentHint: true
    non_destructive_tools: str = "record"  # destructiveHint: false
    # How it is reached (proxy/upstream/egress.py). proxy: "env" reads HTTPS_PROXY (https upstreams),
    # HTTP_PROXY (http ones) and NO_PROXY, as curl and httpx do; "" goes direct; or an
    # http://[user:pass@]host:port egress proxy, its credentials sent as Proxy-Authorization.
    proxy: str = FROM_ENVIRONMENT
    # TLS to an https upstream, verification always on: ca_file, a PEM bundle trusted in
    # place of the system's; client_cert and client_key, for a server that requires mTLS.
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

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
    # What registrations that need no token may take (POST /runs/{id} of a new run, and
    # /attempts of an unknown one; the admin API is not held to these): runs not ended per
    # namespace (0: no cap; 429 too-many-runs past it), and new runs per minute from one
    # namespace and from one client (counted by each process; 429 too-many-requests).
    max_live_runs: int = 1000
    registrations_per_minute: int = 600


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
    # otherwise only the admin API can (docs/security.md, "Who may do what").
    allow_tenants: tuple[str, ...] = ()
    # The command is the agent: its exit without complete/fail restarts the run at once.
    # False for a launcher that hands the agent to something else and exits (kubectl, systemd-run).
    watch_exit: bool = True
    # Processes of `command` kept started ahead, imported and waiting to be told their run
    # (agents on the client library only); 0: each restart spawns the command.
    standby: int = 0

    __repr__ = repr_masking_urls


@dataclass(frozen=True)
class SupervisorSettings:
    enabled: bool = True
    interval_s: float = 1.0
    proxy_url: str | None = None  # what hooks are told; http://{host}:{port} by default
    max_hook_processes: int = 16  # command hooks running at once, started by this process
    max_restarts_per_minute: int = 60  # restarts this supervisor makes, over any 60 s

    __repr__ = repr_masking_urls


@dataclass(frozen=True)
class AdminSettings:
    # The bearer token of /admin/ and the console's login: 16 characters or more, never a
    # placeholder (validation.py); unset, both are off.
    token: Secret | None = None
    # Who the token acts as in the audit trail of operator actions (empty: "token:" and the
    # first 8 hex digits of its SHA-256, never the token)
    operator: str = ""
    # Wrong tokens one client may send within failure_window before it gets 429 (with
    # Retry-After) until the window has passed; past max_failures_total from every client
    # together, each client that sent a wrong one waits too. A client with none never does.
    max_failures: int = 10
    max_failures_total: int = 100
    failure_window: float = 60.0


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
        if hook is None or hook not in self.hooks:
            return False
        allowed = self.hooks[hook].allow_tenants
        # a run registered without a credential has a namespace of its own ("r:...", see
        # identity.py); "anonymous" in allow_tenants lets such runs arm the hook
        return namespace in allowed or (namespace.startswith("r:") and "anonymous" in allowed)

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


def upstream_kind(up: UpstreamSettings) -> str:
    if up.kind:
        return up.kind
    host = urlsplit(up.url).hostname or ""
    return "model" if host in MODEL_PROVIDERS or up.name in ("openai", "anthropic") else "tool"


def shares_anonymous(up: UpstreamSettings, tenants: TenantSettings) -> bool:
    """Whether callers with no credential may record through ``up``, sharing one tenant."""
    return (up.anonymous or tenants.anonymous) == "shared"


def keepalive_timeout(up: UpstreamSettings) -> float:
    """How long ``up``'s idle connections are reused: its own setting, else by kind."""
    if up.keepalive_timeout is not None:
        return up.keepalive_timeout
    return MODEL_KEEPALIVE_S if upstream_kind(up) == "model" else TOOL_KEEPALIVE_S


def ambiguous_policy(up: UpstreamSettings) -> str:
    """What an ambiguous outcome does to the key: model calls retry, tools quarantine."""
    if up.on_ambiguous:
        return up.on_ambiguous
    return "retry" if upstream_kind(up) == "model" else "quarantine"
