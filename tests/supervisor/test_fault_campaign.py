"""The fault campaign (docs/guarantees.md#under-faults): nothing is lost, nothing is done
twice, while everything is killed at random.

On a private PostgreSQL and on a private Redis (``appendfsync always``), agents run many
runs of N steps (a model call and a tool call with a side effect each), half with explicit
keys, half with derived ones, through two ``idemproxy serve`` replicas and one
``idemproxy supervise``. Meanwhile agents, replicas, the store server and the supervisor are
SIGKILLed at random from a seed, and started again (the supervisor restarts the agents).
At the end:

- every tool side effect happened exactly once per logical step (duplicates = 0), and every
  step of every completed run reached the upstream (missing = 0);
- nothing was forwarded for a step once an agent had seen its answer;
- every answer an agent saw replays byte for byte when asked again (records lost = 0), and
  the re-asking reaches no upstream;
- every run registered is completed: none lost, none stuck;
- no agent got an answer a correct proxy never gives (a 422, a 400, ...).

``IDEMPROXY_FAULT_SECONDS`` sets how long faults are injected (default 40, under 90 s a
store in all); ``IDEMPROXY_FAULT_SEED`` repeats a schedule. The figures are printed (``-s``)
and written to ``fault-campaign-<store>.json`` in the test's tmp folder.
"""

from __future__ import annotations

import os
import random

import pytest

from conftest import BACKENDS
from faults.campaign import Campaign, Plan

FAULT_SECONDS = float(os.environ.get("IDEMPROXY_FAULT_SECONDS", "40"))
SEED = int(os.environ.get("IDEMPROXY_FAULT_SEED") or random.SystemRandom().randrange(1, 10**6))
STORES = [b for b in ("postgres", "redis") if b in BACKENDS]

# SIGKILLs, private servers, subprocesses; the bound scales with the window asked for
pytestmark = [pytest.mark.slow, pytest.mark.timeout(FAULT_SECONDS + 180)]


@pytest.mark.parametrize("backend", STORES)
async def test_fault_campaign(backend, tmp_path):
    plan = Plan(backend, SEED, FAULT_SECONDS)
    print(f"\nfault campaign on {backend}: seed {SEED} (IDEMPROXY_FAULT_SEED={SEED} repeats it), "
          f"{FAULT_SECONDS:g} s of faults, folder {tmp_path}")
    async with Campaign(plan, tmp_path) as campaign:
        report = await campaign.run()
    artifact = tmp_path / f"fault-campaign-{backend}.json"
    artifact.write_text(report.as_json())
    print(report.table())
    print(f"  written to {artifact}")

    assert report.broken() == {}, (report.examples, report.stuck[:5], report.anomalies[:5])
    # and the campaign did what it says: every kind of fault, runs through to the end, replays
    assert all(report.faults.values()), report.faults
    assert report.runs["completed"] >= plan.agents
    assert report.calls["answered as replays"] > 0
