"""Operators leave a trace, and decide on evidence (docs/operations.md#operators-leave-a-trace).

Every operator action (resolve by retry or respond, revive, restart, complete, journal
delete) is kept with who and when, on the entry and on the run: in the admin API, the
console and the CLI. A quarantined call keeps what the decision needs: its request body and
the upstream's error answer, bounded, its credentials masked. Real proxies, real stores,
the fake provider as the tool.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import sys
from html import unescape
import time

import aiohttp
import pytest

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.store.model import RunState

ADMIN = {"Authorization": "Bearer test-admin-token"}
TOKEN_OPERATOR = "admin:token:" + hashlib.sha256(b"test-admin-token").hexdigest()[:8]
ORDER = {"order": "charge-order-7", "amount": 4200, "currency": "EUR"}
SECRET = "sk-live-do-not-keep-me"


async def _json(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def _quarantined(http, proxy, run: str, key: str, body: dict = ORDER) -> str:
    """A tool call the upstream failed with 503 (on_ambiguous = quarantine), sent with a
    credential; the kid of its entry."""
    async with http.post(f"{proxy.url}/runs/{run}/tools/charge", json=body,
                         headers={"Idempotency-Key": key, "X-Fake-Status": "503",
                                  "Authorization": f"Bearer {SECRET}", "X-Api-Key": SECRET}) as resp:
        assert resp.status == 503
    _, found = await _json(http, "GET", f"{proxy.url}/admin/journal?key={key}", headers=ADMIN)
    (entry,) = found["entries"]
    assert entry["state"] == "unknown"
    return entry["kid"]


async def test_a_quarantined_call_keeps_its_request_and_the_error_answer(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    kid = await _quarantined(http, proxy, "orders", "charge-order-7")
    async with http.get(f"{proxy.url}/admin/journal/{kid}", headers=ADMIN) as resp:
        raw = await resp.text()
    assert SECRET not in raw  # never a credential
    evidence = json.loads(raw)["evidence"]
    request, answer = evidence["request"], evidence["answer"]
    assert json.loads(base64.b64decode(request["body_base64"])) == ORDER
    assert request["truncated"] is False and request["bytes"] == len(json.dumps(ORDER))
    headers = {k.lower(): v for k, v in request["headers"]}
    assert headers["authorization"] == headers["x-api-key"] == "***"
    assert headers["content-type"] == "application/json"
    assert answer["status"] == 503
    assert json.loads(base64.b64decode(answer["body_base64"])) == {"error": {"message": "fake 503", "type": "fake"}}
    assert ["Content-Type", "application/json; charset=utf-8"] in answer["headers"]


async def test_evidence_is_bounded_by_max_evidence_bytes(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, server={"max_evidence_bytes": 20})
    kid = await _quarantined(http, proxy, "orders", "big-order", body={"lines": ["x" * 100] * 50})
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/journal/{kid}", headers=ADMIN)
    request, answer = shown["evidence"]["request"], shown["evidence"]["answer"]
    assert request["truncated"] and request["bytes"] > 5000 and len(base64.b64decode(request["body_base64"])) == 20
    assert answer["truncated"] and len(base64.b64decode(answer["body_base64"])) == 20


async def test_respond_is_kept_with_who_and_the_body_digest(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, admin={"operator": "alice"})
    kid = await _quarantined(http, proxy, "orders", "charge-order-8")
    answer = '{"charged": true, "id": "ch_8"}'
    before = time.time()
    status, _ = await _json(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                            json={"action": "respond", "status": 200, "body": answer,
                                  "headers": [["Content-Type", "application/json"]]})
    assert status == 200
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/journal/{kid}", headers=ADMIN)
    (action,) = shown["actions"]
    assert (action["by"], action["action"], action["kid"], action["run"]) == \
        ("admin:alice", "resolve-respond", kid, "orders")
    assert before <= action["at"] <= time.time()
    assert action["detail"]["status"] == 200
    assert action["detail"]["body_digest"] == "sha256:" + hashlib.sha256(answer.encode()).hexdigest()
    assert action["detail"]["why"] == "upstream answered 503"
    assert shown["evidence"]["answer"]["status"] == 503  # what the decision was made on stays
    _, run = await _json(http, "GET", f"{proxy.url}/admin/runs/orders", headers=ADMIN)
    assert run["actions"] == [action]


async def test_a_retried_entry_stays_findable_and_the_next_try_goes_upstream(make_proxy, store_url,
                                                                             provider, http):
    proxy = await make_proxy(store_url)
    kid = await _quarantined(http, proxy, "orders", "charge-order-9")
    status, _ = await _json(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                            json={"action": "retry"})
    assert status == 200
    _, found = await _json(http, "GET", f"{proxy.url}/admin/journal?key=charge-order-9", headers=ADMIN)
    assert [(e["kid"], e["state"]) for e in found["entries"]] == [(kid, "retried")]
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/journal/{kid}", headers=ADMIN)
    assert [(a["by"], a["action"]) for a in shown["actions"]] == [(TOKEN_OPERATOR, "resolve-retry")]
    assert "test-admin-token" not in json.dumps(shown)

    async with http.post(f"{proxy.url}/runs/orders/tools/charge", json=ORDER,
                         headers={"Idempotency-Key": "charge-order-9", "Authorization": f"Bearer {SECRET}",
                                  "X-Api-Key": SECRET}) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"
    assert provider.calls["tool:charge"] == 2  # went upstream again
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/journal/{kid}", headers=ADMIN)
    assert shown["state"] == "complete" and shown["evidence"] is None
    assert [a["action"] for a in shown["actions"]] == ["resolve-retry"]  # the trace outlives the retry


async def test_restart_revive_complete_and_journal_delete_leave_a_trace(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    run = f"{proxy.url}/admin/runs/ops"
    await _json(http, "POST", f"{proxy.url}/runs/ops", json={"timeout_s": 60})
    async with http.post(f"{proxy.url}/runs/ops/tools/send", json={"to": "ann"}) as resp:
        assert resp.status == 200
    assert (await _json(http, "POST", f"{run}/restart", headers=ADMIN))[0] == 200
    await proxy.store.runs.set_state("default", "ops", RunState.DEAD, time.time())  # as the supervisor does
    assert (await _json(http, "POST", f"{run}/revive", headers=ADMIN))[0] == 200
    status, deleted = await _json(http, "DELETE", f"{run}/journal", headers=ADMIN)
    assert status == 200 and deleted["deleted"] == 1
    assert (await _json(http, "POST", f"{run}/complete", headers=ADMIN))[0] == 200

    _, shown = await _json(http, "GET", run, headers=ADMIN)
    assert [(a["by"], a["action"]) for a in shown["actions"]] == [
        (TOKEN_OPERATOR, "restart"), (TOKEN_OPERATOR, "revive"), (TOKEN_OPERATOR, "delete-journal"),
        (TOKEN_OPERATOR, "completed")]
    assert [a["detail"].get("epoch") for a in shown["actions"]] == [1, 2, None, 2]
    assert shown["actions"][2]["detail"]["deleted"] == 1
    # the attempts' endings name the operator too
    endings = [a["ended"]["detail"] for a in shown["attempts"] if a["ended"]]
    assert f"restarted by {TOKEN_OPERATOR}" in endings and f"completed by {TOKEN_OPERATOR}" in endings


async def test_an_operators_registration_is_kept_without_its_values(make_proxy, store_url, http):
    """POST /admin/runs/{id}: the only way to arm a hook a namespace may not arm, so who did it
    is kept; the options' names are, their values (metadata may hold anything) are not."""
    proxy = await make_proxy(store_url, hooks__agent={"command": ["true"]})
    await _json(http, "POST", f"{proxy.url}/runs/armed", json={"timeout_s": 60})
    status, _ = await _json(http, "POST", f"{proxy.url}/admin/runs/armed", headers=ADMIN,
                            json={"hook": "agent", "metadata": {"customer": "secret-customer-9"}})
    assert status == 200
    status, _ = await _json(http, "POST", f"{proxy.url}/admin/runs/fresh?namespace=team-b", headers=ADMIN,
                            json={"timeout_s": 90})
    assert status == 201
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/runs/armed", headers=ADMIN)
    (action,) = shown["actions"]
    assert (action["by"], action["action"], action["namespace"], action["detail"]) == (
        TOKEN_OPERATOR, "register", "default", {"created": False, "options": ["hook", "metadata"], "hook": "agent"})
    assert "secret-customer-9" not in json.dumps(shown["actions"])
    _, fresh = await _json(http, "GET", f"{proxy.url}/admin/runs/fresh", headers=ADMIN)
    assert [(a["action"], a["namespace"], a["detail"]["created"]) for a in fresh["actions"]] == [
        ("register", "team-b", True)]


async def _login(browser, proxy) -> str:
    async with browser.get(f"{proxy.url}/ui/login") as resp:
        form = re.search(r'name="form" value="([0-9a-f]+)"', await resp.text()).group(1)
    async with browser.post(f"{proxy.url}/ui/login", data={"form": form, "token": "test-admin-token"}) as resp:
        assert resp.status == 200
        return re.search(r'name="csrf" value="([^"]+)"', await resp.text()).group(1)


async def test_the_console_shows_the_evidence_and_keeps_its_session_as_who(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url, admin={"operator": "ops-team"})
    kid = await _quarantined(http, proxy, "orders", "charge-order-10")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        csrf = await _login(browser, proxy)
        async with browser.get(f"{proxy.url}/ui/journal/{kid}") as resp:
            page = await resp.text()
        assert "charge-order-7" in page and "4200" in page and "fake 503" in page  # request and answer
        assert SECRET not in page and "***" in page
        assert "No operator has acted on this yet." in page
        async with browser.get(f"{proxy.url}/ui/quarantine") as resp:
            page = await resp.text()
        assert '"order": "charge-order-7"' in unescape(page) and "fake 503" in page  # to decide from the list
        assert SECRET not in page
        async with browser.post(f"{proxy.url}/ui/journal/{kid}/resolve",
                                data={"csrf": csrf, "action": "retry", "back": f"/ui/journal/{kid}"}) as resp:
            assert resp.status == 200
            page = await resp.text()
        assert "resolve-retry" in page and "admin:ops-team via console session" in page
        async with browser.get(f"{proxy.url}/ui/runs/orders?namespace=default") as resp:
            page = await resp.text()
        assert "resolve-retry" in page and "admin:ops-team via console session" in page
        assert "retried by an operator" in page
    _, shown = await _json(http, "GET", f"{proxy.url}/admin/journal/{kid}", headers=ADMIN)
    assert shown["actions"][0]["by"].startswith("admin:ops-team via console session ")


async def test_an_answer_an_operator_gave_is_not_shown_as_a_live_call(make_proxy, sqlite_url, http):
    proxy = await make_proxy(sqlite_url)
    kid = await _quarantined(http, proxy, "orders", "charge-order-11")
    await asyncio.sleep(0.3)  # the operator thinks
    await _json(http, "POST", f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                json={"action": "respond", "status": 200, "body": "{}"})
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        await _login(browser, proxy)
        async with browser.get(f"{proxy.url}/ui/runs/orders?namespace=default") as resp:
            page = await resp.text()
    assert "answered by an operator" in page
    assert not re.search(r">live</span>", page)


async def _cli(config, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idemproxy.proxy.cli", "--log-level", "WARNING", *argv, "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow  # CLI subprocesses
async def test_the_cli_shows_evidence_and_actions_and_keeps_its_user(make_proxy, sqlite_url, provider, http,
                                                                      tmp_path):
    proxy = await make_proxy(sqlite_url)
    config = write_config(tmp_path / "cli.toml", proxy_sections(provider.url, sqlite_url))
    kid = await _quarantined(http, proxy, "orders", "charge-order-12")
    code, out, err = await _cli(config, "journal", "show", kid[:12])
    assert code == 0, err
    assert "request as sent" in out and '"amount": 4200' in out and "answer: 503" in out
    assert "authorization: ***" in out.lower() and SECRET not in out
    code, out, err = await _cli(config, "journal", "resolve", kid[:12], "--retry")
    assert code == 0, err
    code, out, err = await _cli(config, "journal", "show", kid[:12])
    assert "state        retried" in out or re.search(r"state\s+retried", out)
    assert "operator actions:" in out and "resolve-retry" in out and "cli:" in out
    code, out, err = await _cli(config, "runs", "show", "orders")
    assert code == 0 and "operator actions:" in out and kid[:12] in out.split("operator actions:")[1]
    code, out, err = await _cli(config, "runs", "show", "orders", "--json")
    (action,) = json.loads(out)["actions"]
    assert action["by"].startswith("cli:") and action["kid"] == kid
