"""The idemproxy command as a person meets it (issue 11 item 6), run as a real subprocess:
one clear line and a non-zero exit for every configuration or start-up failure, never a
traceback; --version; ``config``; warnings for unknown variables; read-only commands leave
no journal behind; ISO times with --json."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import orjson
import pytest

import idemproxy.proxy as idemproxy_package

pytestmark = pytest.mark.slow


def idemproxy(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60):
    base = {k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")}
    return subprocess.run([sys.executable, "-m", "idemproxy.proxy.cli", *args], cwd=cwd, timeout=timeout,
                          capture_output=True, text=True, env={**base, **(env or {})})


def one_clear_line(result, *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, result.stderr


@pytest.mark.parametrize("command", ["serve", "check"])
def test_failures_are_one_line_without_a_traceback(command, tmp_path):
    (tmp_path / "nourl.toml").write_text('[upstreams.tools]\nkind = "tool"\n')
    one_clear_line(idemproxy(command, "-c", "nourl.toml", cwd=tmp_path), "[upstreams.tools] needs url")
    one_clear_line(idemproxy(command, "--store", "mysql://x/y", cwd=tmp_path), "unsupported store URL scheme")
    missing = idemproxy(command, "--store", "postgresql://postgres@127.0.0.1:5432/no_such_db_here",
                        cwd=tmp_path, env={"IDEMPROXY_STORE_TIMEOUT": "2s"}, timeout=120)
    if command == "check":  # serve retries with backoff first (a store that is starting up)
        one_clear_line(missing, 'database "no_such_db_here" does not exist')


def test_serve_on_a_port_in_use_says_so(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_clear_line(idemproxy("serve", "--port", str(port), "--store", f"sqlite:///{tmp_path}/j.db",
                                 cwd=tmp_path), f"cannot listen on 127.0.0.1:{port}", "in use")


def test_check_names_the_store_as_written_and_creates_no_journal(tmp_path):
    result = idemproxy("check", "--store", f"sqlite:///{tmp_path}/j.db", cwd=tmp_path)
    assert result.returncode == 0 and f"store sqlite:///{tmp_path}/j.db: ok (no journal yet" in result.stdout
    one_clear_line(idemproxy("check", "--store", f"sqlite:///{tmp_path}/no/dir/j.db", cwd=tmp_path),
                   f"sqlite:///{tmp_path}/no/dir/j.db", "not a folder the proxy can write in")
    one_clear_line(idemproxy("runs", "list", "--store", "sqlite:///j.db", cwd=tmp_path), "no journal at j.db")
    for command in (["runs", "list"], ["runs", "show", "r1"], ["config"]):
        idemproxy(*command, "--store", "sqlite:///j.db", cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_version_and_the_effective_configuration(tmp_path):
    released = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    version = idemproxy("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout == f"idemproxy {released['project']['version']}\n"
    assert idemproxy_package.__version__ == released["project"]["version"]
    shown = idemproxy("config", "--store", "postgresql://u:hunter2@db/x", "--set", "admin.token=sesame-open-sesame",
                      cwd=tmp_path, env={"IDEMPROXY_SERVER_PORT": "9999", "IDEMPROXY_SERVR_HOST": "typo"})
    assert shown.returncode == 0, shown.stderr
    assert "port = 9999" in shown.stdout and 'url = "postgresql://u:***@db/x"' in shown.stdout
    assert 'token = "***"' in shown.stdout and "hunter2" not in shown.stdout and "sesame" not in shown.stdout
    assert "IDEMPROXY_SERVR_HOST is not an idemproxy option" in shown.stderr
    assert "IDEMPROXY_SERVER_PORT" not in shown.stderr
    tables = orjson.loads(idemproxy("config", "--json", cwd=tmp_path).stdout)
    assert tables["server"]["log_format"] == "text" and tables["upstreams"]["openai"]["url"]


def test_json_output_gives_iso_times(tmp_path, proxy_process):
    sections = {"server": {"host": "127.0.0.1"}, "store": {"url": f"sqlite:///{tmp_path}/j.db"},
                "supervisor": {"enabled": False}, "tenants": {"runs": "shared"}}
    proxy = proxy_process(sections)
    urllib.request.urlopen(urllib.request.Request(f"{proxy.url}/runs/iso-run", data=b"{}", method="POST",
                                                  headers={"Content-Type": "application/json"}))
    shown = idemproxy("runs", "show", "iso-run", "--json", "--store", f"sqlite:///{tmp_path}/j.db", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    body = orjson.loads(shown.stdout)
    assert body["created_at"].endswith("Z") and body["last_seen"][:2] == "20"
