"""The access log (docs/operations.md): one line per request, durations to the µs, and with
``[server] log_format = "json"`` one JSON object per line with what the proxy did."""

from __future__ import annotations

import logging
import re

import orjson
import pytest
from aiohttp.test_utils import TestServer

import services
from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy import server
from idemproxy.proxy.observability.access_log import access_logger
from idemproxy.proxy.cli.serving import build_app
from idemproxy.proxy.config import ConfigError, load_settings
from idemproxy.proxy.data_plane import open_planes


@pytest.fixture
async def logged_proxy(tmp_path, provider, caplog):
    """Start a proxy whose access log is on, in ``log_format``; its lines land in caplog."""
    started: list[TestServer] = []

    async def start(log_format: str) -> str:
        sections = proxy_sections(provider.url, f"sqlite:///{tmp_path / 'j.db'}",
                                  server={"access_log": True, "log_format": log_format})
        settings = load_settings(write_config(tmp_path / "p.toml", sections), env={})
        app = build_app(settings, supervise=False)
        test_server = TestServer(app, host="127.0.0.1", port=services.free_port())
        await test_server.start_server(access_log_class=access_logger(settings),
                                       access_log=server.access_log)
        open_planes(test_server.runner)
        started.append(test_server)
        return str(test_server.make_url("")).rstrip("/")

    caplog.set_level(logging.INFO, logger="idemproxy.access")
    yield start
    for test_server in started:
        await test_server.close()


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "idemproxy.access"]


CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


async def test_json_lines_say_what_the_proxy_did(logged_proxy, http, caplog):
    url = await logged_proxy("json")
    headers = {"Idem-Run": "run-log", "Idem-Epoch": "0"}
    for _ in range(2):  # recorded, then (a new epoch) replayed
        async with http.post(f"{url}/openai/v1/chat/completions", json=CHAT, headers=headers) as resp:
            assert resp.status == 200
        headers = {"Idem-Run": "run-log", "Idem-Epoch": "1"}
    recorded, replayed = (orjson.loads(line) for line in access_lines(caplog)[-2:])
    assert recorded["outcome"] == "recorded" and replayed["outcome"] == "replayed"
    assert recorded["run"] == replayed["run"] == "run-log"
    assert (recorded["epoch"], replayed["epoch"]) == (0, 1)
    assert recorded["kid"] == replayed["kid"] and len(recorded["kid"]) == 64
    assert recorded["key_kind"] == "derived" and recorded["upstream"] == "openai"
    assert recorded["model"] == replayed["model"] == "gpt-4o-mini"
    assert (replayed["input_tokens"], replayed["output_tokens"]) == (10, 5)
    assert recorded["upstream_ms"] > 0 and replayed["upstream_ms"] is None
    for line in (recorded, replayed):
        assert line["proxy_ms"] > 0 and line["store_ms"] > 0 and line["ms"] >= line["proxy_ms"]
        assert line["status"] == 200 and line["method"] == "POST"


async def test_text_lines_show_sub_millisecond_durations(logged_proxy, http, caplog):
    url = await logged_proxy("text")
    async with http.get(f"{url}/openai/v1/models") as resp:
        await resp.read()
    line = access_lines(caplog)[-1]
    assert re.search(r" GET /openai/v1/models \d+ passthrough \d+\.\d{3}ms$", line), line


def test_an_unknown_log_format_is_a_configuration_error(tmp_path):
    with pytest.raises(ConfigError, match="log_format"):
        load_settings(env={"IDEMPROXY_SERVER_LOG_FORMAT": "xml"})


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_a_run_token_in_a_path_is_never_logged(logged_proxy, http, caplog, log_format):
    url = await logged_proxy(log_format)
    async with http.post(f"{url}/runs/quiet", json={"timeout_s": 30}) as r:
        run = await r.json()
    async with http.post(f"{run['base_url']}/openai/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    lines = access_lines(caplog)
    assert not any(run["token"] in line for line in lines)
    assert any("/runs/quiet/epochs/0/cap/***/openai/v1/chat/completions" in line for line in lines)
