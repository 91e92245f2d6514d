"""One run is one run under the default settings (docs/concepts.md, "Run tokens"): a registration
answers the run's token, which binds the attempt's traffic and its runs-API calls to the run
whatever credential each call carries, while another caller can neither see nor drive it.

Every test here runs the default tenancy: runs per credential, credential-less recording refused."""

from __future__ import annotations

import asyncio

import pytest

from idemproxy_client import Run, RunState
from rawhttp import problem

DEFAULTS = {"runs": "credential", "anonymous": "refuse"}
ADMIN = {"Authorization": "Bearer test-admin-token"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "plan the trip"}]}


async def runs_named(http, proxy, run_id: str) -> list[dict]:
    async with http.get(f"{proxy.url}/admin/runs", headers=ADMIN) as r:
        return [run for run in (await r.json())["runs"] if run["run_id"] == run_id]


async def test_the_quick_start_makes_one_run_completed_by_its_client(make_proxy, store_url, provider, http):
    """The README's snippet: ``Run`` (which sends no credential) around an SDK that carries its
    own key. It made two runs: one registered in `anonymous`, one made by the traffic in `k:…`,
    left running until it went dead."""
    proxy = await make_proxy(store_url, tenants=DEFAULTS)

    def agent() -> tuple[str, str]:
        with Run("ns-test", proxy_url=proxy.url, timeout_s=60, env={}) as run:
            with run.openai(api_key="sk-live") as llm:
                reply = llm.chat.completions.with_raw_response.create(**CHAT)
            return reply.headers["Idempotent-Replayed"], run.token
    replayed, token = await asyncio.to_thread(agent)
    assert replayed == "false" and token
    (run,) = await runs_named(http, proxy, "ns-test")
    assert run["state"] == "completed" and run["steps"] == 1 and run["namespace"].startswith("r:")
    assert provider.calls["chat"] == 1


async def test_nobody_else_sees_or_drives_the_run(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants=DEFAULTS)
    async with http.post(f"{proxy.url}/runs/mine", json={"timeout_s": 30}) as r:
        mine = await r.json()
    async with http.post(f"{proxy.url}/runs/theirs", json={"timeout_s": 30}) as r:
        theirs = await r.json()
    for who in ({}, {"Authorization": "Bearer sk-other"}):  # no credential, another one
        for method, tail in (("GET", ""), ("POST", "/heartbeat"), ("POST", "/complete"), ("POST", "/attempts")):
            async with http.request(method, f"{proxy.url}/runs/mine{tail}", headers=who) as r:
                if tail == "/attempts":  # makes the caller's own run of that id, as if none existed
                    assert r.status == 201 and (await r.json())["namespace"] != mine["namespace"]
                else:
                    await problem(r, "not-found", 404)
    name, _, mac = mine["token"].partition(".")
    for wrong in (theirs["token"], f"{name}.{'0' * 32}", "not-a-token"):
        async with http.get(f"{proxy.url}/runs/mine", headers={"Idem-Run-Token": wrong}) as r:
            await problem(r, "invalid-run-token", 403)
        async with http.post(f"{proxy.url}/runs/mine/cap/{wrong}/openai/v1/chat/completions", json=CHAT,
                             headers={"Authorization": "Bearer sk-live"}) as r:
            await problem(r, "invalid-run-token", 403)
    assert provider.calls["chat"] == 0
    async with http.get(f"{proxy.url}/runs/mine", headers={"Idem-Run-Token": mine["token"]}) as r:
        assert r.status == 200 and (await r.json())["state"] == "running"


async def test_a_restarted_attempt_with_another_credential_replays_its_runs_journal(make_proxy, store_url,
                                                                                    provider, http):
    """A rotated key must not cost a run its journal: the run owns it, not the credential."""
    proxy = await make_proxy(store_url, tenants=DEFAULTS)
    async with http.post(f"{proxy.url}/runs/rotated", json={"timeout_s": 30}) as r:
        first = await r.json()
    async with http.post(f"{first['base_url']}/openai/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sk-old"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "false"
    async with http.post(f"{proxy.url}/runs/rotated/attempts", headers={"Idem-Run-Token": first["token"]}) as r:
        second = await r.json()
    assert second["epoch"] == 1 and second["token"] == first["token"]
    async with http.post(f"{second['base_url']}/openai/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sk-new"}) as r:
        assert r.status == 200 and r.headers["Idempotent-Replayed"] == "true"
    # the old attempt is fenced, whatever credential it carries
    async with http.post(f"{first['base_url']}/openai/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sk-old"}) as r:
        await problem(r, "stale-epoch", 412)
    assert provider.calls["chat"] == 1
    assert [run["namespace"] for run in await runs_named(http, proxy, "rotated")] == [first["namespace"]]


async def test_a_run_token_is_never_forwarded(make_proxy, sqlite_url, provider, http):
    proxy = await make_proxy(sqlite_url, tenants=DEFAULTS)
    async with http.post(f"{proxy.url}/runs/quiet", json={"timeout_s": 30}) as r:
        run = await r.json()
    async with http.post(f"{run['base_url']}/openai/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sk-live", "Idem-Run-Token": run["token"]}) as r:
        assert r.status == 200
    seen = provider.seen[-1]
    assert run["token"] not in str(seen) and "Idem-Run-Token" not in seen["headers"]


@pytest.mark.parametrize("allowed, armed", [(["anonymous"], True), ([], False)])
async def test_a_credential_less_run_arms_a_hook_only_where_anonymous_is_allowed(make_proxy, sqlite_url, http,
                                                                                  allowed, armed):
    proxy = await make_proxy(sqlite_url, tenants=DEFAULTS,
                             hooks__agent={"command": ["true"], "allow_tenants": allowed})
    async with http.post(f"{proxy.url}/runs/hooked", json={"hook": "agent"}) as r:
        if armed:
            assert r.status == 201 and (await r.json())["hook"] == "agent"
        else:
            await problem(r, "hook-not-allowed", 403)


async def test_the_async_client_binds_its_calls_too(make_proxy, sqlite_url, provider, http):
    from idemproxy_client import AsyncRun
    proxy = await make_proxy(sqlite_url, tenants=DEFAULTS)
    async with AsyncRun("async-one", proxy_url=proxy.url, timeout_s=60, env={}) as run:
        async with run.openai(api_key="sk-live") as llm:
            await llm.chat.completions.create(**CHAT)
        assert (await run.heartbeat()).state is RunState.RUNNING
    (shown,) = await runs_named(http, proxy, "async-one")
    assert shown["state"] == "completed" and shown["steps"] == 1
