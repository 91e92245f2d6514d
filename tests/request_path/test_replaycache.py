"""Replay in one read (docs/concepts.md): a restarted attempt's replays answered from its run's journal,
loaded in one store read, exactly as the store would answer them, on every backend."""

from __future__ import annotations

import asyncio

ADMIN = {"Authorization": "Bearer test-admin-token"}
CREDENTIAL = {"Authorization": "Bearer sk-agent"}


def chat(step: int) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"step {step}"}]}


class Agent:
    """An agent's calls through run-scoped URLs: model calls and tool calls, keyed by the proxy."""

    def __init__(self, http, url: str, run: str, epoch: int):
        self.http, self.base = http, f"{url}/runs/{run}/epochs/{epoch}"

    async def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, str | None, bytes]:
        async with self.http.post(self.base + path, json=body, headers={**CREDENTIAL, **(headers or {})}) as r:
            return r.status, r.headers.get("Idempotent-Replayed"), await r.read()

    async def chat(self, step: int) -> tuple[int, str | None, bytes]:
        return await self.post("/openai/v1/chat/completions", chat(step))

    async def tool(self, text: str, key: str | None = None) -> tuple[int, str | None, bytes]:
        return await self.post("/tools/send_email", {"text": text}, {"Idempotency-Key": key} if key else None)


async def record_steps(agent: Agent, steps: int) -> list[bytes]:
    """Each step a model call and a tool call; their answers, in order."""
    answers = []
    for step in range(1, steps + 1):
        for status, replayed, body in (await agent.chat(step), await agent.tool(f"step {step}")):
            assert (status, replayed) == (200, "false")
            answers.append(body)
    return answers


async def replay_steps(agent: Agent, steps: int) -> list[bytes]:
    answers = []
    for step in range(1, steps + 1):
        for status, replayed, body in (await agent.chat(step), await agent.tool(f"step {step}")):
            assert (status, replayed) == (200, "true"), body
            answers.append(body)
    return answers


async def test_a_new_attempt_replays_its_run_from_memory_then_goes_live(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    recorded = await record_steps(Agent(http, proxy.url, "r1", 0), 5)
    assert (await Agent(http, proxy.url, "r1", 0).tool("keyed", key="k-1"))[:2] == (200, "false")

    again = Agent(http, proxy.url, "r1", 1)
    assert await replay_steps(again, 5) == recorded
    assert (await again.tool("keyed", key="k-1"))[:2] == (200, "true")
    assert proxy.proxy.metrics.replayed_from_memory == 11  # every replay, the first one included
    assert provider.calls["chat"] == 5 and provider.calls["tool:send_email"] == 6

    assert (await again.chat(6))[:2] == (200, "false")  # live: its first call not recorded before
    assert proxy.proxy.replay_cache.get("default", "r1", 1) is None  # the memory is let go
    assert provider.calls["chat"] == 6
    async with http.get(f"{proxy.url}/metrics") as r:
        assert "idemproxy_replays_from_memory_total 11.0" in await r.text()


async def test_derived_keys_stay_exact_when_replicas_share_an_attempt(make_proxy, store_url, provider, http):
    # The same request several times in a run maps onto the n-th recorded one by its
    # occurrence count in the attempt. Two replicas answering one attempt in turn, each from
    # its own memory, must count together, as they do without memory.
    first, second = await make_proxy(store_url), await make_proxy(store_url)
    recorded = [await Agent(http, first.url, "r2", 0).tool(text) for text in ("a", "b", "a", "a")]
    assert len({body for _, _, body in recorded}) == 4  # four sends, four different answers

    replicas = [Agent(http, first.url, "r2", 1), Agent(http, second.url, "r2", 1)]
    replayed = [await replicas[i % 2].tool(text) for i, text in enumerate(("a", "b", "a", "a"))]
    assert replayed == [(200, "true", body) for _, _, body in recorded]
    assert (await replicas[0].tool("a"))[:2] == (200, "false")  # the fourth "a" is new: it is sent
    assert provider.calls["tool:send_email"] == 5
    assert first.proxy.metrics.replayed_from_memory == second.proxy.metrics.replayed_from_memory == 2


async def test_a_superseded_attempt_is_fenced_while_its_replays_are_in_memory(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    await record_steps(Agent(http, proxy.url, "r3", 0), 2)
    await Agent(http, proxy.url, "r3", 0).tool("keyed", key="k-1")
    zombie = Agent(http, proxy.url, "r3", 1)
    assert (await zombie.chat(1))[:2] == (200, "true")  # epoch 1's journal is in memory now
    async with http.post(f"{proxy.url}/runs/r3/attempts") as r:
        assert (r.status, (await r.json())["epoch"]) == (201, 2)
    for status, _, body in (await zombie.tool("step 1"), await zombie.chat(2), await zombie.tool("keyed", key="k-1")):
        assert (status, b"stale-epoch" in body) == (412, True)
    assert (await Agent(http, proxy.url, "r3", 2).chat(2))[:2] == (200, "true")


async def test_an_entry_that_expired_since_it_was_loaded_is_not_replayed(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, store={"retention": "1s"})
    await record_steps(Agent(http, proxy.url, "r4", 0), 2)
    again = Agent(http, proxy.url, "r4", 1)
    assert (await again.chat(1))[:2] == (200, "true")  # loads both steps
    await asyncio.sleep(1.1)
    assert (await again.tool("step 1"))[:2] == (200, "false")  # expired: it runs as new
    assert provider.calls["tool:send_email"] == 3


async def test_a_deleted_journal_is_not_replayed_from_memory(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    await record_steps(Agent(http, proxy.url, "r5", 0), 2)
    again = Agent(http, proxy.url, "r5", 1)
    assert (await again.chat(1))[:2] == (200, "true")
    async with http.delete(f"{proxy.url}/admin/runs/r5/journal", headers=ADMIN) as r:
        assert (await r.json())["deleted"] == 4
    assert (await again.tool("step 1"))[:2] == (200, "false")
    assert provider.calls["tool:send_email"] == 3



async def test_a_journal_deleted_through_another_replica_is_not_replayed_from_memory(
        make_proxy, store_url, provider, http):
    a, b = await make_proxy(store_url), await make_proxy(store_url)
    await record_steps(Agent(http, a.url, "r5", 0), 2)
    again = Agent(http, b.url, "r5", 1)
    assert (await again.chat(1))[:2] == (200, "true")  # B holds the attempt's journal
    assert b.proxy.metrics.replayed_from_memory == 1
    async with http.delete(f"{a.url}/admin/runs/r5/journal", headers=ADMIN) as r:
        assert (await r.json())["deleted"] == 4
    assert (await again.tool("step 1"))[:2] == (200, "false")  # not from B's memory: recorded anew
    assert b.proxy.metrics.replayed_from_memory == 1
    assert provider.calls["tool:send_email"] == 3

async def test_quarantined_entries_come_from_the_store_and_a_resolve_is_seen(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url)
    before = Agent(http, proxy.url, "r6", 0)
    await record_steps(before, 1)
    # the upstream failed: it may have charged; the key is kept as outcome-unknown
    charge = {"Idempotency-Key": "charge-1"}
    assert (await before.post("/tools/charge", {"n": 1}, {**charge, "X-Fake-Status": "503"}))[0] == 503
    again = Agent(http, proxy.url, "r6", 1)
    assert (await again.chat(1))[:2] == (200, "true")
    status, _, problem = await again.post("/tools/charge", {"n": 1}, charge)
    assert status == 502 and b"outcome-unknown" in problem
    async with http.get(f"{proxy.url}/admin/runs/r6", headers=ADMIN) as r:
        kid = next(s["kid"] for s in (await r.json())["steps"] if s["state"] == "unknown")
    async with http.post(f"{proxy.url}/admin/journal/{kid}/resolve", headers=ADMIN,
                         json={"action": "respond", "status": 200, "body": '{"charged": true}'}) as r:
        assert r.status == 200
    assert await again.post("/tools/charge", {"n": 1}, charge) == (200, "true", b'{"charged": true}')
    assert provider.calls["tool:charge"] == 1


async def test_a_recorded_key_with_another_request_is_refused_from_memory(make_proxy, store_url, http):
    proxy = await make_proxy(store_url)
    assert (await Agent(http, proxy.url, "r7", 0).tool("first", key="k-1"))[:2] == (200, "false")
    again = Agent(http, proxy.url, "r7", 1)
    status, _, problem = await again.tool("second", key="k-1")
    assert status == 422 and b"key-reused" in problem
    assert proxy.proxy.replay_cache.get("default", "r7", 1) is not None  # the refusal came from memory


async def test_memory_is_bounded_and_the_rest_replays_from_the_store(make_proxy, store_url, provider, http):
    proxy = await make_proxy(store_url, store={"replay_cache_bytes": 1})  # room for no body at all
    recorded = await record_steps(Agent(http, proxy.url, "r8", 0), 2)
    assert await replay_steps(Agent(http, proxy.url, "r8", 1), 2) == recorded
    assert proxy.proxy.metrics.replayed_from_memory == 0
    assert provider.calls["chat"] == 2

    roomy = await make_proxy(store_url, store={"replay_cache_bytes": sum(map(len, recorded[:3]))})
    assert await replay_steps(Agent(http, roomy.url, "r8", 2), 2) == recorded
    assert roomy.proxy.metrics.replayed_from_memory == 3  # the oldest three fit; the fourth from the store


async def test_an_attempt_lets_go_of_its_memory_after_the_ttl(make_proxy, store_url, http):
    proxy = await make_proxy(store_url, store={"replay_cache_ttl": "0.2s"})
    recorded = await record_steps(Agent(http, proxy.url, "r9", 0), 2)
    again = Agent(http, proxy.url, "r9", 1)
    assert (await again.chat(1))[2] == recorded[0]
    await asyncio.sleep(0.3)
    assert await again.tool("step 1") == (200, "true", recorded[1])  # from the store now
    assert proxy.proxy.metrics.replayed_from_memory == 1
    assert proxy.proxy.replay_cache.get("default", "r9", 1) is None


async def test_a_replay_from_memory_counts_derived_keys_per_tenant(make_proxy, store_url, provider, http):
    # Two credentials share a namespace (and so a run): each one's identical calls are numbered
    # among its own, from memory as from the store, so one's replay never shifts the other's.
    proxy = await make_proxy(store_url)
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    before = Agent(http, proxy.url, "r10", 0)
    recorded = [await before.post("/tools/send_email", {"text": "a"}, who) for who in (alice, bob, alice)]
    assert len({body for _, _, body in recorded}) == 3

    again = Agent(http, proxy.url, "r10", 1)
    replayed = [await again.post("/tools/send_email", {"text": "a"}, who) for who in (bob, alice, alice)]
    assert replayed == [(200, "true", recorded[i][2]) for i in (1, 0, 2)]
    assert proxy.proxy.metrics.replayed_from_memory == 3 and provider.calls["tool:send_email"] == 3
