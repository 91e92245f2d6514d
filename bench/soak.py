"""The soak: the fault campaign (tests/support/faults/) for an hour, with latency and memory over time.

Two ``idemproxy serve`` replicas and one ``idemproxy supervise`` on a private store server,
agents running runs through them, while agents, replicas, the store server and the
supervisor are SIGKILLed at random from a seed and started again. What the campaign checks
at the end (tests/supervisor/test_fault_campaign.py) is checked here too, after the hour: no side
effect done twice, no acknowledged record lost, no run stuck; the script exits 1 if one
fails. Besides, every few seconds the resident memory of each replica and of the
supervisor is sampled, and the latency of every answer an agent saw is kept, so that
what grows or slows over an hour shows.

    python bench/soak.py --store postgres --minutes 60 --out bench/results/2026-12-05-soak-postgres

writes into ``--out``: ``summary.json`` (the verdict, the figures, the seed), ``latency.csv``
(per minute: calls, p50, p99, max, faults), ``memory.csv`` (every sample), ``faults.csv``
(every fault injected) and the plots ``latency.png`` and ``memory.png``. The processes'
logs and the agents' event files stay in a temporary folder, removed at the end unless
``--keep``. Needs the test and bench extras and the client (``pip install -e '.[test,bench]'
-e clients/python``) and the PostgreSQL or Redis server binaries.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from faults.campaign import Campaign, Plan  # noqa: E402
from faults.verdict import read_events  # noqa: E402
import soak_figures as figures  # noqa: E402

SAMPLE_EVERY_S = 5.0


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["postgres", "redis", "redis-cluster"], required=True)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long faults are injected")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--seed", type=int, help="repeats a fault schedule (default: a new one)")
    parser.add_argument("--agents", type=int, default=4, help="runs in flight at once")
    parser.add_argument("--steps", type=int, default=12, help="steps per run: a model call and a tool call each")
    parser.add_argument("--fault-every", type=float, default=4.0,
                        help="mean seconds between two faults (the test's campaign: 1.2)")
    parser.add_argument("--keep", action="store_true", help="keep the logs and event files")
    return parser.parse_args()


async def sample_memory(campaign: Campaign, samples: list[figures.Sample]) -> None:
    """Until cancelled: the RSS of each replica and the supervisor that is up."""
    while True:
        now = time.time()
        for service in [*campaign.proxies, campaign.supervisor]:
            proc = service and service.proc
            if proc is not None and (rss := figures.rss_mib(proc.pid)) is not None:
                samples.append(figures.Sample(now, service.name, proc.pid, rss))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def report_progress(campaign: Campaign, samples: list[figures.Sample], began: float) -> None:
    """A line a minute, so that whoever runs it sees it is alive."""
    while True:
        await asyncio.sleep(60)
        latest = {s.process: s.rss_mib for s in samples[-6:]}
        print(f"  {(time.time() - began) / 60:5.1f} min: {len(campaign.registered)} runs registered, RSS "
              + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in sorted(latest.items())), flush=True)


async def soak(plan: Plan, folder: Path) -> tuple[dict, list[figures.Sample]]:
    samples: list[figures.Sample] = []
    async with Campaign(plan, folder) as campaign:
        watchers = [asyncio.create_task(sample_memory(campaign, samples)),
                    asyncio.create_task(report_progress(campaign, samples, time.time()))]
        try:
            report = await campaign.run()
        finally:
            for task in watchers:
                task.cancel()
    return report, samples


def main() -> int:
    args = arguments()
    if importlib.util.find_spec("idemproxy_client") is None:  # else every agent dies at start, for the hour
        sys.exit("the agents need the Python client: pip install -e clients/python")
    seed = args.seed or random.SystemRandom().randrange(1, 10**6)
    plan = Plan(args.store, seed, args.minutes * 60, agents=args.agents, steps=args.steps,
                fault_every_s=args.fault_every)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"idem-soak-{args.store}-"))
    logging.basicConfig(filename=folder / "soak.log", level=logging.INFO)
    print(f"soak on {args.store}: seed {seed}, {args.minutes:g} min of faults, {args.agents} agents, "
          f"{args.steps} steps a run, a fault every {args.fault_every:g} s on average; folder {folder}", flush=True)
    try:
        report, samples = asyncio.run(soak(plan, folder))
        events = read_events(folder)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

    began = figures.origin(events)
    latency = figures.latency_rows(events, report.fault_log, began)
    figures.write_csv(args.out / "latency.csv", figures.LATENCY_FIELDS, latency)
    figures.write_memory(args.out / "memory.csv", samples, began)
    figures.write_csv(args.out / "faults.csv", ["at", "kind", "target", "down_s"], report.fault_log)
    title = f"{args.store}, seed {seed}, {args.agents} agents"
    figures.plot_latency(args.out / "latency.png", latency, f"Latency per minute under faults ({title})")
    figures.plot_memory(args.out / "memory.png", samples, began, f"Resident memory ({title})")

    broken = report.broken()
    # and the soak did what it says: every kind of fault, and replays among the answers
    thin = [k for k, n in report.faults.items() if not n] + ([] if report.calls.get("answered as replays")
                                                          else ["no replays"])
    summary = {**{k: v for k, v in asdict(report).items() if k != "fault_log"},
               "command": " ".join(sys.argv), "agents": args.agents, "steps": args.steps, "fault_every_s": args.fault_every,
               "invariants_broken": broken, "campaign_thin": thin,
               "memory": figures.memory_summary(samples)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    print(report.table())
    print(f"  memory: {json.dumps(summary['memory'])}")
    print(f"  written to {args.out}")
    if broken or thin:
        print(f"FAILED: invariants broken {broken}, faults not injected {thin}; seed {seed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
