"""Finding and fixing without the console: the 502 names its entry,
``idemproxy journal list|show|find``, the agent's key in ``runs show``, and reviving a dead
run through the admin API and the CLI. Real proxy traffic; the CLI runs in a thread as a
person would type it, over the same store."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import sys
import time

import pytest

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.cli import main
from idemproxy.proxy.store.model import RunState, Scope

PROBLEM = "https://idemproxy.dev/problems/"
ADMIN = {"Authorization": "Bearer test-admin-token"}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def make_cli(provider, store_url, tmp_path, capsys):
    """``cli = make_cli(**sections)``, then ``await cli("journal", "list")`` -> (exit code,
    stdout, stderr): the command run in-process, configured like the proxy under test."""
    def make(**extra: dict) -> object:
        config = write_config(tmp_path / "cli.toml", proxy_sections(provider.url, store_url, **extra))

        async def run(*argv: str) -> tuple[int, str, str]:
            capsys.readouterr()
            code = await asyncio.to_thread(main, ["--log-level", "WARNING", *argv, "--config", str(config)])
            out, err = capsys.readouterr()
            return code, out, err
        return run
    return make


async def _send(http, url: str, key: str, status: str = "200") -> tuple[int, dict]:
    async with http.post(url, json={"to": "bob"}, headers={"Idempotency-Key": key, "X-Fake-Status": status}) as r:
        return r.status, await r.json(content_type=None)


async def test_the_outcome_unknown_problem_names_the_entry_and_how_to_resolve_it(make_proxy, store_url, http,
                                                                                 provider):
    proxy = await make_proxy(store_url)
    url = f"{proxy.url}/runs/q/tools/send"
    assert (await _send(http, url, "email-1", status="503"))[0] == 503  # quarantined: upstream may have sent
    status, problem = await _send(http, url, "email-1")
    assert status == 502 and problem["type"] == PROBLEM + "outcome-unknown"
    [entry] = await proxy.store.journal.search(key="key:email-1")
    assert problem["kid"] == entry.kid
    assert problem["resolve"]["command"] == f"idemproxy journal resolve {entry.kid} --retry"
    assert problem["resolve"]["endpoint"] == f"POST /admin/journal/{entry.kid}/resolve"
    assert entry.kid in problem["detail"] and "idemproxy journal resolve" in problem["detail"]
    method, path = problem["resolve"]["endpoint"].split(" ")  # what it names works
    async with http.request(method, proxy.url + path, json={"action": "retry"}, headers=ADMIN) as resp:
        assert resp.status == 200
    assert (await _send(http, url, "email-1"))[0] == 200
    assert provider.calls["tool:send"] == 2


async def test_journal_list_show_and_find_over_real_traffic(make_proxy, store_url, http, make_cli):
    proxy = await make_proxy(store_url, tenants={"trusted_sources": ["127.0.0.1/32"]})
    cli = make_cli()
    base = f"{proxy.url}/runs/shop/epochs/0"
    assert (await _send(http, f"{base}/tools/send", "email-1"))[0] == 200
    assert (await _send(http, f"{base}/tools/charge", "card-9", status="503"))[0] == 503  # quarantined
    async with http.post(f"{base}/openai/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        await resp.read()
    async with http.post(f"{proxy.url}/runs/other/tools/send", json={"to": "ann"},
                         headers={"Idempotency-Key": "email-1", "Idem-Tenant": "acme"}) as resp:
        assert resp.status == 200

    code, out, err = await cli("journal", "list", "--state", "quarantined")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["KID", "KEY", "STATE", "RUN"] and len(rows) == 1
    assert rows[0].split()[1:4] == ["card-9", "unknown", "shop"]
    kid = rows[0].split()[0]
    code, out, _ = await cli("journal", "list", "--json")
    listed = json.loads(out)["entries"]
    assert len(listed) == 4 and [e["run"] for e in listed][0] == "other"  # newest first
    assert {e["agent_key"] for e in listed} == {"email-1", "card-9", None}
    [full] = [e["kid"] for e in listed if e["agent_key"] == "card-9"]
    assert len(kid) == 12 and full.startswith(kid)  # tables show the start of a kid; --json all of it

    code, out, err = await cli("journal", "show", kid)  # any unique start of a kid names its entry
    assert code == 0, err
    assert "card-9 (the agent's Idempotency-Key)" in out and "POST /tools/charge" in out
    assert f"quarantined: idemproxy journal resolve {full} --retry" in out
    [chat] = [e for e in listed if e["upstream"] == "openai"]
    code, out, _ = await cli("journal", "show", chat["kid"])
    body = out[out.index("body (sse"):].splitlines()[1:]
    assert len(body) == 7 and body[-1] == "[DONE]"  # the events, one per line
    assert json.loads(body[0])["object"] == "chat.completion.chunk"
    assert "derived by the proxy" in out and "content-type: text/event-stream" in out.lower()
    code, out, _ = await cli("journal", "show", chat["kid"], "--json")
    assert json.loads(out)["body_base64"] and json.loads(out)["fingerprint"] == chat["fingerprint"]
    code, _, err = await cli("journal", "show", "0" * 64)
    assert code == 1 and "no journal entry" in err

    code, out, _ = await cli("journal", "find", "email-1", "--json")
    assert sorted(e["run"] for e in json.loads(out)["entries"]) == ["other", "shop"]
    code, out, _ = await cli("journal", "find", "email-1", "--run", "shop", "--json")
    [found] = json.loads(out)["entries"]
    assert (found["run"], found["namespace"]) == ("shop", "default")
    code, out, _ = await cli("journal", "find", "email-1", "--tenant", found["tenant"], "--json")
    assert [e["run"] for e in json.loads(out)["entries"]] == ["shop"]
    code, out, _ = await cli("journal", "find", "email-1", "--tenant", "acme")  # a bare name: t:acme
    assert code == 0 and len(out.splitlines()) == 2 and "other" in out
    code, out, _ = await cli("journal", "find", "nobody-sent-this")
    assert code == 0 and out.strip() == "no entry has the Idempotency-Key 'nobody-sent-this'"

    code, out, err = await cli("runs", "show", "shop")
    assert code == 0, err
    table = out[out.index("journal ("):].splitlines()[1:]
    assert table[0].split()[:3] == ["#", "KID", "KEY"]
    keys = {row.split()[1]: row.split()[2] for row in table[1:]}
    assert keys[kid] == "card-9" and keys[chat["kid"][:12]] == "-"  # a derived key is no agent's
    assert max(len(line) for line in out.splitlines()) < 120  # no 64-digit kid widens the table


async def test_a_kid_prefix_names_one_entry_or_says_why_not(make_proxy, store_url, http, make_cli):
    """Two keys whose kids share their first 6 digits (found by hashing, as the proxy does):
    that start is ambiguous, a longer one is not; a start too short or not hex is refused."""
    proxy, cli = await make_proxy(store_url), make_cli()
    base = f"{proxy.url}/runs/twins/tools/send"
    assert (await _send(http, base, "twin-0"))[0] == 200
    [first] = (await proxy.store.journal.search(key=Scope.agent_key("twin-0"), limit=1))
    seen: dict[str, str] = {}
    for i in itertools.count(1):
        key = f"twin-{i}"
        start = Scope.of_key(first.tenant, "twins", "tools", key).kid[:6]
        if start in seen:
            break
        seen[start] = key
    for twin in (seen[start], key):
        assert (await _send(http, base, twin))[0] == 200
    code, _, err = await cli("journal", "show", start)
    assert code == 1 and f"several journal entries' kids start with {start}" in err and "more of the kid" in err
    longer = Scope.of_key(first.tenant, "twins", "tools", key).kid[:20]
    code, out, err = await cli("journal", "show", longer.upper())
    assert code == 0 and f"{key} (the agent's Idempotency-Key)" in out, err
    for bad, why in (("abc12", "is not a kid"), ("zzzzzzzz", "is not a kid"), ("ffffff0000", "no journal entry")):
        code, _, err = await cli("journal", "resolve", bad, "--retry")
        assert code == 1 and why in err and "Traceback" not in err, (bad, err)


async def test_admin_journal_listing_and_entry(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    assert (await _send(http, f"{proxy.url}/runs/a/tools/send", "k-1", status="503"))[0] == 503
    assert (await _send(http, f"{proxy.url}/runs/b/tools/send", "k-1"))[0] == 200

    async def get(path: str) -> tuple[int, dict]:
        async with http.get(proxy.url + path, headers=ADMIN) as resp:
            return resp.status, await resp.json(content_type=None)
    _, body = await get("/admin/journal?state=quarantined")
    [quarantined] = body["entries"]
    assert (quarantined["run"], quarantined["agent_key"], quarantined["state"]) == ("a", "k-1", "unknown")
    _, body = await get("/admin/journal?key=k-1&run=b")
    assert [e["run"] for e in body["entries"]] == ["b"]
    status, entry = await get(f"/admin/journal/{body['entries'][0]['kid']}")
    assert status == 200 and json.loads(base64.b64decode(entry["body_base64"]))["ok"] is True
    for bad in ("?state=lost", "?limit=0", "?run=b"):
        status, problem = await get("/admin/journal" + bad)
        assert status == 400 and problem["type"] == PROBLEM + "invalid-request", bad
    status, _ = await get(f"/admin/journal/{'0' * 64}")
    assert status == 404


async def test_a_dead_run_is_revived_by_the_admin_api_and_the_cli(make_proxy, store_url, http, make_cli,
                                                                  tmp_path):
    marker = tmp_path / "fired"
    hook = {"command": [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"],
            "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"], "watch_exit": False}
    proxy, cli = await make_proxy(store_url, hooks__agent=hook), make_cli(hooks__agent=hook)
    store = proxy.store
    for run in ("lazarus", "phoenix", "alive"):
        async with http.post(f"{proxy.url}/runs/{run}", json={"hook": "agent"}) as resp:
            assert resp.status == 201
    for run in ("lazarus", "phoenix"):  # as the supervisor buries a run past max_restarts
        await store.runs.new_attempt("default", run, 0, time.time(), "restart", True, window_s=600)
        await store.runs.end("default", run, RunState.DEAD, time.time())

    async with http.post(f"{proxy.url}/admin/runs/lazarus/revive", headers=ADMIN) as resp:
        assert resp.status == 200
        revived = await resp.json()
    assert (revived["state"], revived["epoch"], revived["restarts"]) == ("restarting", 2, 2)
    assert revived["history"][-1]["event"] == "revive"
    [run] = await store.runs.find("default", "lazarus")
    assert (run.state, run.ended_at, run.restart_times) == (RunState.RESTARTING, None, [])
    async with http.post(f"{proxy.url}/admin/runs/lazarus/revive", headers=ADMIN) as resp:
        assert resp.status == 409 and (await resp.json())["type"] == PROBLEM + "not-dead"

    code, out, err = await cli("runs", "restart", "phoenix")  # restart works on a dead run: it revives
    assert code == 0 and "restarted at epoch 2" in out, err
    events = [e["event"] for e in (await store.runs.find("default", "phoenix"))[0].history]
    assert events[-2:] == ["revive", "hook-started"]
    code, _, err = await cli("runs", "revive", "alive")
    assert code == 1 and "only a dead run is revived" in err
    await store.runs.end("default", "alive", RunState.DEAD, time.time())
    code, out, err = await cli("runs", "revive", "alive")
    assert code == 0 and "revived at epoch 1" in out, err
    for _ in range(100):  # each revive fired the hook
        if marker.exists() and len(marker.read_text()) == 3:
            break
        await asyncio.sleep(0.05)
    assert marker.read_text() == "xxx"
