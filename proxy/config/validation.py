"""The settings checked as a whole, once loaded: each refusal names the option and why."""

from __future__ import annotations

import ipaddress
import os
import re
from urllib.parse import urlsplit

from ..upstream.egress import FROM_ENVIRONMENT, ProxyURL, tls_context
from .settings import (ANONYMOUS_CHOICES, MAX_STANDBY, RESERVED_NAMES, RUNS_PER_CREDENTIAL, RUNS_SHARED,
                       ConfigError, Policy, Settings, UpstreamSettings)

TLS_OPTIONS = ("ca_file", "client_cert", "client_key")
MIN_TOKEN_LENGTH = 16
# Admin tokens that shipped in examples and manifests, or that anyone would try first
PLACEHOLDER_TOKENS = frozenset({"change-me", "changeme", "change_me", "change-this", "replace-me", "replaceme",
                                "secret", "password", "admin", "token", "admin-token", "test", "example",
                                "default", "xxx", "todo", "<token>", "${token}"})


def validate(s: Settings) -> None:
    _check_ranges(s)
    _check_admin(s)
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
        if up.keepalive_timeout is not None and up.keepalive_timeout < 0:
            raise ConfigError(f"upstreams.{up.name}.keepalive_timeout must be 0 (no reuse) or more")
        if up.max_head_bytes < 1024 or up.max_head_fields < 8:
            raise ConfigError(f"upstreams.{up.name}: max_head_bytes must be at least 1024 and "
                              "max_head_fields at least 8")
        for model, price in up.prices.items():
            if len(price) != 2:
                raise ConfigError(f"upstreams.{up.name}.prices.{model} must be [input, output] USD per "
                                  "million tokens")
        for rule in up.rules:
            if rule.policy not in tuple(Policy):
                raise ConfigError(f"upstreams.{up.name}.rules: unknown policy {rule.policy!r}")
        _check_egress(up)
        if not re.fullmatch(r"[A-Za-z0-9_.~-]+", up.name) or up.name in RESERVED_NAMES:
            raise ConfigError(f"upstream name {up.name!r} is not usable in a path "
                              f"(reserved: {', '.join(sorted(RESERVED_NAMES))})")
    if s.tenants.anonymous not in ANONYMOUS_CHOICES:
        raise ConfigError("tenants.anonymous must be 'refuse' or 'shared'")
    for hook in s.hooks.values():
        if bool(hook.command) == bool(hook.url):
            raise ConfigError(f"hooks.{hook.name}: set exactly one of command or url")
        if len(hook.command) == 1 and len(hook.command[0].split()) > 1 and not os.path.exists(hook.command[0]):
            # run as it is, no shell: "python agent.py" would be one program of that name
            raise ConfigError(f"hooks.{hook.name}.command is one string, {hook.command[0]!r}, and no shell "
                              f"splits it: write the argv as a list, command = {list(hook.command[0].split())!r}")
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
    for name in ("replay_cache_bytes", "answer_cache_bytes", "cache_lease", "redis_wait_replicas"):
        if getattr(s.store, name) < 0:
            raise ConfigError(f"store.{name} must be 0 (off) or more")
    if s.store.redis_wait_replicas and not urlsplit(s.store.url).scheme.startswith("redis"):
        raise ConfigError("store.redis_wait_replicas is for a Redis store (redis://, redis+cluster://)")
    interval = s.store.partition_interval
    if interval < 1 or interval != int(interval):
        raise ConfigError(f"store.partition_interval must be whole seconds, 1s or more, got {interval:g}s")
    for cidr in s.server.trusted_proxies:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ConfigError(f"server.trusted_proxies: {cidr!r} is not an address or CIDR") from None


def _check_ranges(s: Settings) -> None:
    """Numbers that cannot mean anything outside a range."""
    if not 0 <= s.server.port <= 65535:
        raise ConfigError(f"server.port must be from 0 (any free port) to 65535, got {s.server.port}")
    for name in ("max_request_bytes", "max_record_bytes"):
        if getattr(s.server, name) < 1:
            raise ConfigError(f"server.{name} must be at least 1")
    if s.server.max_evidence_bytes < 0:
        raise ConfigError("server.max_evidence_bytes must be 0 or more")
    for section, names in (("store", ("timeout", "lease", "retention", "purge_interval")),
                           ("runs", ("timeout_s", "min_timeout_s")), ("supervisor", ("interval_s",)),
                           ("admin", ("failure_window",))):
        for name in names:
            if getattr(getattr(s, section), name) <= 0:
                raise ConfigError(f"{section}.{name} must be more than 0")
    for section, names in (("runs", ("grace_s", "max_restarts", "max_live_runs")),):
        for name in names:
            if getattr(getattr(s, section), name) < 0:
                raise ConfigError(f"{section}.{name} must be 0 or more")
    for section, name in (("runs", "registrations_per_minute"), ("admin", "max_failures"),
                          ("admin", "max_failures_total")):
        if getattr(getattr(s, section), name) < 1:
            raise ConfigError(f"{section}.{name} must be at least 1")


def _check_admin(s: Settings) -> None:
    """An admin token opens every run's journal and resolves its calls: no placeholder, no
    short one (it is never echoed here: it is a secret)."""
    token = s.admin.token
    if token is None:
        return
    if str(token).strip().lower() in PLACEHOLDER_TOKENS:
        raise ConfigError(f"admin.token is the placeholder {str(token)!r}: set a random one, e.g. "
                          "IDEMPROXY_ADMIN_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if len(str(token)) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"admin.token is {len(str(token))} characters: use {MIN_TOKEN_LENGTH} or more, e.g. "
                          "IDEMPROXY_ADMIN_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')")


def _check_egress(up: UpstreamSettings) -> None:
    """An upstream's proxy and TLS options, its TLS files loaded: a missing file or a bad PEM
    stops the start, not every call."""
    if up.proxy not in (FROM_ENVIRONMENT, ""):
        try:
            ProxyURL(up.proxy)
        except ValueError as exc:
            raise ConfigError(f"upstreams.{up.name}.proxy: {exc}") from None
    given = [name for name in TLS_OPTIONS if getattr(up, name)]
    if not given:
        return
    if urlsplit(up.url).scheme != "https":
        raise ConfigError(f"upstreams.{up.name}: {', '.join(given)} need an https url")
    if up.client_key and not up.client_cert:
        raise ConfigError(f"upstreams.{up.name}.client_key needs client_cert")
    try:
        tls_context(up.ca_file, up.client_cert, up.client_key)
    except OSError as exc:  # a missing file, or ssl.SSLError: not PEM, a key that is not the cert's
        raise ConfigError(f"upstreams.{up.name}: cannot load {', '.join(given)}: {exc}") from None
