"""The admin API behind its bearer token, and the runs/journal commands as subprocesses."""

from __future__ import annotations

import asyncio
import base64
import json
import sys

import pytest

from conftest import proxy_sections
from config_files import write_config

PROBLEM = "https://idemproxy.dev/problems/"
ADMIN = {"Authorization": "Bearer test-admin-token"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _call(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def _quarantine(http, proxy, run: str, key: str) -> str:
    """A tool call whose outcome is unknown (upstream 503, on_ambiguous=quarantine); its kid."""
    url = f"{proxy.url}/runs/{run}/tools/send"
    async with http.post(url, json={"to": "bob"}, headers={"Idempotency-Key": key,
                                                           "X-Fake-Status": "503"}) as resp:
        assert resp.status == 503
    status, problem = await _call(http, "POST", url, json={"to": "bob"}, headers={"Idempotency-Key": key})
    assert status == 502 and problem["type"] == PROBLEM + "outcome-unknown"
    _, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/{run}", headers=ADMIN)
    (step,) = [s for s in shown["steps"] if s["key"] == key]
    assert step["state"] == "unknown"
    return step["kid"]


async def test_admin_needs_the_bearer_token(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, admin={"max_failures": 100})  # 15 wrong tries, none held up
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}):
        for method, path in (("GET", "/admin/runs"), ("GET", "/admin/runs/x"), ("POST", "/admin/purge"),
                             ("POST", "/admin/journal/abc/resolve"), ("GET", "/admin/anything")):
            async with http.request(method, proxy.url + path, headers=headers) as resp:
                assert resp.status == 401, (method, path, headers)
                assert (await resp.json(content_type=None))["type"] == PROBLEM + "unauthorized"
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    status, body = await _call(http, "GET", f"{proxy.url}/admin/runs", headers=ADMIN)
    assert status == 200 and body == {"runs": []}
    status, _ = await _call(http, "GET", f"{proxy.url}/admin/nothing-here", headers=ADMIN)
    assert status == 404


async def test_without_a_configured_token_the_admin_api_is_closed(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, admin={"token": ""})
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer None"}):
        status, problem = await _call(http, "GET", f"{proxy.url}/admin/runs", headers=headers)
        assert status == 401 and "no [admin] token" in problem["detail"]


async def test_list_and_show_runs_with_their_journal(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    base = f"{proxy.url}/runs/shown/epochs/0"
    for _ in range(2):  # the second is a replay
        async with http.post(f"{base}/openai/v1/chat/completions", json=CHAT,
                             headers={"Idempotency-Key": "step-1"}) as resp:
            assert resp.status == 200
    async with http.post(f"{base}/tools/send", json={"to": "ann"}) as resp:
        assert resp.status == 200
    await proxy.proxy.flush_replay_counts()
    await _call(http, "POST", f"{proxy.url}/runs/other")
    await _call(http, "POST", f"{proxy.url}/runs/other/complete")

    _, listed = await _call(http, "GET", f"{proxy.url}/admin/runs", headers=ADMIN)
    assert {r["run_id"]: r["steps"] for r in listed["runs"]} == {"shown": 2, "other": 0}  # a replay adds no step
    for run in listed["runs"]:
        for field in ("run_id", "state", "epoch", "restarts", "last_seen", "steps", "history"):
            assert field in run
    _, listed = await _call(http, "GET", f"{proxy.url}/admin/runs?state=completed", headers=ADMIN)
    assert [r["run_id"] for r in listed["runs"]] == ["other"]
    status, _ = await _call(http, "GET", f"{proxy.url}/admin/runs?state=sleeping", headers=ADMIN)
    assert status == 400

    status, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/shown", headers=ADMIN)
    assert status == 200
    for field in ("run_id", "state", "epoch", "restarts", "last_seen", "steps"):
        assert field in shown
    chat, tool = shown["steps"]
    assert (chat["key"], chat["upstream"], chat["method"], chat["path"], chat["status"], chat["replays"],
            chat["epoch"], chat["state"]) == ("step-1", "openai", "POST", "/v1/chat/completions", 200, 1, 0,
                                              "complete")
    assert tool["upstream"] == "tools" and tool["key"].startswith("derived:") and tool["replays"] == 0
    assert chat["recorded_at"] >= chat["created_at"] > 0
    assert "body_base64" not in chat  # metadata only, unless asked

    _, with_bodies = await _call(http, "GET", f"{proxy.url}/admin/runs/shown?bodies=1", headers=ADMIN)
    recorded = json.loads(base64.b64decode(with_bodies["steps"][0]["body_base64"]))
    assert recorded["object"] == "chat.completion"
    status, _ = await _call(http, "GET", f"{proxy.url}/admin/runs/none", headers=ADMIN)
    assert status == 404


async def test_admin_restart_and_complete(make_proxy, store_url, http, tmp_path):
    marker = tmp_path / "restarted"
    proxy = await make_proxy(store_url, hooks__agent={
        "command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"],
        "log_dir": str(tmp_path / "logs"), "allow_tenants": ["default"]})
    assert (await _call(http, "POST", f"{proxy.url}/runs/ops", json={"hook": "agent"}))[0] == 201
    status, run = await _call(http, "POST", f"{proxy.url}/admin/runs/ops/restart", headers=ADMIN)
    assert status == 200 and (run["epoch"], run["restarts"], run["state"]) == (1, 1, "restarting")
    assert any(e["event"] == "admin-restart" for e in run["history"])
    for _ in range(100):
        if marker.exists():
            break
        await asyncio.sleep(0.05)
    assert marker.exists()  # the hook fired
    assert "idemproxy_restarts_total 1.0" in await (await http.get(f"{proxy.url}/metrics")).text()

    status, run = await _call(http, "POST", f"{proxy.url}/admin/runs/ops/complete", headers=ADMIN)
    assert status == 200 and run["state"] == "completed"
    status, problem = await _call(http, "POST", f"{proxy.url}/admin/runs/ops/restart", headers=ADMIN)
    assert status == 409 and problem["type"] == PROBLEM + "run-ended"


@pytest.mark.slow  # starts the hook's process
async def test_a_restart_tells_the_hook_the_configured_url_whatever_the_host_header(make_proxy, store_url, http,
                                                                                    tmp_path):
    seen = tmp_path / "env.json"
    dump = ("import json, os, sys; json.dump({k: v for k, v in os.environ.items() if k.startswith('IDEM_')}, "
            "open(sys.argv[1], 'w'))")
    # no [supervisor] proxy_url: hooks are told http://{[server] host}:{[server] port}
    proxy = await make_proxy(store_url, server={"port": 8787}, supervisor={"enabled": False, "proxy_url": ""},
                             hooks__agent={"command": [sys.executable, "-c", dump, str(seen)],
                                           "log_dir": str(tmp_path / "logs")})
    assert (await _call(http, "POST", f"{proxy.url}/admin/runs/spoof?namespace=default", headers=ADMIN,
                        json={"hook": "agent"}))[0] == 201
    status, run = await _call(http, "POST", f"{proxy.url}/admin/runs/spoof/restart",
                              headers={**ADMIN, "Host": "attacker.example", "X-Forwarded-Host": "attacker.example"})
    assert status == 200 and run["epoch"] == 1
    assert run["base_url"].startswith("http://attacker.example/")  # the Host did arrive: shown to its caller
    for _ in range(100):
        if seen.exists() and seen.stat().st_size:
            break
        await asyncio.sleep(0.05)
    env = json.loads(seen.read_text())
    assert env["IDEM_PROXY_URL"] == "http://127.0.0.1:8787"
    assert env["IDEM_RUN_BASE"] == f"http://127.0.0.1:8787/runs/spoof/epochs/1/cap/{env['IDEM_RUN_TOKEN']}"
    assert not any("attacker" in value for value in env.values())


async def test_delete_a_runs_journal_and_purge(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    url = f"{proxy.url}/runs/wipe/epochs/0/openai/v1/chat/completions"
    for _ in range(2):
        async with http.post(url, json=CHAT) as resp:
            assert resp.status == 200
    assert provider.calls["chat"] == 2  # two derived occurrences
    status, body = await _call(http, "DELETE", f"{proxy.url}/admin/runs/wipe/journal", headers=ADMIN)
    assert status == 200 and body["deleted"] == 2
    async with http.post(url, json=CHAT) as resp:
        assert resp.headers["Idempotent-Replayed"] == "false"  # forgotten: goes upstream again
    assert provider.calls["chat"] == 3
    status, body = await _call(http, "POST", f"{proxy.url}/admin/purge", headers=ADMIN)
    assert status == 200 and body == {"purged": 0, "runs": 0}


async def test_resolve_a_quarantined_key_by_retrying(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    kid = await _quarantine(http, proxy, "q-retry", "email-1")
    assert provider.calls["tool:send"] == 1
    status, body = await _call(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                               json={"action": "retry"})
    assert status == 200 and body["resolved"] is True
    async with http.post(f"{proxy.url}/runs/q-retry/tools/send", json={"to": "bob"},
                         headers={"Idempotency-Key": "email-1"}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["tool:send"] == 2  # went upstream again

    status, problem = await _call(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                                  json={"action": "retry"})
    assert status == 409 and problem["type"] == PROBLEM + "not-quarantined"
    status, _ = await _call(http, "POST", f"{proxy.url}/admin/journal/{'0' * 64}/resolve", headers=ADMIN,
                            json={"action": "retry"})
    assert status == 404
    status, _ = await _call(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                            json={"action": "respond", "status": 99})
    assert status == 400


async def test_resolve_a_quarantined_key_with_its_answer(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    kid = await _quarantine(http, proxy, "q-respond", "email-2")
    status, _ = await _call(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                            json={"action": "respond", "status": 200, "body": '{"sent": true}',
                                  "headers": [["Content-Type", "application/json"]]})
    assert status == 200
    async with http.post(f"{proxy.url}/runs/q-respond/tools/send", json={"to": "bob"},
                         headers={"Idempotency-Key": "email-2"}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
        assert await resp.json() == {"sent": True}
    assert provider.calls["tool:send"] == 1  # never sent twice


async def _cli(config, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy.proxy.cli", "--log-level", "WARNING", *argv, "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow  # a dozen CLI subprocesses
async def test_cli_runs_and_journal_commands(make_proxy, store_url, provider, http, tmp_path):
    proxy = await make_proxy(store_url)
    config = write_config(tmp_path / "cli.toml", proxy_sections(provider.url, store_url))
    async with http.post(f"{proxy.url}/runs/cli-run/epochs/0/openai/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    kid = await _quarantine(http, proxy, "cli-run", "email-3")
    await _call(http, "POST", f"{proxy.url}/runs/cli-done")
    await _call(http, "POST", f"{proxy.url}/runs/cli-done/complete")

    code, out, err = await _cli(config, "runs", "list", "--json")
    assert code == 0, err
    runs = {r["run_id"]: r for r in json.loads(out)["runs"]}
    assert set(runs) == {"cli-run", "cli-done"} and runs["cli-done"]["state"] == "completed"
    code, out, _ = await _cli(config, "runs", "list", "--state", "completed", "--json")
    assert [r["run_id"] for r in json.loads(out)["runs"]] == ["cli-done"]

    code, out, err = await _cli(config, "runs", "list")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["RUN", "NAMESPACE", "STATE", "EPOCH", "RESTARTS", "LAST", "SEEN", "HOOK"]
    assert header.index("STATE") == rows[0].index(rows[0].split()[2])  # aligned columns
    assert len(rows) == 2

    code, out, err = await _cli(config, "runs", "show", "cli-run")
    assert code == 0, err
    assert "state         running" in out and kid[:12] in out and kid not in out and "journal (2 entries)" in out
    code, out, _ = await _cli(config, "runs", "show", "cli-run", "--json")
    assert [s["state"] for s in json.loads(out)["steps"]] == ["complete", "unknown"]
    code, _, err = await _cli(config, "runs", "show", "no-such-run")
    assert code == 1 and "no run" in err

    code, out, err = await _cli(config, "journal", "resolve", kid[:12], "--status", "200", "--body", '{"sent": 1}')
    assert code == 0, err
    async with http.post(f"{proxy.url}/runs/cli-run/tools/send", json={"to": "bob"},
                         headers={"Idempotency-Key": "email-3"}) as resp:
        assert await resp.json() == {"sent": 1}
    code, _, err = await _cli(config, "journal", "resolve", kid, "--retry")
    assert code == 1 and "not quarantined" in err

    code, out, err = await _cli(config, "runs", "complete", "cli-run")
    assert code == 0 and "completed" in out, err
    code, _, err = await _cli(config, "runs", "restart", "cli-run")
    assert code == 1 and "ended" in err


async def test_a_resolved_answer_keeps_only_headers_fit_to_store(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, upstreams__tools={"redact_headers": ["X-Secret"]})
    kid = await _quarantine(http, proxy, "q-headers", "email-4")
    resolve = f"{proxy.url}/admin/journal/{kid}/resolve"
    for name, value in (("X-Ok", "yes\r\nSet-Cookie: sid=stolen"), ("X-Ok", "a\nb"), ("X-Ok", "nul\x00"),
                        ("Bad Name", "x"), ("X-Ok:", "x"), ("", "x")):
        status, problem = await _call(http, "POST", resolve, headers=ADMIN, json={
            "action": "respond", "status": 200, "body": "{}", "headers": [[name, value]]})
        assert status == 400 and problem["type"] == PROBLEM + "invalid-body", (name, value)
    assert (await proxy.store.journal.get(kid)).state == "unknown"  # refused: nothing changed

    status, _ = await _call(http, "POST", resolve, headers=ADMIN, json={
        "action": "respond", "status": 200, "body": '{"sent": true}',
        "headers": [["Content-Type", "application/json"], ["Set-Cookie", "sid=1"], ["Content-Length", "999"],
                    ["Transfer-Encoding", "chunked"], ["Connection", "close"], ["Date", "yesterday"],
                    ["X-Secret", "s3"], ["X-Request-Id", "req\t7"]]})
    assert status == 200
    stored = (await proxy.store.journal.get(kid)).response
    assert stored.headers == [("Content-Type", "application/json"), ("X-Request-Id", "req\t7")]
    async with http.post(f"{proxy.url}/runs/q-headers/tools/send", json={"to": "bob"},
                         headers={"Idempotency-Key": "email-4"}) as resp:
        assert resp.status == 200 and await resp.json() == {"sent": True}
        assert "Set-Cookie" not in resp.headers and resp.headers["Content-Length"] == "14"
    assert provider.calls["tool:send"] == 1


async def test_a_run_id_in_several_namespaces_must_be_named(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants={"trusted_sources": ["127.0.0.1/32"]})
    url = "/runs/twin/epochs/0/openai/v1/chat/completions"
    for tenant, n in (("acme", 2), (None, 1)):
        for i in range(n):
            headers = {"Idem-Tenant": tenant} if tenant else {}
            async with http.post(proxy.url + url, json={**CHAT, "n": i}, headers=headers) as resp:
                assert resp.status == 200
    for method, path in (("DELETE", "/admin/runs/twin/journal"), ("GET", "/admin/runs/twin"),
                         ("POST", "/admin/runs/twin/complete")):
        status, problem = await _call(http, method, proxy.url + path, headers=ADMIN)
        assert status == 409 and problem["type"] == PROBLEM + "ambiguous-run", (method, path)
        assert problem["namespaces"] == ["acme", "default"]
    status, problem = await _call(http, "DELETE", f"{proxy.url}/admin/runs/nobody/journal", headers=ADMIN)
    assert status == 404 and problem["type"] == PROBLEM + "not-found"

    status, body = await _call(http, "DELETE", f"{proxy.url}/admin/runs/twin/journal?namespace=acme",
                               headers=ADMIN)
    assert (status, body) == (200, {"deleted": 2, "namespace": "acme", "run_id": "twin"})
    _, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/twin?namespace=default", headers=ADMIN)
    assert len(shown["steps"]) == 1  # the other namespace's journal is untouched
    assert provider.calls["chat"] == 3

