"""The agent-facing runs API (supervisor/api.py's docstring), on every backend."""

from __future__ import annotations

import asyncio
import time

import pytest

PROBLEM = "https://idemproxy.dev/problems/"
ADMIN = {"Authorization": "Bearer test-admin-token"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def _call(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_register_creates_then_updates(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, runs={"timeout_s": 45, "grace_s": 9, "max_restarts": 2},
                             hooks__agent={"command": ["true"], "allow_tenants": ["default"]})
    status, run = await _call(http, "POST", f"{proxy.url}/runs/job-1")
    assert status == 201
    assert (run["run_id"], run["namespace"], run["state"], run["epoch"], run["restarts"]) == \
        ("job-1", "default", "running", 0, 0)
    assert (run["timeout_s"], run["grace_s"], run["max_restarts"], run["hook"]) == (45, 9, 2, None)
    assert run["base_url"] == f"{proxy.url}/runs/job-1/epochs/0/cap/{run['token']}"
    assert abs(run["last_seen"] - time.time()) < 5

    status, run = await _call(http, "POST", f"{proxy.url}/runs/job-1",
                              json={"timeout_s": 5, "hook": "agent", "metadata": {"owner": "ops"}})
    assert status == 200
    assert (run["timeout_s"], run["grace_s"], run["hook"], run["metadata"]) == (5, 9, "agent", {"owner": "ops"})

    status, got = await _call(http, "GET", f"{proxy.url}/runs/job-1")
    assert status == 200 and got["timeout_s"] == 5 and got["metadata"] == {"owner": "ops"}


async def test_register_refuses_bad_options(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    for body in ({"timeout": 5}, {"timeout_s": -1}, {"timeout_s": True}, {"max_restarts": 1.5},
                 {"hook": "not-configured"}, {"metadata": [1, 2]}):
        status, problem = await _call(http, "POST", f"{proxy.url}/runs/bad", json=body)
        assert status == 400, body
        assert problem["type"] == PROBLEM + "invalid-body"
    async with http.post(f"{proxy.url}/runs/bad", data=b"{not json") as resp:
        assert resp.status == 400
        assert resp.headers["Content-Type"].startswith("application/problem+json")
    status, _ = await _call(http, "GET", f"{proxy.url}/runs/bad")
    assert status == 404  # nothing was created by the refusals


async def test_heartbeat_touches_last_seen(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    status, problem = await _call(http, "POST", f"{proxy.url}/runs/nobody/heartbeat")
    assert status == 404 and problem["type"] == PROBLEM + "not-found"
    _, run = await _call(http, "POST", f"{proxy.url}/runs/beating")
    await asyncio.sleep(0.05)
    status, beat = await _call(http, "POST", f"{proxy.url}/runs/beating/heartbeat")
    assert status == 200 and beat["last_seen"] > run["last_seen"]


async def test_complete_and_fail_end_a_run_for_good(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    await _call(http, "POST", f"{proxy.url}/runs/done")
    status, run = await _call(http, "POST", f"{proxy.url}/runs/done/complete")
    assert status == 200 and run["state"] == "completed" and run["ended_at"]
    status, run = await _call(http, "POST", f"{proxy.url}/runs/done/complete")
    assert status == 200 and run["state"] == "completed"  # idempotent
    status, problem = await _call(http, "POST", f"{proxy.url}/runs/done/fail")
    assert status == 409 and problem["type"] == PROBLEM + "run-ended" and problem["state"] == "completed"
    status, problem = await _call(http, "POST", f"{proxy.url}/runs/done/attempts")
    assert status == 409 and problem["type"] == PROBLEM + "run-ended"

    await _call(http, "POST", f"{proxy.url}/runs/broken")
    status, run = await _call(http, "POST", f"{proxy.url}/runs/broken/fail")
    assert status == 200 and run["state"] == "failed"
    status, _ = await _call(http, "POST", f"{proxy.url}/runs/missing/complete")
    assert status == 404


async def test_attempts_raise_the_epoch_and_fence_the_old_attempt(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    status, run = await _call(http, "POST", f"{proxy.url}/runs/job-2/attempts")
    assert status == 201 and run["epoch"] == 0  # created by its first attempt
    async with http.post(f"{run['base_url']}/openai/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    status, run = await _call(http, "POST", f"{proxy.url}/runs/job-2/attempts")
    assert status == 201 and run["epoch"] == 1 and run["restarts"] == 0
    assert run["base_url"].endswith(f"/runs/job-2/epochs/1/cap/{run['token']}")
    _, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/job-2", headers=ADMIN)
    assert any(e["event"] == "attempt" and e["epoch"] == 1 for e in shown["history"])

    # the superseded attempt is refused before anything is forwarded
    status, problem = await _call(http, "POST", f"{proxy.url}/runs/job-2/epochs/0/openai/v1/chat/completions",
                                  json={**CHAT, "messages": [{"role": "user", "content": "zombie"}]})
    assert status == 412 and problem["type"] == PROBLEM + "stale-epoch" and problem["epoch"] == 1
    assert provider.calls["chat"] == 1
    # the new attempt replays the old one's journal
    async with http.post(f"{run['base_url']}/openai/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "true"
    assert provider.calls["chat"] == 1


async def test_a_run_created_by_traffic_gets_the_defaults_and_beats(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, runs={"timeout_s": 33, "grace_s": 4})
    async with http.post(f"{proxy.url}/runs/by-traffic/openai/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    await proxy.proxy.heartbeats.flush()
    status, run = await _call(http, "GET", f"{proxy.url}/runs/by-traffic")
    assert status == 200
    assert (run["state"], run["epoch"], run["timeout_s"], run["grace_s"]) == ("running", 0, 33, 4)
    assert abs(run["last_seen"] - time.time()) < 5


async def test_runs_live_in_the_trusted_tenants_namespace(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, tenants={"trusted_sources": ["127.0.0.1/32"]})
    status, run = await _call(http, "POST", f"{proxy.url}/runs/shared-id", headers={"Idem-Tenant": "acme"})
    assert status == 201 and run["namespace"] == "acme"
    status, _ = await _call(http, "GET", f"{proxy.url}/runs/shared-id")
    assert status == 404  # another namespace's run is invisible
    status, run = await _call(http, "POST", f"{proxy.url}/runs/shared-id")
    assert status == 201 and run["namespace"] == "default"


async def test_an_untrusted_tenant_header_is_refused(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    status, problem = await _call(http, "POST", f"{proxy.url}/runs/x", headers={"Idem-Tenant": "acme"})
    assert status == 403 and problem["type"] == PROBLEM + "untrusted-tenant"


async def test_a_superseded_attempt_can_neither_beat_nor_end_its_run(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    url = f"{proxy.url}/runs/zombie"
    await _call(http, "POST", url)
    _, run = await _call(http, "POST", f"{url}/attempts")
    assert run["epoch"] == 1
    await asyncio.sleep(0.05)

    # epoch 0 is a zombie now: by header or by body, nothing it says changes the run
    for path, kwargs in (("heartbeat", {"headers": {"Idem-Epoch": "0"}}),
                         ("heartbeat", {"json": {"epoch": 0}}),
                         ("complete", {"headers": {"Idem-Epoch": "0"}}),
                         ("complete", {"json": {"epoch": 0}}),
                         ("fail", {"headers": {"Idem-Epoch": "0"}})):
        status, problem = await _call(http, "POST", f"{url}/{path}", **kwargs)
        assert status == 412, (path, kwargs, problem)
        assert problem["type"] == PROBLEM + "stale-epoch" and problem["epoch"] == 1
    _, now = await _call(http, "GET", url)
    assert (now["state"], now["epoch"], now["last_seen"]) == ("running", 1, run["last_seen"])

    # malformed or contradictory epochs are refused and change nothing either
    for kwargs in ({"headers": {"Idem-Epoch": "one"}}, {"json": {"epoch": -1}}, {"json": {"epoch": "1"}},
                   {"json": {"epoch": 1, "note": "x"}},
                   {"headers": {"Idem-Epoch": "1"}, "json": {"epoch": 0}}):
        status, problem = await _call(http, "POST", f"{url}/complete", **kwargs)
        assert status == 400, (kwargs, problem)
    assert (await _call(http, "GET", url))[1]["state"] == "running"

    # the current attempt (or a newer one the run has not seen yet) is heard
    status, beat = await _call(http, "POST", f"{url}/heartbeat", headers={"Idem-Epoch": "1"})
    assert status == 200 and beat["last_seen"] > run["last_seen"]
    status, beat = await _call(http, "POST", f"{url}/heartbeat", json={"epoch": 2})
    assert status == 200
    status, done = await _call(http, "POST", f"{url}/complete", headers={"Idem-Epoch": "1"})
    assert status == 200 and (done["state"], done["epoch"]) == ("completed", 1)
    status, problem = await _call(http, "POST", f"{url}/fail", json={"epoch": 0})
    assert status == 412  # a zombie learns it was superseded, not how the run ended
    status, again = await _call(http, "POST", f"{url}/complete", json={"epoch": 1})
    assert status == 200 and again["state"] == "completed"  # still idempotent


async def test_agents_see_no_history_operators_do(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, hooks__agent={"command": ["true"], "allow_tenants": ["default"]})
    answers = [await _call(http, "POST", f"{proxy.url}/runs/private", json={"hook": "agent"}),
               await _call(http, "POST", f"{proxy.url}/runs/private/attempts"),
               await _call(http, "POST", f"{proxy.url}/runs/private/heartbeat"),
               await _call(http, "GET", f"{proxy.url}/runs/private")]
    for status, run in answers:
        assert status in (200, 201) and run["run_id"] == "private"
        assert "history" not in run and "attempts" not in run  # hook errors, pids, logs are for operators
    answers.append(await _call(http, "POST", f"{proxy.url}/runs/private/complete"))
    assert "history" not in answers[-1][1] and "attempts" not in answers[-1][1]
    status, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/private", headers=ADMIN)
    events = ["ended", "attempt", "ended", "completed"]  # each attempt's end, then what followed it
    assert status == 200 and [e["event"] for e in shown["history"]] == events
    assert [(a["epoch"], a["ended"]["how"]) for a in shown["attempts"]] == [(0, "superseded"), (1, "completed")]
    _, listed = await _call(http, "GET", f"{proxy.url}/admin/runs", headers=ADMIN)
    assert [e["event"] for e in listed["runs"][0]["history"]] == events


def _gauge(text: str) -> dict[str, float]:
    prefix = "idemproxy_runs{state=\""
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


@pytest.mark.slow  # waits out the 1 s metrics cache
async def test_every_process_counts_runs_for_metrics(make_proxy, store_url, http):
    # two proxies on one store, neither running a supervisor: each counts from the store
    first, second = await make_proxy(store_url), await make_proxy(store_url)
    for run_id in ("a", "b", "c"):
        await _call(http, "POST", f"{first.url}/runs/{run_id}")
    await _call(http, "POST", f"{first.url}/runs/c/fail")
    for proxy in (first, second):
        text = await (await http.get(f"{proxy.url}/metrics")).text()
        assert _gauge(text) == {"running": 2, "restarting": 0, "completed": 0, "failed": 1, "dead": 0}
    await _call(http, "POST", f"{second.url}/runs/a/complete")
    await asyncio.sleep(1.1)  # scrapes within a second share one count
    assert _gauge(await (await http.get(f"{first.url}/metrics")).text())["completed"] == 1

