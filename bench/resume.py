"""Resume after a crash: how long from a kill to the restart, and to going live again.

A 240-step agent (``bench/resume_agent.py``: a model call and a tool call per step,
official ``openai`` SDK and httpx on the client library) runs through a real
``idemproxy serve`` with its supervisor, `timeout_s = 60`, and dies by SIGKILL right after
step 200. The next attempt, started by the supervisor's command hook, replays steps
1-200 from the journal and goes live at step 201. Per store and per way of noticing the
death, it reports:

- kill -> restart: from the kill to the supervisor firing the hook (``hook-started`` in the
  run's history);
- kill -> step 201 live: from the kill to the first call that is not a replay reaching the
  fake upstream (its 201st chat completion);
- replay 1-200: what the new attempt took for its first 200 steps, all replays (in the agent,
  from its first request), and the proxy's own part of it (the sum of its ``Server-Timing``);
- hook fired -> first request: the new process starting, importing, registering;
- and once, the agent's steps straight to the fake provider without the proxy: the agent's
  own share of a replay on this machine at that moment (two cores shared by everything).

Detection paths:

- ``hook``: the first attempt is itself started by the hook (the run is registered, then
  restarted through the admin API), so the supervisor has the agent as a child process.
- ``standby``: the same hook with ``standby = 1``: the supervisor keeps one process of the
  agent started ahead, imported and waiting in ``Run()``; the restart hands it the run instead
  of spawning. Its "hook fired -> first request" has no imports in it (its negative
  ``restart_to_process_s`` says how long before the restart the process had started).
- ``attach``: the benchmark starts the first attempt itself, as a Kubernetes Job or systemd
  would, with ``Run(..., attach=True)``: the client holds ``POST /runs/{id}/attach`` open.
- ``attach-remote``: the same, with the agent named as a process on another host (its
  ``Idem-Process`` carries another boot id): the proxy cannot look at it, so the drop waits
  out ``attach_grace_s``, as for an agent on another machine. On this host (``attach``) the
  proxy sees the process exit and skips the grace.
- ``attach-standby``: ``attach``, with the restart handed to a standby (``standby = 1``), as a
  deployment that keeps a replacement ready (a warm pod, a pre-started worker) would.

Without either, only silence is noticed: the restart then comes ``timeout_s`` after the
last sign of life. Every part is checked, not only timed: exactly 240 model and 240 tool
calls reach the upstream, the run ends completed one attempt later, and the new attempt
replayed exactly 200 steps of each and went live at 201.

    python bench/resume.py                        # sqlite, postgres, redis; a few minutes
    python bench/resume.py --stores sqlite --paths hook --timeout-s 60
    python bench/resume.py --agent httpx          # model calls as plain httpx POSTs, no SDK
    python bench/resume.py --agent stdlib         # both calls with http.client: the proxy's own share
    python bench/resume.py --rounds 5 --paths hook,standby   # medians and ranges of 5 interleaved rounds
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from processes import CLOCK_TICKS, REPO, BenchError, Processes, Server, free_port, http, make_store

BENCH = Path(__file__).resolve().parent
AGENT = BENCH / "resume_agent.py"
PATHS = ("hook", "standby", "attach", "attach-remote", "attach-standby")
STANDBY_PATHS = ("standby", "attach-standby")  # the hook keeps one agent started ahead
CHAT = "/v1/chat/completions"
TARGETS = {"kill_to_live_s": 1.5, "replay_s": 0.5}  # kill → step 201 live; replay of steps 1–200


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"


class CpuClock:
    """The proxy's CPU time (user + system, all its threads), sampled every few ms from /proc
    while a scenario runs, so that the part of it spent during the replay can be read off
    afterwards: a steady measure where wall time depends on who else uses the machine."""

    PERIOD_S = 0.005

    def __init__(self, pid: int):
        self._stat = Path(f"/proc/{pid}/stat")
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                fields = self._stat.read_text().rpartition(")")[2].split()
            except OSError:  # the proxy has stopped
                return
            self.samples.append((time.time(), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float | None:
        """CPU seconds spent from ``start`` to ``end`` (UNIX times), to the nearest samples."""
        before = [cpu for at, cpu in self.samples if at <= start]
        after = [cpu for at, cpu in self.samples if at >= end]
        return round(after[0] - before[-1], 3) if before and after else None


class Scenario:
    """One store, one detection path: a proxy of its own on a fresh store."""

    def __init__(self, args: argparse.Namespace, procs: Processes, provider: Server, store: str, path: str):
        self.args, self.procs, self.provider, self.store, self.path = args, procs, provider, store, path
        self.token = secrets.token_hex(8)
        self.run_id = f"bench-resume-{path}-{uuid.uuid4().hex[:8]}"
        self.logs = procs.workdir / f"{store}-{path}"
        self.agents: list[int] = []  # pids of agent processes, stopped at the end if still alive
        self.cpu: CpuClock | None = None

    def run(self) -> dict:
        url, drop = make_store(self.store, self.procs.workdir, self.args.postgres_url, self.args.redis_url)
        proxy = None
        try:
            proxy = self.start_proxy(url)
            self.cpu = CpuClock(proxy.popen.pid)
            calls_before, chats_before = self.calls(), len(self.arrivals())
            first = self.start_first_attempt(proxy)
            run = self.wait_until_ended(proxy, first + 1)
            return self.figures(run, first, calls_before, chats_before)
        finally:
            for pid in self.agents:
                _kill(pid)
            if self.cpu is not None:
                self.cpu.stop()
            if proxy is not None:
                self.procs.stop(proxy)
            drop()

    # -- the parts ------------------------------------------------------------------------

    def start_proxy(self, store_url: str) -> Server:
        port = free_port()
        env = {"OPENAI_API_KEY": "sk-bench", "AGENT_TIMEOUT_S": str(self.args.timeout_s),
               "AGENT_STEPS": str(self.args.steps), "AGENT_CRASH_AT": str(self.args.crash_at),
               "AGENT_SDK": self.args.agent}
        if self.attached:
            env["AGENT_ATTACH"] = "1"
        sections = {
            "server": {"host": "127.0.0.1", "port": port, "access_log": False},
            "store": {"url": store_url},
            "upstreams.openai": {"url": self.provider.url},
            "upstreams.tools": {"url": self.provider.url + "/tools", "on_ambiguous": "quarantine",
                                "anonymous": "shared"},  # the agent's tools send no credential
            "tenants": {"runs": "shared"},  # the agent and the admin API see one namespace, "default"
            "runs": {"timeout_s": self.args.timeout_s, "max_restarts": 3,
                     "attach_grace_s": self.args.attach_grace_s},
            "hooks.agent": {"command": [sys.executable, str(AGENT)], "log_dir": str(self.logs), "env": env,
                            "allow_tenants": ["default"],  # an agent started elsewhere arms it itself
                            "standby": 1 if self.path in STANDBY_PATHS else 0},
            "supervisor": {"enabled": True},
            "admin": {"token": self.token},
        }
        config = self.procs.workdir / f"resume-{self.store}-{self.path}.toml"
        config.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in body.items()) + "\n"
                                  for name, body in sections.items()))
        argv = [sys.executable, "-m", "idemproxy.proxy.cli", "--log-level", "WARNING", "serve",
                "--config", str(config)]
        return self.procs.start(f"idemproxy-resume-{self.store}-{self.path}", argv, port,
                                lambda s: http("GET", s.url + "/readyz", timeout=1)[0] == 200, timeout=60)

    def start_first_attempt(self, proxy: Server) -> int:
        """Start the attempt that will die; its epoch."""
        if not self.attached:  # registered (a hook is armed through the admin API), then started by it
            self.api(proxy, "POST", f"/admin/runs/{self.run_id}?namespace=default",
                     {"hook": "agent", "timeout_s": self.args.timeout_s})
            return self.api(proxy, "POST", f"/admin/runs/{self.run_id}/restart")["epoch"]
        # started elsewhere (a Job, systemd): by us, holding the attach connection
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEM_", "IDEMPROXY_"))}
        if self.path == "attach-remote":
            env["AGENT_ELSEWHERE"] = "1"
        env.update(OPENAI_API_KEY="sk-bench", AGENT_ATTACH="1", AGENT_RUN_ID=self.run_id,
                   IDEM_PROXY_URL=proxy.url, AGENT_TIMEOUT_S=str(self.args.timeout_s),
                   AGENT_STEPS=str(self.args.steps), AGENT_CRASH_AT=str(self.args.crash_at),
                   AGENT_SDK=self.args.agent)
        with open(self.first_log(0), "wb") as out:
            agent = subprocess.Popen([sys.executable, str(AGENT)], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.agents.append(agent.pid)
        return 0

    def wait_until_ended(self, proxy: Server, last_epoch: int) -> dict:
        """The run, once it ended and its last attempt's process exited (its log is whole).

        The run (its history and journal) is read every 2 s, or at once when the last attempt's
        log says it is done: each read costs the proxy ~2 ms of CPU, which read every 0.2 s
        showed up in the replay's figures."""
        deadline = time.monotonic() + self.args.timeout_s + 120
        run, last_read = {}, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            log = self.logs / f"default.{self.run_id}.{last_epoch}.log"
            done = log.exists() and '"event": "done"' in log.read_text()  # (its last line may be half written)
            if not done and time.monotonic() - last_read < 2.0:
                continue
            last_read = time.monotonic()
            run = self.api(proxy, "GET", f"/admin/runs/{self.run_id}", missing_ok=True)
            if run is None:  # an agent started by us has not registered its run yet
                continue
            self.agents += [e["pid"] for e in run["history"] if e["event"] == "hook-started"
                            and e["pid"] not in self.agents]
            exited = any(e["event"] == "hook-exit" and e["epoch"] >= last_epoch for e in run["history"])
            if run["state"] in ("failed", "dead") or (run["state"] == "completed" and exited):
                return run
        raise BenchError(f"run {self.run_id} did not end in time: {(run or {}).get('state')}\n{proxy.log_tail()}")

    def figures(self, run: dict, first: int, calls_before: dict, chats_before: int) -> dict:
        history = run["history"]
        killed = _events(self.first_log(first))
        kill = next((e for e in killed if e["event"] == "kill"), None)
        resumed = _events(self.logs / f"default.{self.run_id}.{first + 1}.log")
        process = next((e for e in resumed if e["event"] == "process"), None)
        started = next((e for e in resumed if e["event"] == "start"), None)
        replayed = next((e for e in resumed if e["event"] == "replayed"), None)
        live = next((e for e in resumed if e["event"] == "live"), None)
        done = next((e for e in resumed if e["event"] == "done"), None)
        fired = next((e["at"] for e in history if e["event"] == "hook-started" and e["epoch"] == first + 1), None)
        chats = self.arrivals()[chats_before:]  # this scenario's model calls, as they reached the upstream
        calls = {k: v - calls_before.get(k, 0) for k, v in self.calls().items()}
        steps, crash_at = self.args.steps, self.args.crash_at
        live_arrival = chats[crash_at] if len(chats) > crash_at else None  # step 201's
        checks = {
            "ended_completed": run["state"] == "completed",
            "one_more_attempt": run["epoch"] == first + 1,
            "killed_at_step": kill is not None and kill["step"] == crash_at,
            "exactly_once_upstream": calls.get("chat") == steps and calls.get("tool:send_email") == steps,
            "replayed_then_live": (done is not None and live is not None and live["step"] == crash_at + 1
                                   and done["replayed"] == {"chat": crash_at, "tool": crash_at}),
        }
        if self.path in STANDBY_PATHS:  # the restart was handed to a process started ahead, not spawned
            checks["served_by_standby"] = any(e["event"] == "hook-started" and e["epoch"] == first + 1
                                              and e.get("standby") for e in history)
        return {
            "store": self.store, "path": self.path, "timeout_s": self.args.timeout_s,
            "attach_grace_s": self.args.attach_grace_s if self.attached else None,
            "kill_to_restart_s": _since(kill, fired),
            "kill_to_live_s": _since(kill, live_arrival),
            "replay_s": round(replayed["since_first_request"], 3) if replayed else None,
            # where the time after the restart goes: the new process starting, its imports and
            # registration, and the proxy's own part of the replay (its Server-Timing)
            "restart_to_process_s": round(process["started"] - fired, 3) if process and fired else None,
            "process_to_first_request_s": round(started["since_process_start"], 3) if started else None,
            "replay_in_proxy_s": round(replayed["in_proxy_s"], 3) if replayed else None,
            # steady measures (CPU time) of the same: the agent's imports, and the replay's
            # CPU in the agent and in the proxy (all its threads, SQLite's writer included)
            "imports_s": round(process["imports_s"], 3) if process else None,
            "imports_cpu_s": round(process["imports_cpu_s"], 3) if process else None,
            # the agent's CPU from its start to its first request: imports, clients, registration
            "start_cpu_s": round(started["cpu_s"], 3) if started else None,
            "replay_agent_cpu_s": round(replayed["agent_cpu_s"], 3) if replayed else None,
            "replay_proxy_cpu_s": self.cpu.between(started["t"], replayed["t"]) if started and replayed else None,
            "checks": checks, "ok": all(checks.values()), "history": history,
            "calls": calls,
        }

    # -- helpers --------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether the agent holds the attach connection (and the benchmark starts its first attempt)."""
        return self.path.startswith("attach")

    def first_log(self, epoch: int) -> Path:
        if self.attached:
            return self.logs / f"first-attempt-{self.run_id}.log"
        return self.logs / f"default.{self.run_id}.{epoch}.log"

    def api(self, proxy: Server, method: str, path: str, body: dict | None = None,
            missing_ok: bool = False) -> dict | None:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        status, _, text = http(method, proxy.url + path, json.dumps(body or {}).encode()
                               if method == "POST" else None, headers)
        if status == 404 and missing_ok:
            return None
        if status >= 300:
            raise BenchError(f"{method} {path}: {status} {text[:300]!r}")
        return json.loads(text)

    def calls(self) -> dict:
        return json.loads(http("GET", self.provider.url + "/_calls")[2])

    def arrivals(self) -> list[float]:
        return json.loads(http("GET", self.provider.url + "/_arrivals")[2]).get(CHAT, [])


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def _since(kill: dict | None, at: float | None) -> float | None:
    return None if kill is None or at is None else round(at - kill["t"], 3)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def direct_steps(provider: Server, steps: int, agent: str) -> dict:
    """The agent's ``steps`` straight to the fake provider, no proxy: its own share of a replay
    (``seconds``, and ``cpu_s`` in the agent)."""
    env = {**os.environ, "AGENT_DIRECT_URL": provider.url, "AGENT_CRASH_AT": str(steps), "AGENT_SDK": agent}
    done = subprocess.run([sys.executable, str(AGENT)], env=env, capture_output=True, text=True, timeout=120)
    found = [json.loads(line) for line in done.stdout.splitlines() if '"direct"' in line]
    return {"seconds": round(found[0]["seconds"], 3), "cpu_s": round(found[0]["cpu_s"], 3)} if found else {}


def _seconds(value: float | None, target: float | None = None) -> str:
    if value is None:
        return "–"
    mark = "" if target is None else (" ✓" if value <= target else " ✗")
    return f"{value:.2f} s{mark}"


def _spread(values: list[float | None], target: float | None = None) -> str:
    """The median of a figure over the rounds (judged against ``target``), and its range."""
    found = sorted(v for v in values if v is not None)
    if not found:
        return "–"
    median = _seconds(statistics.median(found), target)
    return median if len(found) == 1 else f"{median} ({found[0]:.2f}–{found[-1]:.2f})"


def markdown(rows: list[dict], skipped: dict[str, str], direct: list[dict]) -> str:
    """One line per store and path: the median of its rounds and, with several, their range."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["store"], row["path"]), []).append(row)
    rounds = max((len(g) for g in groups.values()), default=1)
    lines = [f"Median{f' (range) of {rounds} rounds' if rounds > 1 else ''}; ✓/✗ against the targets (TARGETS).\n",
             "| store | detection (grace) | timeout_s | kill → restart (hook fired) | kill → step 201 live "
             "| replay of steps 1–200 | of it in the proxy | hook fired → first request | agent's imports (CPU) "
             "| replay CPU: agent, proxy | checks |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for (store, path), group in groups.items():
        def of(name: str) -> list[float | None]:
            return [r[name] for r in group]
        to_request = [None if r["restart_to_process_s"] is None or r["process_to_first_request_s"] is None
                      else r["restart_to_process_s"] + r["process_to_first_request_s"] for r in group]
        failed = sorted({name for r in group for name, ok in r["checks"].items() if not ok})
        grace = f" ({group[0]['attach_grace_s']:g} s)" if group[0].get("attach_grace_s") is not None else ""
        lines.append(f"| {store} | {path}{grace} | {group[0]['timeout_s']:g} | {_spread(of('kill_to_restart_s'))} "
                     f"| {_spread(of('kill_to_live_s'), TARGETS['kill_to_live_s'])} "
                     f"| {_spread(of('replay_s'), TARGETS['replay_s'])} | {_spread(of('replay_in_proxy_s'))} "
                     f"| {_spread(to_request)} | {_spread(of('imports_cpu_s'))} "
                     f"| {_spread(of('replay_agent_cpu_s'))}, {_spread(of('replay_proxy_cpu_s'))} "
                     f"| {'ok' if not failed else 'FAILED: ' + ', '.join(failed)} |")
    for what, why in skipped.items():
        lines.append(f"| {what} | – | – | – | – | – | – | – | – | – | not measured: {why} |")
    lines.append(f"\nThe same steps straight to the fake provider, without the proxy: "
                 f"{_spread([d.get('seconds') for d in direct])}, "
                 f"{_spread([d.get('cpu_s') for d in direct])} of CPU in the agent (its own share of a replay on "
                 "this machine, now). A standby paid its imports before the restart.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stores", type=lambda v: [s for s in v.split(",") if s], default=["sqlite", "postgres", "redis"])
    p.add_argument("--paths", type=lambda v: [s for s in v.split(",") if s], default=list(PATHS),
                   help="hook (a child of the supervisor), standby (the same, started ahead: standby = 1), "
                        "attach (the held connection, the agent on this host), attach-remote (as from "
                        "another host: the grace), attach-standby")
    p.add_argument("--timeout-s", type=float, default=60.0, help="the run's silence timeout (default 60)")
    p.add_argument("--attach-grace-s", type=float, default=1.0,
                   help="[runs] attach_grace_s: how long a held connection may stay gone before its "
                        "attempt is lost (default 1.0, the proxy's); attach-remote's kill -> restart")
    p.add_argument("--agent", choices=("openai", "httpx", "stdlib"), default="openai",
                   help="the agent's calls: the model's through the openai SDK (default), or as plain httpx "
                        "POSTs (the same requests without the SDK's own work per call); stdlib: both calls "
                        "with http.client, the least a Python agent spends per call")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every store and path this many times, interleaved; the table gives the "
                        "median and range (this machine's speed drifts by tens of percent)")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--crash-at", type=int, default=200)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "resume.json"))
    p.add_argument("--postgres-url", default=os.environ.get(
        "IDEMPROXY_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"))
    p.add_argument("--redis-url", default=os.environ.get("IDEMPROXY_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    args = p.parse_args(argv)
    if unknown := set(args.paths) - set(PATHS):
        p.error(f"unknown path(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: processes stopped
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    paths = list(args.paths)
    with tempfile.TemporaryDirectory(prefix="idem-resume-") as tmp, Processes(Path(tmp)) as procs:
        port = free_port()
        provider = procs.start("provider", [sys.executable, str(BENCH / "provider.py"), "--port", str(port),
                                            "--arrivals"], port,
                               lambda s: http("GET", s.url + "/_calls", timeout=1)[0] == 200)
        direct: list[dict] = []
        # rounds interleave stores and paths, so that the machine's drift spreads over all of them
        for _, store, path in itertools.product(range(args.rounds), args.stores, paths):
            if store == args.stores[0] and path == paths[0]:
                direct.append(direct_steps(provider, args.crash_at, args.agent))
                print(f"  {args.crash_at} steps straight to the provider: {_seconds(direct[-1].get('seconds'))}",
                      flush=True)
            print(f"  {store:8} {path:6} ...", flush=True)
            try:
                row = Scenario(args, procs, provider, store, path).run()
            except BenchError as exc:
                skipped[f"{store} {path}"] = str(exc).splitlines()[0]
                print(f"  {store} {path}: FAILED: {exc}", file=sys.stderr, flush=True)
                continue
            rows.append(row)
            print(f"  {store:8} {path:6} kill->restart {_seconds(row['kill_to_restart_s'])}, kill->live "
                  f"{_seconds(row['kill_to_live_s'])}, replay {_seconds(row['replay_s'])} (CPU: agent "
                  f"{_seconds(row['replay_agent_cpu_s'])}, proxy {_seconds(row['replay_proxy_cpu_s'])}), "
                  f"load {os.getloadavg()[0]:.2f}, "
                  f"{'ok' if row['ok'] else row['checks']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
            "agent": args.agent, "rounds": args.rounds, "steps": args.steps, "crash_at": args.crash_at,
            "attach_grace_s": args.attach_grace_s, "direct_steps": direct}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=2) + "\n")
    print()
    print(markdown(rows, skipped, direct))
    print(f"\nwritten: {out}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
