"""The idemproxy command as a person meets it, run as a real subprocess:
one clear line and a non-zero exit for every configuration or start-up failure, never a
traceback; --version; ``config``; warnings for unknown variables; read-only commands leave
no journal behind; ISO times with --json."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from pathlib import Path

import orjson
import pytest

import idemproxy.proxy as idemproxy_package
import services
from run_cli import idemproxy

pytestmark = pytest.mark.slow


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
    one_clear_line(result, f"store sqlite:///{tmp_path}/j.db: schema missing", "no journal at", "idemproxy migrate")
    assert result.returncode == 1
    one_clear_line(idemproxy("check", "--store", f"sqlite:///{tmp_path}/no/dir/j.db", cwd=tmp_path),
                   f"sqlite:///{tmp_path}/no/dir/j.db", "not a folder the proxy can write in")
    one_clear_line(idemproxy("runs", "list", "--store", "sqlite:///j.db", cwd=tmp_path), "no journal at j.db",
                   "idemproxy migrate")
    for command in (["runs", "list"], ["runs", "show", "r1"], ["config"]):
        idemproxy(*command, "--store", "sqlite:///j.db", cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_version_and_the_effective_configuration(tmp_path):
    released = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
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


# -- start-up, `check`, `migrate`, and the command line ------------------------------------------

def _postgres(database: str, sql: str, *args) -> list:
    import asyncpg

    async def query():
        conn = await asyncpg.connect(services.postgres_url().rsplit("/", 1)[0] + f"/{database}")
        try:
            return [tuple(row) for row in await conn.fetch(sql, *args)]
        finally:
            await conn.close()
    return asyncio.run(query())


PG_OBJECTS = """
SELECT n.nspname::text, c.relname::text, c.relkind::text FROM pg_class c
    JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'
UNION ALL SELECT n.nspname::text, t.typname::text, 'type' FROM pg_type t
    JOIN pg_namespace n ON n.oid = t.typnamespace
    WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%'
UNION ALL SELECT nspname::text, '', 'schema' FROM pg_namespace
    WHERE nspname NOT LIKE 'pg_%' AND nspname <> 'information_schema'
ORDER BY 1, 2, 3"""


@pytest.fixture
def empty_store(tmp_path):
    """``(url, what_is_there)`` of a fresh, empty store of each kind: a folder, a new
    PostgreSQL database, a Redis prefix nobody uses; ``what_is_there()`` lists it all."""
    made: list = []

    def make(backend: str):
        if backend == "sqlite":
            folder = tmp_path / "store"
            folder.mkdir()
            files = lambda: sorted((p.name, p.stat().st_size) for p in folder.iterdir())  # noqa: E731
            return f"sqlite:///{folder}/journal.db", files
        if backend == "postgres":
            database = f"idem_check_{uuid.uuid4().hex[:8]}"
            _postgres("postgres", f"CREATE DATABASE {database}")
            made.append(lambda: _postgres("postgres", f"DROP DATABASE {database} WITH (FORCE)"))
            base = services.postgres_url().rsplit("/", 1)[0]
            return f"{base}/{database}", lambda: _postgres(database, PG_OBJECTS)
        import redis
        prefix = f"check{uuid.uuid4().hex[:8]}:"
        client = redis.Redis.from_url(services.redis_url())
        made.append(client.close)
        return (f"{services.redis_url()}?prefix={prefix}",
                lambda: sorted(client.scan_iter(match=prefix + "*")) + [client.pubsub_numsub(prefix + "changed")])
    yield make
    for undo in made:
        undo()


@pytest.mark.parametrize("backend", ["sqlite", "postgres", "redis"])
def test_check_writes_nothing_on_any_store_and_migrate_makes_the_schema(backend, empty_store, tmp_path):
    url, what_is_there = empty_store(backend)
    before = what_is_there()
    checked = idemproxy("check", "--store", url, cwd=tmp_path)
    assert what_is_there() == before, "check wrote to the store"
    if backend == "redis":  # nothing to migrate: healthy as it is
        assert checked.returncode == 0 and "ok" in checked.stdout, checked.stderr
    else:
        one_clear_line(checked, "schema missing or out of date", "run `idemproxy migrate`")
        assert checked.returncode == 1
    migrated = idemproxy("migrate", "--store", url, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert ("up to date" if backend == "redis" else "migrated") in migrated.stdout
    if backend == "postgres":  # the tables and types check would have made before
        made = what_is_there()
        assert sum(kind == "r" for _, _, kind in made) >= 7 and sum(kind == "type" for *_, kind in made) >= 2
    after = what_is_there()
    healthy = idemproxy("check", "--store", url, cwd=tmp_path)
    assert healthy.returncode == 0 and "ok" in healthy.stdout, healthy.stderr
    assert what_is_there() == after
    again = idemproxy("migrate", "--store", url, cwd=tmp_path)
    assert again.returncode == 0 and "up to date" in again.stdout


def test_check_leaves_an_empty_or_older_sqlite_file_as_it_is(tmp_path):
    empty = tmp_path / "empty.db"
    empty.touch()
    one_clear_line(idemproxy("check", "--store", f"sqlite:///{empty}", cwd=tmp_path), "no idemproxy tables",
                   "idemproxy migrate")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"] and empty.stat().st_size == 0
    older = tmp_path / "older.db"
    with sqlite3.connect(older) as conn:
        conn.execute("CREATE TABLE journal (kid TEXT)")
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    data = older.read_bytes()
    one_clear_line(idemproxy("check", "--store", f"sqlite:///{older}", cwd=tmp_path), "schema version 1",
                   "idemproxy migrate")
    assert older.read_bytes() == data


@pytest.mark.parametrize("url, says", [
    ("sqlite:////nonexistent-folder/j.db", "No such file or directory"),
    ("redis://127.0.0.1:6379/4096", "DB index is out of range"),
    ("postgresql://postgres@127.0.0.1:5432/no_such_db_here", 'database "no_such_db_here" does not exist'),
])
@pytest.mark.parametrize("command", [["serve"], ["serve", "--workers", "2"], ["supervise"], ["migrate"]])
def test_permanent_store_errors_stop_the_start_at_once(command, url, says, tmp_path):
    started = time.monotonic()
    result = idemproxy(*command, "--store", url, cwd=tmp_path, timeout=30)
    assert time.monotonic() - started < 5, "retried a store that refused its configuration"
    one_clear_line(result, says)
    assert result.returncode == 1 and "attempt 2/" not in result.stderr


def test_a_store_not_reachable_yet_is_retried(tmp_path):
    port = services.free_port()  # nothing listens: connection refused, as while a server starts
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "idemproxy.proxy.cli", "serve", "--port", "0", "--store",
                               f"postgresql://postgres@127.0.0.1:{port}/db"], cwd=tmp_path, stdout=log, stderr=log,
                              env={k: v for k, v in os.environ.items() if not k.startswith("IDEMPROXY_")})
    try:
        deadline = time.monotonic() + 20
        while "attempt 3/8" not in (tmp_path / "serve.log").read_text() and time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        assert "store not reachable (attempt 3/8" in (tmp_path / "serve.log").read_text()
        assert server.poll() is None  # still trying
    finally:
        server.terminate()
        server.wait(20)
        log.close()


def test_command_line_and_configuration_errors_exit_2_in_one_line(tmp_path):
    result = idemproxy("--log-level", "nonsense", "check", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--log-level: invalid choice: 'NONSENSE'" in result.stderr
    for command in ("serve", "check", "migrate", "supervise"):
        one_clear_line(idemproxy(command, "--set", "server.port=99999", cwd=tmp_path),
                       "server.port must be from 0 (any free port) to 65535, got 99999")
        one_clear_line(idemproxy(command, "--set", "admin.token=x", cwd=tmp_path), "admin.token is 1 characters")
        one_clear_line(idemproxy(command, "--set", "admin.token=change-me", cwd=tmp_path), "placeholder")
    for command in ("serve", "check"):
        for args in (["--set", "server.port=99999"], ["--store", "mysql://x/y"], ["--set", "server.bogus=1"]):
            assert idemproxy(command, *args, cwd=tmp_path).returncode == 2, (command, args)
    one_clear_line(idemproxy("serve", "--port", "70000", cwd=tmp_path), "70000 is not a port")
    (tmp_path / "hook.toml").write_text('[hooks.agent]\ncommand = "python agent.py"\n[runs]\nhook = "agent"\n')
    hook = idemproxy("check", "-c", "hook.toml", cwd=tmp_path)
    one_clear_line(hook, "hooks.agent.command is one string", "command = ['python', 'agent.py']")
    assert hook.returncode == 2


def test_help_says_what_each_command_does(tmp_path):
    top = idemproxy("--help", cwd=tmp_path)
    assert top.returncode == 0
    assert "replays them when a restarted agent repeats them, and supervises their runs." in top.stdout
    assert "exit codes" in top.stdout and "2  the command line or the configuration is invalid" in top.stdout
    for command in ("serve", "migrate", "check", "config", "supervise", "runs", "journal"):
        assert f"    {command} " in top.stdout
    for argv, says in ((["serve"], "bring the store's schema up to date, then listen"),
                       (["check"], "without writing to it"), (["migrate"], "nothing to do on Redis"),
                       (["runs"], "Runs as the store holds them"), (["journal"], "any unique start of one"),
                       (["journal", "resolve"], "Decide a quarantined entry"), (["runs", "revive"], "dead run")):
        shown = idemproxy(*argv, "--help", cwd=tmp_path)
        assert shown.returncode == 0 and says in " ".join(shown.stdout.split()), (argv, shown.stdout)


def test_runs_and_journal_commands_print_only_their_output(tmp_path):
    store = f"sqlite:///{tmp_path}/j.db"
    assert idemproxy("migrate", "--store", store, cwd=tmp_path).returncode == 0
    for argv, out in ((["runs", "list"], "no runs\n"), (["journal", "list"], "no journal entries\n")):
        result = idemproxy(*argv, "--store", store, cwd=tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (0, out, ""), argv
    talkative = idemproxy("--log-level", "info", "runs", "list", "--store", store, cwd=tmp_path)
    assert "INFO idemproxy.store" in talkative.stderr  # asked for
