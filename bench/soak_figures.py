"""The soak's figures over time: the latency of the agents' calls per minute, the memory of
each long-lived process, and the faults injected; written as CSV and drawn as PNG.

Time is counted in seconds since the faults began, which is when the first agent starts
(the campaign starts the fault schedule and the first runs together).
"""

from __future__ import annotations

import collections
import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

LATENCY_FIELDS = ["minute", "calls", "replays", "p50_ms", "p99_ms", "max_ms", "faults", "store_faults"]


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # time.time()
    process: str  # proxy-0, proxy-1, supervisor
    pid: int
    rss_mib: float


def rss_mib(pid: int) -> float | None:
    """Resident memory of one process (not its children: the supervisor's are the agents its
    hooks started), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


def origin(events: list[dict]) -> float:
    return min(ev["t"] for ev in events if ev["ev"] == "start")


def _quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank quantile: a value that was measured, never an interpolation."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def latency_rows(events: list[dict], faults: list[dict], began: float) -> list[dict]:
    """Per minute: how many answers the agents saw, and how long each successful try took
    from the agent's send to the whole answer read (replays and forwarded calls together)."""
    by_minute: dict[int, list[float]] = collections.defaultdict(list)
    replays = collections.Counter()
    for ev in events:
        if ev["ev"] == "answer":
            minute = int((ev["sent"] - began) // 60)
            by_minute[minute].append((ev["t"] - ev["sent"]) * 1000)
            replays[minute] += ev["replayed"] == "true"
    faults_at = collections.Counter(int(f["at"] // 60) for f in faults)
    store_faults_at = collections.Counter(int(f["at"] // 60) for f in faults if f["kind"] == "store")
    rows = []
    for minute in sorted(by_minute):
        ms = sorted(by_minute[minute])
        rows.append({"minute": minute, "calls": len(ms), "replays": replays[minute],
                     "p50_ms": round(_quantile(ms, 0.5), 1), "p99_ms": round(_quantile(ms, 0.99), 1),
                     "max_ms": round(ms[-1], 1), "faults": faults_at[minute],
                     "store_faults": store_faults_at[minute]})
    return rows


def memory_summary(samples: list[Sample]) -> dict[str, dict]:
    """Per process: the RSS at its first and last sample, the highest, and how many lives it had."""
    out = {}
    for process in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == process]
        out[process] = {"first_mib": round(mine[0].rss_mib, 1), "last_mib": round(mine[-1].rss_mib, 1),
                        "max_mib": round(max(s.rss_mib for s in mine), 1),
                        "lives": len({s.pid for s in mine})}
    return out


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def write_memory(path: Path, samples: list[Sample], began: float) -> None:
    write_csv(path, ["t_s", "process", "pid", "rss_mib"],
              [{"t_s": round(s.t - began, 1), "process": s.process, "pid": s.pid,
                "rss_mib": round(s.rss_mib, 1)} for s in samples])


def _pyplot():
    os.environ.setdefault("MPLBACKEND", "Agg")  # files only, no display
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("the soak draws with matplotlib: pip install -e '.[bench]'") from exc
    return plt


def plot_latency(path: Path, rows: list[dict], title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    minutes = [r["minute"] + 0.5 for r in rows]
    bars = ax.twinx()
    bars.bar(minutes, [r["store_faults"] for r in rows], width=0.8, color="0.85", label="store kills")
    bars.set_ylabel("store kills per minute")
    ax.set_zorder(bars.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.plot(minutes, [r["p50_ms"] for r in rows], marker=".", label="p50")
    ax.plot(minutes, [r["p99_ms"] for r in rows], marker=".", label="p99")
    ax.set_yscale("log")
    ax.set_xlabel("minutes since the faults began")
    ax.set_ylabel("an agent's call through the proxy (ms)")
    ax.set_title(title)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = bars.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(path: Path, samples: list[Sample], began: float, title: str) -> None:
    """One colour per process, one line per life of it: a gap is a SIGKILL and its restart."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4), dpi=110)
    for n, process in enumerate(sorted({s.process for s in samples})):
        mine = [s for s in samples if s.process == process]
        lives = [[s for s in mine if s.pid == pid] for pid in dict.fromkeys(s.pid for s in mine)]
        for i, life in enumerate(lives):
            ax.plot([(s.t - began) / 60 for s in life], [s.rss_mib for s in life], color=f"C{n}",
                    marker="." if len(life) == 1 else None, markersize=3, linewidth=1,
                    label=process if i == 0 else None)
    ax.set_xlabel("minutes since the faults began")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
