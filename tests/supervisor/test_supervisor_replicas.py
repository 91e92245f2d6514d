"""Supervisors as replicas (docs/sizing.md, "Supervised runs"): three of them, each with its
own store connection, share a mass silence; no run is restarted twice, and a tick reads the
runs due, not the runs kept.

bench/runs_scale.py measures the same at 100,000 runs; here the numbers are small enough
for every CI run.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from aiohttp import web

from conftest import proxy_sections
from config_files import write_config
from idemproxy.proxy.config import load_settings
from idemproxy.proxy.runs import RunsService
from idemproxy.proxy.store import open_store
from idemproxy.proxy.store.model import Run
from idemproxy.proxy.store.rules import SILENT_LIMIT
from idemproxy.supervisor.hooks import Hooks
from idemproxy.supervisor.loop import Supervisor

SILENT = 2000  # more than one tick's SILENT_LIMIT: the ticks' claims must split them
LIVE = 500


@pytest.fixture
async def hook_calls():
    """An HTTP hook that counts its calls per run; yields (url, {run_id: [epoch, ...]})."""
    calls: dict[str, list[int]] = collections.defaultdict(list)

    async def called(request: web.Request) -> web.Response:
        facts = await request.json()
        calls[facts["run_id"]].append(int(facts["epoch"]))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", called)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/hook", calls
    await runner.cleanup()


async def _seed(store, ids: list[str], last_seen: float) -> None:
    for i in range(0, len(ids), 50):
        await asyncio.gather(*(store.runs.upsert(Run(
            "default", run_id, last_seen=last_seen, started_at=last_seen, created_at=last_seen, timeout_s=30,
            grace_s=30, hook="agent")) for run_id in ids[i:i + 50]))


async def test_a_claim_hides_runs_due_until_it_ends(store_url, tmp_path):
    settings = load_settings(write_config(tmp_path / "claim.toml", proxy_sections("http://127.0.0.1:9", store_url)),
                             env={})
    store = await open_store(settings)
    try:
        now = 1000.0
        await _seed(store, ["a", "b", "c"], now - 100)
        first = await store.runs.silent(now, limit=2, claim_s=100)
        assert len(first) == 2
        assert [r.run_id for r in await store.runs.silent(now, claim_s=100)] == \
            sorted({"a", "b", "c"} - {r.run_id for r in first})
        assert await store.runs.silent(now + 99) == []  # all three claimed
        assert len(await store.runs.silent(now + 101)) == 3  # claims end
        # a new attempt ends its claim: due again after its own timeout and grace
        restarted, backing_off, _ = sorted(r.run_id for r in first) + ["c"]
        await store.runs.new_attempt("default", restarted, 0, now + 1, "restart", True)
        # the backoff's set_state(claimed_until=0) ends it too: due when the backoff says
        await store.runs.set_state("default", backing_off, None, now + 1, next_restart_at=now + 40,
                                   claimed_until=0)
        assert {r.run_id for r in await store.runs.silent(now + 32)} == {restarted}
        assert {r.run_id for r in await store.runs.silent(now + 41)} == {restarted, backing_off}  # c: claimed
    finally:
        await store.aclose()


@pytest.mark.slow  # 2,000 restarts on each store: 4-8 s each
async def test_three_supervisors_share_a_mass_silence_and_restart_each_run_once(store_url, tmp_path,
                                                                                hook_calls):
    url, calls = hook_calls
    sections = proxy_sections("http://127.0.0.1:9", store_url, supervisor={
        "interval_s": 0.05, "max_restarts_per_minute": 100_000}, hooks__agent={"url": url, "retries": 0})
    settings = load_settings(write_config(tmp_path / "three.toml", sections), env={})
    stores = [await open_store(settings) for _ in range(3)]
    supervisors = [Supervisor(RunsService(s, settings, Hooks(settings, s)), settings) for s in stores]
    try:
        now = time.time()
        silent = [f"silent-{i}" for i in range(SILENT)]
        await _seed(stores[0], silent, now - 100)
        await _seed(stores[0], [f"live-{i}" for i in range(LIVE)], now)
        # a read of the runs due returns at most its limit, soonest due first, and live runs never
        first = await stores[1].runs.silent(time.time(), limit=10)
        assert len(first) == 10 and all(r.run_id.startswith("silent-") for r in first)

        restarted = [collections.Counter() for _ in supervisors]
        deadline = time.monotonic() + 60
        while sum(c["restart"] for c in restarted) < SILENT:
            assert time.monotonic() < deadline, [dict(c) for c in restarted]
            ticks = await asyncio.gather(*(s.tick() for s in supervisors))  # all three at once
            for counter, done in zip(restarted, ticks):
                counter.update(action for _, action in done)
                assert len(done) <= SILENT_LIMIT  # a tick's read is bounded
        for s in supervisors:
            await s.runs.launcher.wait_idle()

        assert sum(c["restart"] for c in restarted) == SILENT
        assert sum(c["restart"] > 0 for c in restarted) >= 2, restarted  # the work was shared
        assert sorted(calls) == sorted(silent) and all(epochs == [1] for epochs in calls.values())
        runs = {r.run_id: r for r in await stores[2].runs.list(limit=SILENT + LIVE)}
        assert all((runs[i].epoch, runs[i].restarts) == (1, 1) for i in silent)
        assert all(runs[f"live-{i}"].epoch == 0 for i in range(LIVE))
        assert [await s.tick() for s in supervisors] == [[], [], []]  # restarted runs are in their grace
    finally:
        for s, store in zip(supervisors, stores):
            await s.runs.launcher.aclose()
            await store.aclose()
