"""What the proxy shows, and to whom: the unauthenticated endpoints
name no path, URL or host; URLs are masked wherever they are shown; the SQLite journal's
files are private to their owner."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from config_files import write_config
from idemproxy.proxy.cli.store import check
from idemproxy.proxy.config import load_settings, mask_url
from idemproxy.proxy.store.sqlite import sqlite_store
from rawhttp import problem

CHAT = "/openai/v1/chat/completions"


# -- unauthenticated endpoints -----------------------------------------------------------------

async def test_health_ready_and_metrics_name_no_path_url_or_host(make_proxy, store_url, provider, http, tmp_path):
    proxy = await make_proxy(store_url)
    async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []},
                         headers={"Authorization": "Bearer sk-x", "Idempotency-Key": "k"}) as r:
        assert r.status == 200
    shown = b""
    for path in ("/healthz", "/readyz", "/metrics"):
        async with http.get(proxy.url + path) as r:
            assert r.status == 200
            shown += await r.read()
    async with http.get(proxy.url + "/readyz") as r:
        ready = await r.json()
    assert ready["status"] == "ready" and ready["store"] in ("sqlite", "postgresql", "redis")
    assert ready["durability"]
    for leak in (str(tmp_path), "127.0.0.1", "localhost", "://", "journal-", store_url):
        assert leak.encode() not in shown, leak


async def test_a_store_that_fails_readyz_is_named_in_the_log_only(make_proxy, sqlite_url, http, tmp_path, caplog):
    proxy = await make_proxy(sqlite_url)
    await proxy.store.aclose()  # every store call now fails
    with caplog.at_level(logging.WARNING, logger="idemproxy"):
        async with http.get(proxy.url + "/readyz") as r:
            refused = await problem(r, "store-unavailable", 503)
    assert str(tmp_path) not in refused["detail"] and "closed" not in refused["detail"]
    assert any("store is closed" in rec.getMessage() for rec in caplog.records)


# -- masked URLs -------------------------------------------------------------------------------

@pytest.mark.parametrize("url, kept", [
    ("postgresql://idem:s3cret-pw@db.internal:5432/idem?sslmode=require&sslpassword=s3cret-ssl"
     "&options=-c%20password%3Ds3cret-opt&passfile=/home/s3cret-passfile&sslkey=/etc/s3cret-key.pem&schema=a",
     ["postgresql://idem:***@db.internal:5432/idem", "sslmode=require", "schema=a"]),
    ("redis://:s3cret-pw@[::1]:6379/0?prefix=idem:&password=s3cret-q", ["redis://:***@[::1]:6379/0", "prefix=idem:"]),
    ("https://tools.internal/v1?api_key=s3cret-a&Access_Token=s3cret-b;X-Amz-Signature=s3cret-c&q=1"
     "#access_token=s3cret-d", ["https://tools.internal/v1?", "q=1"]),
    ("postgresql://u:pw@h/db?pass%77ord=s3cret-encoded-name", ["postgresql://u:***@h/db?"]),
    ("sqlite:///var/lib/idemproxy/journal.db", ["sqlite:///var/lib/idemproxy/journal.db"]),
    ("http://[::1:s3cret", []),  # not a URL urlsplit can read: nothing of it is shown
])
def test_mask_url_hides_every_secret_and_keeps_the_rest(url, kept):
    masked = mask_url(url)
    assert "s3cret" not in masked and "pw@" not in masked, masked
    for part in kept:
        assert part in masked, masked


def test_settings_repr_masks_every_url_and_secret(tmp_path):
    path = write_config(tmp_path / "c.toml", {
        "store": {"url": "postgresql://u:s3cret-1@h/db?sslpassword=s3cret-2"},
        "tenants": {"secret": "s3cret-3"},
        "upstreams.tools": {"url": "https://t.internal/?token=s3cret-4", "set_headers": {"Authorization": "s3cret-5"}},
        "hooks.agent": {"url": "https://hooks.internal/restart?sig=s3cret-6", "secret": "s3cret-7"},
        "supervisor": {"proxy_url": "http://user:s3cret-8@proxy:8787"},
        "admin": {"token": "s3cret-9-admin-token"},
    })
    shown = repr(load_settings(path, env={}))
    assert "s3cret" not in shown, shown
    assert "hooks.internal/restart?sig=***" in shown and "proxy_url='http://user:***@proxy:8787'" in shown


@pytest.mark.parametrize("url, shown", [  # nothing listens on port 1
    ("redis://:s3cret-pw@127.0.0.1:1/0?password=s3cret-q", "redis://:***@127.0.0.1:1/0?password=***"),
    ("postgresql://u:s3cret-pw@127.0.0.1:1/db?sslpassword=s3cret-q&options=-c%20password%3Ds3cret-o",
     "postgresql://u:***@127.0.0.1:1/db?sslpassword=***&options=***"),
])
def test_check_prints_and_logs_masked_urls(capsys, caplog, url, shown):
    settings = load_settings(None, env={}, overrides={"store.url": url, "store.timeout": "0.2s"})
    with caplog.at_level(logging.INFO, logger="idemproxy"):
        assert check(settings) == 1
    out = capsys.readouterr()
    assert shown in out.err
    assert "s3cret" not in out.out + out.err + caplog.text


# -- private store files -----------------------------------------------------------------------

def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test (SQLite's own files follow it), then restore it."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


async def test_a_new_journal_and_its_wal_and_shm_are_0600_whatever_the_umask(tmp_path, umask):
    umask(0)  # SQLite alone would create all three 0644 (0666 & ~0 is what it asks for, less its own)
    path = tmp_path / "journal.db"
    store = sqlite_store(str(path))
    await store.open()
    try:
        await store.secret("tenant-hmac", b"k" * 32)  # a write: the -wal and -shm exist from now on
        files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        assert all(f.exists() for f in files)
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    finally:
        await store.aclose()


async def test_an_existing_journal_loses_the_permissions_of_others_only(tmp_path, umask, caplog):
    path = tmp_path / "journal.db"
    store = sqlite_store(str(path))
    await store.open()
    await store.secret("tenant-hmac", b"k" * 32)
    await store.aclose()
    path.chmod(0o664)
    Path(f"{path}-wal").write_bytes(b"")
    Path(f"{path}-wal").chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="idemproxy.store"):
        store = sqlite_store(str(path))
        await store.open()
    try:
        assert await store.secret("tenant-hmac", b"other") == b"k" * 32
        assert mode(path) == 0o660  # owner and group as they were
        assert {mode(Path(f"{path}{suffix}")) & 0o007 for suffix in ("-wal", "-shm")} == {0}
        assert "was open to every user" in caplog.text
    finally:
        await store.aclose()


async def test_the_proxys_journal_is_private(make_proxy, tmp_path, umask, http):
    umask(0o002)
    path = tmp_path / "private.db"
    proxy = await make_proxy(f"sqlite:///{path}")
    async with http.post(proxy.url + CHAT, json={"model": "m", "messages": []},
                         headers={"Authorization": "Bearer sk-x", "Idempotency-Key": "k"}) as r:
        assert r.status == 200
    assert {mode(f) for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm"))} == {0o600}
