"""From measurements to rows, targets and the markdown table.

Throughput is compared at 32 connections, to the baseline measured just before and just
after the same store's figures; latency at 1 connection, as the p50 difference to the
baseline measured just before.
The targets are the table in bench/README.md ("targets").
"""

from __future__ import annotations

import statistics

# scenario -> least throughput at 32 connections, as a share of the baseline's (in front
# of nginx, on every store; a replay calls no provider, so it must beat forwarding)
RATIO_TARGETS = {store: {"passthrough": 0.95, "replay": 1.3, "record": 0.5}
                 for store in ("sqlite", "postgres", "redis")}
# a replayed MCP tools/call against a replayed chat completion, same store and workers (the
# margin is the noise of two measurements on a shared machine)
MCP_REPLAY_SHARE = 0.95
# scenario -> most p50 added at 1 connection, in milliseconds (SQLite's replay is held
# to 0.15 ms: its read is in-process)
P50_TARGETS = {"sqlite": {"passthrough": 0.1, "replay": 0.15},
               "postgres": {"passthrough": 0.1, "replay": 0.3},
               "redis": {"passthrough": 0.1, "replay": 0.3}}
WORKERS_GAIN = 0.8     # N workers: at least 0.8 * N times one worker's throughput (2 -> 1.6x)
RUN_SCOPED_SHARE = 0.9  # a run-scoped request costs no more than one without (within noise)


NOISY_CORES = 0.3     # other processes busier than this during a measurement: flagged
DRIFT = 0.15          # the baseline's two measurements further apart than this: flagged


def rows(results: list[dict]) -> list[dict]:
    """One row per (store, workers, scenario): both connection counts, ratios, targets.

    A measurement repeated (the baseline at 32 connections, before and after a store's
    rows and before each scenario's; a scenario over several rounds) counts with the mean
    of its runs; how far the baseline's first and last differ is its drift. A scenario
    measured right after a baseline of its own has as its ratio the median, over its
    rounds, of its throughput over that baseline's.
    """
    by: dict[tuple, dict] = {}
    runs: dict[tuple, list[dict]] = {}
    for m in results:
        key = (m["store"], m["workers"], m["scenario"])
        by.setdefault(key, {"store": m["store"], "workers": m["workers"], "scenario": m["scenario"],
                            "problems": []})
        runs.setdefault(key + (m["connections"],), []).append(m)
    for (store, workers, scenario, c), ms in runs.items():
        row = by[(store, workers, scenario)]
        for field in ("rps", "p50_ms", "p99_ms"):
            row[f"{field}_c{c}"] = round(sum(m[field] for m in ms) / len(ms), 3)
        cpus = [(m.get("cpu_us_per_request") or {}).get("server") for m in ms]
        known = [x for x in cpus if x is not None]
        row[f"cpu_us_c{c}"] = round(sum(known) / len(known), 1) if len(known) == len(cpus) else None
        paired = sorted(m["rps"] / m["paired_baseline_rps"] for m in ms if m.get("paired_baseline_rps"))
        if paired:
            row["paired_ratios"] = [round(r, 3) for r in paired]
            row["ratio"] = round(statistics.median(paired), 3)
        if len(ms) > 1 and ms[0]["rps"] and scenario == "baseline":
            row[f"drift_c{c}"] = drift = round(ms[-1]["rps"] / ms[0]["rps"] - 1, 3)
            if abs(drift) > DRIFT:
                row["problems"].append(f"c{c}: {drift:+.0%} between its runs (the machine's load changed)")
        for m in ms:
            if m["errors"]:
                row["problems"].append(f"c{c}: errors {m['errors']}")
            if not m["calls_ok"]:
                row["problems"].append(f"c{c}: {m['upstream_calls']} upstream calls for {m['requests']} requests")
            if m.get("profiled"):
                row["problems"].append(f"c{c}: measured under py-spy")
            if (m.get("other_cores_busy") or 0) > NOISY_CORES:
                row["problems"].append(f"c{c}: other processes kept {m['other_cores_busy']:.1f} cores busy")
    out = list(by.values())
    for row in out:
        _compare(row, by)
    return out


def _compare(row: dict, by: dict[tuple, dict]) -> None:
    store, workers, scenario = row["store"], row["workers"], row["scenario"]
    base = by.get((store, 0, "baseline"), {})
    checks = []
    if scenario != "baseline" and base.get("rps_c32") and row.get("rps_c32") is not None:
        if "ratio" not in row:  # not measured next to a baseline of its own
            row["ratio"] = round(row["rps_c32"] / base["rps_c32"], 3)
        target = RATIO_TARGETS.get(store, {}).get(scenario)
        if target is not None and workers == 1:
            checks.append({"what": "x baseline @32", "value": row["ratio"], "target": f">= {target}",
                           "ok": row["ratio"] >= target})
    if scenario != "baseline" and base.get("p50_ms_c1") is not None and row.get("p50_ms_c1") is not None:
        row["p50_delta_ms"] = round(row["p50_ms_c1"] - base["p50_ms_c1"], 3)
        target = P50_TARGETS.get(store, {}).get(scenario)
        if target is not None:
            checks.append({"what": "p50 delta @1 ms", "value": row["p50_delta_ms"], "target": f"<= {target}",
                           "ok": row["p50_delta_ms"] <= target})
    if scenario == "baseline" and workers > 1 and base.get("rps_c32") and row.get("rps_c32"):
        row["ratio"] = round(row["rps_c32"] / base["rps_c32"], 3)  # the plain proxy's own gain
    one = by.get((store, 1, scenario), {})
    if workers > 1 and scenario != "baseline" and one.get("rps_c32") and row.get("rps_c32") is not None:
        row["vs_one_worker"] = round(row["rps_c32"] / one["rps_c32"], 3)
        target = round(WORKERS_GAIN * workers, 2)
        check = {"what": "x one worker @32", "value": row["vs_one_worker"], "target": f">= {target}",
                 "ok": row["vs_one_worker"] >= target}
        plain = by.get((store, workers, "baseline"), {})
        if plain.get("ratio"):  # what N processes of the plain proxy gained on this machine
            check["plain_proxy_gain"] = plain["ratio"]
        checks.append(check)
    plain = by.get((store, workers, scenario.removeprefix("run-")), {})
    if scenario.startswith("run-") and plain.get("rps_c32") and row.get("rps_c32") is not None:
        row["vs_without_run"] = round(row["rps_c32"] / plain["rps_c32"], 3)
        checks.append({"what": f"x {plain['scenario']} @32", "value": row["vs_without_run"],
                       "target": f">= {RUN_SCOPED_SHARE}", "ok": row["vs_without_run"] >= RUN_SCOPED_SHARE})
    replay = by.get((store, workers, "replay"), {})
    if scenario == "mcp-replay" and replay.get("rps_c32") and row.get("rps_c32") is not None:
        # a replayed tools/call costs no more than a replayed chat completion
        row["vs_replay"] = round(row["rps_c32"] / replay["rps_c32"], 3)
        checks.append({"what": "x replay @32", "value": row["vs_replay"], "target": f">= {MCP_REPLAY_SHARE}",
                       "ok": row["vs_replay"] >= MCP_REPLAY_SHARE})
    row["checks"] = checks
    row["ok"] = all(c["ok"] for c in checks) if checks else None


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def markdown(rows: list[dict], meta: dict, errors: dict[str, str] | None = None) -> str:
    lines = [
        f"idemproxy benchmark, {meta.get('started')}, git {meta.get('git')}, {meta.get('cpus')} CPUs, "
        f"load generator {meta.get('loadgen')}, provider {meta.get('provider', 'python')}, "
        f"{meta.get('duration_s'):g}s per measurement; "
        f"load average {_load(meta.get('loadavg_start'))} at start, {_load(meta.get('loadavg_end'))} at end",
        "" if meta.get("complete", True) else "\n**Partial: the run was interrupted or failed.**",
        "| store | workers | scenario | req/s @32 | × baseline | CPU µs/req @32 | p50 @32 | p99 @32 "
        "| p50 @1 | Δp50 @1 | p99 @1 | targets |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in rows:
        targets = "; ".join(
            f"{c['what']} {c['target']}: {c['value']:g} {'ok' if c['ok'] else 'MISSED'}"
            + (f" (the plain proxy as {r['workers']} processes: {c['plain_proxy_gain']:g})"
               if "plain_proxy_gain" in c else "") for c in r["checks"])
        if r["problems"]:
            targets = "; ".join(filter(None, [targets, "!! " + "; ".join(r["problems"])]))
        lines.append(
            f"| {r['store']} | {r['workers'] or '–'} | {r['scenario']} | {_num(r.get('rps_c32'), ',.0f')} "
            f"| {_num(r.get('ratio'), '.2f')}{_spread(r.get('paired_ratios'))} | {_num(r.get('cpu_us_c32'), '.0f')} "
            f"| {_num(r.get('p50_ms_c32'), '.2f')} "
            f"| {_num(r.get('p99_ms_c32'), '.2f')} | {_num(r.get('p50_ms_c1'), '.3f')} "
            f"| {_num(r.get('p50_delta_ms'), '+.3f')} | {_num(r.get('p99_ms_c1'), '.3f')} | {targets} |")
    lines.append("")
    lines.append("Latencies in milliseconds. × baseline: throughput at 32 connections over the baseline's "
                 "measured just before it (with several rounds, the median of those ratios; where a row "
                 "had no baseline of its own, the mean of the baseline's runs around the store's rows); "
                 "the range over rounds follows each ratio. CPU µs/req: CPU "
                 "time of the proxy measured (all its processes) per request. Δp50: p50 at 1 connection "
                 "minus the baseline's. A baseline row with workers N: the plain proxy as N processes, "
                 "× its one process: what this machine gives N processes. !! marks figures to distrust: "
                 "errors, wrong upstream call counts, a busy machine, a drifting baseline.")
    for store, error in (errors or {}).items():
        lines.append(f"\n**{store} not measured:** {error.splitlines()[0] if error else ''}")
    return "\n".join(lines)


def _spread(ratios: list[float] | None) -> str:
    return f" ({ratios[0]:.2f}–{ratios[-1]:.2f})" if ratios and len(ratios) > 1 else ""


def _load(avg) -> str:
    return "–" if not avg else "/".join(f"{x:.1f}" for x in avg)
