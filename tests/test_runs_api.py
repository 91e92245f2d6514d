"""The agent-facing runs API (/work/notes/RUNS_API.md), on every backend."""

from __future__ import annotations

import asyncio
import time

PROBLEM = "https://idemproxy.dev/problems/"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def _call(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_register_creates_then_updates(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, runs={"timeout_s": 45, "grace_s": 9, "max_restarts": 2},
                             hooks__agent={"command": ["true"]})
    status, run = await _call(http, "POST", f"{proxy.url}/runs/job-1")
    assert status == 201
    assert (run["run_id"], run["namespace"], run["state"], run["epoch"], run["restarts"]) == \
        ("job-1", "default", "running", 0, 0)
    assert (run["timeout_s"], run["grace_s"], run["max_restarts"], run["hook"]) == (45, 9, 2, None)
    assert run["base_url"] == f"{proxy.url}/runs/job-1/epochs/0"
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
    assert run["base_url"].endswith("/runs/job-2/epochs/1")
    assert any(e["event"] == "attempt" and e["epoch"] == 1 for e in run["history"])

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
