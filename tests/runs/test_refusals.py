"""Refusals in a run's timeline (docs/operations.md): the 409, 412, 422 and 502 answers a
run's calls got from the proxy are counted on the run in the store (every backend), the last
20 kept, and shown by the admin API, ``idemproxy runs show`` and the console — never a body,
a credential or a query string. Real proxies, real stores, the fake provider upstream.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from html import unescape

import aiohttp
import pytest

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.runs.refusals import KEEP

ADMIN = {"Authorization": "Bearer test-admin-token"}
SECRET = "sk-live-never-kept"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _post(http, url: str, **kwargs) -> int:
    async with http.post(url, **kwargs) as resp:
        await resp.read()
        return resp.status


async def _shown(http, proxy, run: str) -> dict:
    async with http.get(f"{proxy.url}/admin/runs/{run}", headers=ADMIN) as resp:
        assert resp.status == 200
        return json.loads(await resp.text())


async def test_each_kind_of_refusal_is_kept_on_its_run_without_secrets(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, **{"upstreams.gone": {"url": "http://127.0.0.1:9", "kind": "tool"}})
    base, auth = f"{proxy.url}/runs/r", {"Authorization": f"Bearer {SECRET}"}
    assert await _post(http, f"{proxy.url}/runs/r", json={}) == 201
    chat = f"{base}/epochs/0/openai/v1/chat/completions?api-key={SECRET}"
    assert await _post(http, chat, json=CHAT, headers=auth) == 200
    # 422: the same Idempotency-Key with another body
    tool = f"{base}/epochs/0/tools/charge"
    assert await _post(http, tool, json={"amount": 1}, headers={"Idempotency-Key": "k1", **auth}) == 200
    assert await _post(http, tool, json={"amount": 2}, headers={"Idempotency-Key": "k1", **auth}) == 422
    # 502: the upstream cannot be reached
    assert await _post(http, f"{base}/epochs/0/gone/send", json={}, headers={"Idempotency-Key": "k2"}) == 502
    # 409: an epoch further than the next one
    assert await _post(http, f"{base}/epochs/5/openai/v1/chat/completions", json=CHAT, headers=auth) == 409
    # 412: a zombie of epoch 0 after the agent's next attempt
    assert await _post(http, f"{proxy.url}/runs/r/attempts") == 201
    assert await _post(http, chat, json=CHAT, headers=auth) == 412
    assert await _post(http, f"{proxy.url}/runs/other/epochs/0/openai/v1/chat/completions",
                       json=CHAT, headers=auth) == 200  # another run's count is its own

    shown = await _shown(http, proxy, "r")
    refusals = shown["refusals"]
    assert refusals["count"] == 4
    assert [(r["status"], r["type"], r["epoch"], r["upstream"], r["method"]) for r in refusals["recent"]] == [
        (422, "key-reused", 0, "tools", "POST"), (502, "upstream-unavailable", 0, "gone", "POST"),
        (409, "epoch-ahead", 5, "openai", "POST"), (412, "stale-epoch", 0, "openai", "POST")]
    assert refusals["recent"][3]["path"] == "/v1/chat/completions"  # no query string
    assert SECRET not in json.dumps(shown) and "amount" not in json.dumps(refusals)
    assert (await _shown(http, proxy, "other"))["refusals"] == {"count": 0, "recent": []}


async def test_a_run_keeps_the_last_refusals_and_counts_them_all(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    assert await _post(http, f"{proxy.url}/runs/z", json={}) == 201
    assert await _post(http, f"{proxy.url}/runs/z/attempts") == 201
    zombie = f"{proxy.url}/runs/z/epochs/0/tools/step"
    for n in range(KEEP + 5):
        assert await _post(http, zombie, json={"n": n}, headers={"Idempotency-Key": f"s{n}"}) == 412
    refusals = (await _shown(http, proxy, "z"))["refusals"]
    assert refusals["count"] == KEEP + 5 and len(refusals["recent"]) == KEEP
    assert refusals["recent"][0]["at"] <= refusals["recent"][-1]["at"]


async def test_the_console_shows_refusals_under_their_attempt(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    assert await _post(http, f"{proxy.url}/runs/c", json={}) == 201
    assert await _post(http, f"{proxy.url}/runs/c/epochs/0/tools/a", json={}) == 200
    assert await _post(http, f"{proxy.url}/runs/c/attempts") == 201
    assert await _post(http, f"{proxy.url}/runs/c/epochs/0/tools/b", json={}) == 412
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar) as browser:
        async with browser.get(f"{proxy.url}/ui/login") as resp:
            form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
        async with browser.post(f"{proxy.url}/ui/login", data={"form": form, "token": "test-admin-token"}) as resp:
            assert resp.status == 200
        async with browser.get(f"{proxy.url}/ui/runs/c") as resp:
            page = unescape(await resp.text())
    assert re.search(r'<dd id="refused">1', page)
    table = page.split('id="refused-0"', 1)[1].split("</table>", 1)[0]
    assert "412 stale-epoch" in table and "POST /b" in table and "Superseded attempt" in table
    assert 'id="refused-1"' not in page


@pytest.mark.slow  # a CLI subprocess
async def test_runs_show_lists_the_refused_calls(make_proxy, sqlite_url, provider, http, tmp_path):
    proxy = await make_proxy(sqlite_url)
    assert await _post(http, f"{proxy.url}/runs/s", json={}) == 201
    assert await _post(http, f"{proxy.url}/runs/s/attempts") == 201
    assert await _post(http, f"{proxy.url}/runs/s/epochs/0/tools/late", json={}) == 412
    config = write_config(tmp_path / "cli.toml", proxy_sections(provider.url, sqlite_url))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy.proxy.cli", "--log-level", "WARNING", "runs", "show", "s",
        "--config", str(config), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    listed = out.decode().split("refused calls (1):", 1)[1]
    assert re.search(r"\n\S.*\s0\s+412\s+stale-epoch\s+tools\s+POST\s+/late\s+-", listed), listed
