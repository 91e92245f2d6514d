"""Configuration (docs/configuration.md): the TOML key names, IDEMPROXY_* overrides, errors, masking, `check`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import services
from idemproxy.proxy.config import ConfigError, Rule, load_settings

SPEC_EXAMPLE = """
[server]
host = "127.0.0.1"
port = 8787
max_request_bytes = 10485760

[store]
url = "sqlite:///idemproxy.db"
retention = "7d"

[upstreams.openai]
url = "https://api.openai.com"
on_ambiguous = "retry"              # or "quarantine"

[upstreams.tools]
url = "http://127.0.0.1:9000"
on_ambiguous = "quarantine"
idempotency_header = "Idempotency-Key"   # forward a derived key upstream
rules = [ { match = "GET /search/*", policy = "passthrough" } ]

[runs]                               # defaults for runs that do not register themselves
timeout_s = 60
grace_s = 30
max_restarts = 5
restart_window_s = 600
hook = "agent"

[hooks.agent]
command = ["python", "agent.py"]     # or: url = "https://...", secret = "..."

[supervisor]
enabled = true
interval_s = 1.0

[admin]
token = "change-me"
"""


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "idemproxy.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_spec_example_loads_with_its_key_names(tmp_path):
    with pytest.raises(ConfigError, match="admin.token is the placeholder 'change-me'"):
        load_settings(toml(tmp_path, SPEC_EXAMPLE), env={})  # its token is a placeholder, refused
    s = load_settings(toml(tmp_path, SPEC_EXAMPLE), env={"IDEMPROXY_ADMIN_TOKEN": "a-real-random-admin-token"})
    assert (s.server.host, s.server.port, s.server.max_request_bytes) == ("127.0.0.1", 8787, 10485760)
    assert (s.store.url, s.store.retention) == ("sqlite:///idemproxy.db", 7 * 86400)
    openai, tools = s.upstreams["openai"], s.upstreams["tools"]
    assert (openai.url, openai.on_ambiguous) == ("https://api.openai.com", "retry")
    assert (tools.url, tools.on_ambiguous, tools.idempotency_header) == \
        ("http://127.0.0.1:9000", "quarantine", "Idempotency-Key")
    assert tools.rules == (Rule("GET /search/*", "passthrough"),)
    r = s.runs
    assert (r.timeout_s, r.grace_s, r.max_restarts, r.restart_window_s, r.hook) == (60, 30, 5, 600, "agent")
    assert s.hooks["agent"].command == ("python", "agent.py")
    assert (s.supervisor.enabled, s.supervisor.interval_s) == (True, 1.0)
    assert str(s.admin.token) == "a-real-random-admin-token"


def test_http_hook_and_other_options_load(tmp_path):
    s = load_settings(toml(tmp_path, """
        [server]
        in_flight_wait = "250ms"
        max_record_bytes = 1024
        [store]
        url = "postgresql://idem:pw@db:5432/idem"
        retention = "36h"
        [upstreams.search]
        url = "http://search:8080/api"
        set_headers = { Authorization = "Bearer tool-secret" }
        ignore_fields = [ { match = "POST /v1/*", fields = ["metadata.ts"] } ]
        [runs]
        hook = "pager"
        [hooks.pager]
        url = "https://hooks.example/restart"
        secret = "hook-secret"
        [tenants]
        trusted_sources = ["10.0.0.0/8"]
    """), env={})
    assert s.server.in_flight_wait == 0.25 and s.server.max_record_bytes == 1024
    assert s.store.retention == 36 * 3600
    assert str(s.upstreams["search"].set_headers["Authorization"]) == "Bearer tool-secret"
    assert s.upstreams["search"].ignore_fields[0].fields == ("metadata.ts",)
    assert (s.hooks["pager"].url, str(s.hooks["pager"].secret)) == ("https://hooks.example/restart", "hook-secret")
    assert s.tenants.trusted_sources == ("10.0.0.0/8",)


def test_embedded_default_is_sqlite_with_openai_and_anthropic():
    s = load_settings(None, env={})
    assert s.store.url.startswith("sqlite:///") and not s.store.url.startswith("sqlite:////")  # working folder
    assert s.upstreams["openai"].url == "https://api.openai.com"
    assert s.upstreams["anthropic"].url == "https://api.anthropic.com"
    assert s.supervisor.enabled
    repo_default = Path(__file__).resolve().parents[2] / "config" / "default.toml"
    assert load_settings(repo_default, env={}) == s


def test_environment_overrides(tmp_path):
    env = {
        "IDEMPROXY_SERVER_PORT": "9999",
        "IDEMPROXY_SERVER_IN_FLIGHT_WAIT": "2s",
        "IDEMPROXY_STORE_URL": "sqlite:////tmp/other.db",
        "IDEMPROXY_STORE_RETENTION": "1d",
        "IDEMPROXY_UPSTREAMS_OPENAI_URL": "http://127.0.0.1:4000/v1",
        "IDEMPROXY_UPSTREAMS_MY_TOOL_URL": "http://tool:9000",  # a new upstream, its name with "_"
        "IDEMPROXY_UPSTREAMS_MY_TOOL_ON_AMBIGUOUS": "retry",
        "IDEMPROXY_SUPERVISOR_ENABLED": "false",
        "IDEMPROXY_ADMIN_TOKEN": "env-admin-token-0123",
        "IDEMPROXY_TENANTS_TRUSTED_SOURCES": '["10.1.0.0/16", "127.0.0.1/32"]',
        "IDEMPROXY_TEST_BACKENDS": "sqlite",  # not an option: other IDEMPROXY_* variables are left alone
        "OTHER": "x",
    }
    s = load_settings(toml(tmp_path, SPEC_EXAMPLE), env=env)
    assert s.server.port == 9999 and s.server.in_flight_wait == 2.0
    assert s.store.url == "sqlite:////tmp/other.db" and s.store.retention == 86400
    assert s.upstreams["openai"].url == "http://127.0.0.1:4000/v1"
    assert s.upstreams["openai"].on_ambiguous == "retry"  # the rest of the table stays
    assert (s.upstreams["my_tool"].url, s.upstreams["my_tool"].on_ambiguous) == ("http://tool:9000", "retry")
    assert s.supervisor.enabled is False
    assert str(s.admin.token) == "env-admin-token-0123"
    assert s.tenants.trusted_sources == ("10.1.0.0/16", "127.0.0.1/32")
    # CLI overrides come last
    s = load_settings(toml(tmp_path, SPEC_EXAMPLE), env=env, overrides={"server.port": 7000})
    assert s.server.port == 7000


def test_process_environment_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("IDEMPROXY_UPSTREAMS_ANTHROPIC_URL", "http://127.0.0.1:4001")
    monkeypatch.setenv("IDEMPROXY_ADMIN_TOKEN", "a-real-random-admin-token")  # the example's is a placeholder
    assert load_settings(toml(tmp_path, SPEC_EXAMPLE)).upstreams["anthropic"].url == "http://127.0.0.1:4001"


@pytest.mark.parametrize("text, where", [
    ("[server]\nbogus = 1\n", "bogus"),
    ("[sever]\nport = 1\n", "sever"),
    ('[upstreams.x]\nurl = "http://x"\ntimeout = 3\n', "timeout"),
    ('[upstreams.x]\nurl = "http://x"\non_ambiguous = "maybe"\n', "on_ambiguous"),
    ('[upstreams.x]\nurl = "ftp://x"\n', "url"),
    ('[upstreams.x]\nurl = "http://x"\nrules = [ { match = "GET /*", policy = "cache" } ]\n', "policy"),
    ('[upstreams.x]\nurl = "http://x"\nrules = [ { match = "GET /*", policy = "record", extra = 1 } ]\n', "extra"),
    ('[server]\nport = "eighty"\n', "port"),
    ('[server]\nin_flight_wait = "soon"\n', "in_flight_wait"),
    ('[hooks.a]\ncommand = ["x"]\nurl = "http://h"\n', "hooks.a"),
    ('[hooks.a]\nurl = "http://h"\nstandby = 1\n', "standby is for command hooks"),
    ('[hooks.a]\ncommand = ["x"]\nstandby = -1\n', "standby is for command hooks"),
    ('[hooks.a]\ncommand = ["x"]\nstandby = 65\n', "from 0 to 64"),
    ('[runs]\nhook = "missing"\n', "missing"),
    ("[server]\nworkers = 0\n", "workers"),
    ("not toml at all [", "cannot read"),
])
def test_bad_configuration_is_a_config_error(tmp_path, text, where):
    with pytest.raises(ConfigError, match=where):
        load_settings(toml(tmp_path, text), env={})


def test_unknown_option_from_the_cli_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        load_settings(toml(tmp_path, SPEC_EXAMPLE), env={}, overrides={"server.nope": 1})


def test_secrets_are_masked_in_repr(tmp_path):
    s = load_settings(toml(tmp_path, """
        [store]
        url = "postgresql://idem:db-password-42@db:5432/idem"
        [tenants]
        secret = "tenant-hmac-secret-42"
        [upstreams.tools]
        url = "http://tools:9000"
        set_headers = { Authorization = "Bearer injected-secret-42" }
        [hooks.h]
        url = "https://hooks.example/x"
        secret = "hook-secret-42"
        [admin]
        token = "admin-token-42-0123"
    """), env={})
    shown = repr(s) + str(s) + repr(s.store) + repr(s.tenants) + repr(s.upstreams) + repr(s.hooks) + repr(s.admin)
    for secret in ("db-password-42", "tenant-hmac-secret-42", "injected-secret-42", "hook-secret-42",
                   "admin-token-42-0123"):
        assert secret not in shown, secret
    assert "***" in shown and "db:5432" in shown  # masked, not dropped


# -- `idemproxy check` -----------------------------------------------------------------

def idemproxy(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("idemproxy")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "idemproxy.proxy.cli"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


@pytest.mark.slow  # idemproxy check as subprocesses
def test_check_exit_codes(tmp_path):
    good = toml(tmp_path, f"""
        [store]
        url = "sqlite:///{tmp_path}/ok.db"
        timeout = "0.5s"
        [upstreams.openai]
        url = "https://api.openai.com"
    """)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nbogus = 1\n")
    port = services.free_port()  # nothing listens there
    runs = {
        "good": (["check", "--config", str(good)], None),
        # an unreachable store named by the environment
        "no-dir": (["check", "--config", str(good)],
                   {"IDEMPROXY_STORE_URL": f"sqlite:///{tmp_path}/no/such/dir/x.db"}),
        # an unreachable store with a password in its URL
        "no-pg": (["check", "--config", str(good), "--store",
                   f"postgresql://idem:pg-secret-99@127.0.0.1:{port}/idem"], None),
        "bad-config": (["check", "--config", str(bad)], None),
    }
    with ThreadPoolExecutor(len(runs)) as pool:  # each waits out its store's timeout: in parallel
        done = dict(zip(runs, pool.map(lambda run: idemproxy(*run[0], env=run[1]), runs.values())))

    # no journal yet: unhealthy until `migrate` (or `serve`) makes one; then healthy
    assert done["good"].returncode == 1 and "idemproxy migrate" in done["good"].stderr
    assert idemproxy("migrate", "--config", str(good)).returncode == 0
    good = idemproxy("check", "--config", str(good))
    assert good.returncode == 0 and "ok" in good.stdout, good.stderr
    assert done["no-dir"].returncode == 1
    assert "NOT reachable" in done["no-dir"].stderr
    assert done["no-pg"].returncode == 1
    assert "pg-secret-99" not in done["no-pg"].stdout + done["no-pg"].stderr
    assert done["bad-config"].returncode == 2 and "bogus" in done["bad-config"].stderr


def test_the_shown_configuration_is_toml_whatever_its_strings_hold(tmp_path):
    """``idemproxy config`` prints the effective settings as TOML: a value with a newline, a
    quote, a backslash or a control character, an inline table's odd key, and an upstream whose
    name is not a bare key all read back as they were (the newline once printed a broken file)."""
    import tomllib

    from idemproxy.proxy.config_view import effective, to_toml
    odd = 'two\nlines, a "quote", a \\ and \x7f\x01\ttab'
    path = tmp_path / "odd.toml"
    path.write_text(textwrap.dedent(f"""
        [server]
        host = {to_toml_string(odd)}
        [upstreams."tools.v2"]
        url = "http://tools.internal"
        set_headers = {{ "x-note \\"quoted\\"" = {to_toml_string(odd)} }}
    """))
    settings = load_settings(path, env={})
    shown = tomllib.loads(to_toml(effective(settings)))
    assert shown["server"]["host"] == odd
    assert shown["upstreams"]["tools.v2"]["set_headers"] == {'x-note "quoted"': "***"}  # a secret: masked


def to_toml_string(value: str) -> str:
    """A TOML basic string written by hand, independent of the code under test."""
    return '"' + "".join(ch if ch.isprintable() and ch not in '"\\' else f"\\u{ord(ch):04x}" for ch in value) + '"'
