"""Runs belong to a namespace (docs/security.md): the tenant of the credential that made them,
or a trusted tenant; another namespace sees 404, its traffic neither fences nor counts in them.
One shared namespace is an explicit choice (``[tenants] runs = "shared"``)."""

from __future__ import annotations

import pytest

from rawhttp import problem

ADMIN = {"Authorization": "Bearer test-admin-token"}
A = {"Authorization": "Bearer sk-tenant-a"}
B = {"Authorization": "Bearer sk-tenant-b"}
CHAT = "/openai/v1/chat/completions"
PER_CREDENTIAL = {"runs": "credential"}  # the default; the test harness otherwise shares runs


def chat(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def _call(http, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_another_credential_finds_no_run_through_the_runs_api(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, tenants=PER_CREDENTIAL)
    url = f"{proxy.url}/runs/job"
    status, mine = await _call(http, "POST", url, headers=A, json={"timeout_s": 30, "metadata": {"card": "4242"}})
    assert status == 201 and mine["namespace"].startswith("k:")

    for other in (B, {}):  # another credential, and none at all
        for method, path, kwargs in (("GET", "", {}), ("POST", "/heartbeat", {}),
                                     ("POST", "/complete", {"json": {"epoch": 0}}), ("POST", "/fail", {})):
            async with http.request(method, url + path, headers=other, **kwargs) as resp:
                await problem(resp, "not-found", 404)
        # registering makes the caller's own run, as if none existed; a caller with no credential
        # gets a namespace of its own, which its run's token reaches, and nothing else does
        status, theirs = await _call(http, "POST", url, headers=other, json={"timeout_s": 5, "metadata": {}})
        assert status == 201 and theirs["namespace"] != mine["namespace"]
        assert theirs["namespace"].startswith("k:" if other else "r:")
        own = {**other, "Idem-Run-Token": theirs["token"]}
        status, attempt = await _call(http, "POST", url + "/attempts", headers=own)
        assert status == 201 and attempt["namespace"] == theirs["namespace"] and attempt["epoch"] == 1
        if not other:
            async with http.get(url) as resp:  # another caller without a credential: not its run
                await problem(resp, "not-found", 404)

    status, still = await _call(http, "GET", url, headers=A)
    assert status == 200
    assert {k: still[k] for k in ("state", "epoch", "timeout_s", "metadata", "last_seen")} == \
        {k: mine[k] for k in ("state", "epoch", "timeout_s", "metadata", "last_seen")}

    # operators see every namespace; the id is in three, so they name the one they mean
    _, listed = await _call(http, "GET", f"{proxy.url}/admin/runs", headers=ADMIN)
    assert len({r["namespace"] for r in listed["runs"] if r["run_id"] == "job"}) == 3
    status, shown = await _call(http, "GET", f"{proxy.url}/admin/runs/job?namespace={mine['namespace']}",
                                headers=ADMIN)
    assert status == 200 and shown["metadata"] == {"card": "4242"}


async def test_another_credentials_epoch_neither_fences_nor_moves_a_run(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, tenants=PER_CREDENTIAL)
    async with http.post(f"{proxy.url}/runs/r/epochs/0{CHAT}", json=chat("step"), headers=A) as resp:
        assert resp.status == 200
    # B starts "attempt 1" of its own run r: A's attempt 0 is not superseded
    async with http.post(f"{proxy.url}/runs/r/epochs/1{CHAT}", json=chat("step"), headers=B) as resp:
        assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"
    async with http.post(f"{proxy.url}/runs/r/epochs/0{CHAT}", json=chat("next"), headers=A) as resp:
        assert resp.status == 200
    async with http.post(f"{proxy.url}/runs/r/epochs/0{CHAT}", json=chat("late"), headers=B) as resp:
        await problem(resp, "stale-epoch", 412)  # B's own run has moved on
    _, mine = await _call(http, "GET", f"{proxy.url}/runs/r", headers=A)
    assert mine["epoch"] == 0
    # and an operator sees each namespace's journal under its own run
    shown = await _call(http, "GET", f"{proxy.url}/admin/runs/r?namespace={mine['namespace']}", headers=ADMIN)
    assert [s["epoch"] for s in shown[1]["steps"]] == [0, 0]


@pytest.mark.parametrize("runs", ["credential", "shared"])
async def test_derived_keys_count_each_tenants_calls(make_proxy, store_url, provider, http, runs):
    """Another credential's identical call in the same run and epoch shifts none of A's
    numbers: A's restarted attempt replays A's first and second answers, in order."""
    proxy = await make_proxy(store_url, tenants={"runs": runs})
    url = f"{proxy.url}/runs/shared-run/epochs/{{}}{CHAT}"
    answers = []
    for who in (A, B, A):
        async with http.post(url.format(0), json=chat("same"), headers=who) as resp:
            assert resp.status == 200 and resp.headers["Idempotent-Replayed"] == "false"
            if who is A:
                answers.append(await resp.read())
    for recorded in answers:
        async with http.post(url.format(1), json=chat("same"), headers=A) as resp:
            assert resp.headers["Idempotent-Replayed"] == "true" and await resp.read() == recorded
    assert provider.calls["chat"] == 3


async def test_one_shared_namespace_is_a_choice_made_in_configuration(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, tenants={"runs": "shared"})
    status, run = await _call(http, "POST", f"{proxy.url}/runs/team-job", headers=A)
    assert status == 201 and run["namespace"] == "default"
    status, seen = await _call(http, "POST", f"{proxy.url}/runs/team-job/heartbeat", headers=B)
    assert status == 200 and seen["namespace"] == "default"


async def test_a_trusted_tenant_may_not_take_a_credentials_namespace(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, tenants={**PER_CREDENTIAL, "trusted_sources": ["127.0.0.1/32"]})
    _, mine = await _call(http, "POST", f"{proxy.url}/runs/job", headers=A)
    for named in (mine["namespace"], "anonymous"):
        async with http.get(f"{proxy.url}/runs/job", headers={"Idem-Tenant": named}) as resp:
            await problem(resp, "invalid-header", 400)
    status, acme = await _call(http, "POST", f"{proxy.url}/runs/job", headers={**A, "Idem-Tenant": "acme"})
    assert status == 201 and acme["namespace"] == "acme"  # the trusted name decides, not the credential


async def test_default_is_no_trusted_tenants_name_under_shared_runs(make_proxy, store_url, http):
    """Under runs = "shared" every untrusted caller lives in "default": a trusted tenant of
    that name would share its runs with all of them."""
    proxy = await make_proxy(store_url, tenants={"runs": "shared", "trusted_sources": ["127.0.0.1/32"]})
    for method, path, body in (("POST", "/runs/payroll", {}), ("GET", "/runs/payroll", None),
                               ("POST", f"/runs/payroll/epochs/0{CHAT}", chat("x"))):
        async with http.request(method, proxy.url + path, headers={**A, "Idem-Tenant": "default"},
                                json=body) as resp:
            await problem(resp, "invalid-header", 400)
    async with http.get(f"{proxy.url}/runs/payroll", headers=B) as resp:
        await problem(resp, "not-found", 404)  # nothing was made in the shared namespace
