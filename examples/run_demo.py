"""Run one example end to end, offline: crash, supervisor restart, replay, exact counts.

    python examples/run_demo.py openai               # or: anthropic, langgraph, email, plain, mcp, mcp_stateless
    python examples/run_demo.py email --steps 4 --crash-at 2
    python examples/run_demo.py plain --json         # one JSON summary on stdout (for tests)

It starts, on free ports and with a SQLite journal in a temporary folder:
the fake provider (tests/support/fake_provider.py), the email tool server when the example needs
it, and ``idemproxy serve --config examples/config.toml`` (the same file as by hand; only
ports, store and log folder are overridden). Then it starts the example's first attempt
with ``--crash-at K``, sees it die by SIGKILL, waits for the supervisor to start it again
and for the run to end, prints what the upstreams counted and how long each phase took,
and stops everything it started. Exit code 0 when the run completed with exactly one
model call and one tool call per step, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parent
REPO = EXAMPLES_DIR.parent
CONFIG = EXAMPLES_DIR / "config.toml"
FAKE_PROVIDER = REPO / "tests" / "support" / "fake_provider.py"
ENDED = ("completed", "failed", "dead")
STEP_LINE = re.compile(r"^step (\d+)/(\d+): model (replayed|live|\?), tool (replayed|live)")
DEMO_KEY = "sk-demo-not-a-real-key"


@dataclass(frozen=True)
class Example:
    """How to start an example's first attempt and what its upstreams should count."""

    name: str
    hook: str            # the [hooks.*] entry of config.toml that restarts it
    model_call: str      # the fake provider's counter of its model calls
    tool_call: str       # the counter of its tool calls ("outbox" for the email sender)
    email_server: bool = False
    mcp_server: bool = False  # examples/mcp_tool_server.py, whose counters are "mcp:<tool>"
    revision: str | None = None  # the MCP revision the agent speaks

    def first_attempt(self, python: str, steps: int, crash_at: int) -> list[str]:
        if self.name == "plain":  # unmodified: the wrapper gives it its URLs
            return ["sh", "examples/only_env.sh", python, "examples/plain_agent.py",
                    "--crash-at", str(crash_at)]
        if self.name == "email":
            recipients = [f"person{n}@example.com" for n in range(1, steps + 1)]
            return [python, "examples/email_agent.py", *[a for to in recipients for a in ("--to", to)],
                    "--crash-at", str(crash_at)]
        if self.mcp_server:
            return [python, "examples/mcp_agent.py", "--steps", str(steps), "--crash-at", str(crash_at),
                    "--revision", self.revision or "legacy"]
        return [python, f"examples/{self.name}_agent.py", "--steps", str(steps),
                "--crash-at", str(crash_at)]


EXAMPLES = {e.name: e for e in [
    Example("openai", "openai_agent", "chat", "tool:record_step"),
    Example("anthropic", "anthropic_agent", "messages", "tool:record_step"),
    Example("langgraph", "langgraph_agent", "chat", "tool:record_step"),
    Example("email", "email_agent", "chat", "outbox", email_server=True),
    Example("plain", "plain_agent", "chat", "tool:log_step"),
    Example("mcp", "mcp_agent", "chat", "mcp:send_email", mcp_server=True, revision="legacy"),
    Example("mcp_stateless", "mcp_agent", "chat", "mcp:send_email", mcp_server=True, revision="2026-07-28"),
]}


# -- small helpers --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, token: str | None = None, timeout: float = 5.0) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_until_up(url: str, process: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{log.stem} exited with {process.returncode}: {tail(log)}")
        try:
            get_json(url, timeout=1.0)
            return
        except (OSError, ValueError):
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s: {tail(log)}")


def tail(path: Path, size: int = 3000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else f"({path} missing)"


def attempt_summary(output: str) -> dict[str, Any]:
    """The step lines an agent printed: which steps were replayed and which went live."""
    steps = [m.groups() for m in map(STEP_LINE.match, output.splitlines()) if m]
    return {"steps": [int(s[0]) for s in steps],
            "served": [[int(s[0]), s[2], s[3]] for s in steps],  # [step, model, tool]
            "model": {"replayed": sum(s[2] == "replayed" for s in steps),
                      "live": sum(s[2] == "live" for s in steps)},
            "tool": {"replayed": sum(s[3] == "replayed" for s in steps),
                     "live": sum(s[3] == "live" for s in steps)},
            "crashed": "crash: SIGKILL" in output,
            "done": any(line.startswith("done:") for line in output.splitlines())}


# -- the processes --------------------------------------------------------------------------

@dataclass
class Demo:
    """Everything one demo run started, so that all of it is stopped at the end."""

    example: Example
    workdir: Path
    store_url: str
    python: str = sys.executable
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    fake_url: str = ""
    email_url: str = ""
    mcp_url: str = ""
    proxy_url: str = ""

    @property
    def outbox(self) -> Path:
        return self.workdir / "outbox.jsonl"

    def environment(self, steps: int) -> dict[str, str]:
        """What the proxy and the first attempt share: the restarted attempt inherits the
        proxy's environment, and must send the same credential as the first."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEM_", "IDEMPROXY_"))}
        env["PATH"] = os.path.dirname(self.python) + os.pathsep + env.get("PATH", "")  # `python` in hooks
        env.setdefault("OPENAI_API_KEY", DEMO_KEY)
        env.setdefault("ANTHROPIC_API_KEY", DEMO_KEY)
        env["AGENT_STEPS"] = str(steps)  # the plain agent's task length
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL)
        self.processes.append((name, process))
        return process

    def start_services(self, env: dict[str, str]) -> None:
        port = free_port()
        self.fake_url = f"http://127.0.0.1:{port}"
        fake = self.spawn("fake-provider", [self.python, str(FAKE_PROVIDER), "--port", str(port)], env)
        if self.example.email_server:
            port = free_port()
            self.email_url = f"http://127.0.0.1:{port}"
            email = self.spawn("email-server", [self.python, "examples/email_tool_server.py",
                                                "--port", str(port), "--outbox", str(self.outbox)], env)
        if self.example.mcp_server:
            port = free_port()
            self.mcp_url = f"http://127.0.0.1:{port}"
            mcp = self.spawn("mcp-server", [self.python, "examples/mcp_tool_server.py", "--port", str(port)], env)
        port = free_port()
        self.proxy_url = f"http://127.0.0.1:{port}"
        overrides = {
            "upstreams.openai.url": self.fake_url,
            "upstreams.anthropic.url": self.fake_url,
            "upstreams.tools.url": f"{self.fake_url}/tools",
            f"hooks.{self.example.hook}.log_dir": str(self.workdir / "hook-logs"),
            "admin.token": self.admin_token,
        }
        if self.email_url:
            overrides["upstreams.email.url"] = self.email_url
        if self.mcp_url:
            overrides["upstreams.mcp.url"] = self.mcp_url
        argv = [self.python, "-m", "idemproxy.proxy.cli", "serve", "--config", str(CONFIG),
                "--port", str(port), "--store", self.store_url]
        for option, value in overrides.items():
            argv += ["--set", f"{option}={value}"]
        proxy = self.spawn("proxy", argv, env)
        wait_until_up(f"{self.fake_url}/_calls", fake, self.workdir / "fake-provider.log")
        if self.example.email_server:
            wait_until_up(f"{self.email_url}/outbox", email, self.workdir / "email-server.log")
        if self.example.mcp_server:
            wait_until_up(f"{self.mcp_url}/calls", mcp, self.workdir / "mcp-server.log")
        wait_until_up(f"{self.proxy_url}/healthz", proxy, self.workdir / "proxy.log")

    def run_state(self, run_id: str) -> dict[str, Any] | None:
        """The run as operators see it (admin API): with its history of hook starts and exits."""
        try:
            return get_json(f"{self.proxy_url}/admin/runs/{run_id}", self.admin_token)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def stop(self) -> None:
        """Stop what we started, newest first: SIGTERM, then SIGKILL after 10 s."""
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def hook_processes(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The attempts the supervisor started (pid, log) and whether their exit is recorded."""
    exits = {e["pid"]: e.get("code") for e in run.get("history", []) if e.get("event") == "hook-exit"}
    return [{"pid": e["pid"], "epoch": e["epoch"], "log": e["log"], "exited": e["pid"] in exits,
             "code": exits.get(e["pid"])}
            for e in run.get("history", []) if e.get("event") == "hook-started"]


def wait_for_end(demo: Demo, run_id: str, deadline: float) -> dict[str, Any] | None:
    """The run once it has ended and every attempt the supervisor started has exited."""
    run = None
    while time.monotonic() < deadline:
        run = demo.run_state(run_id)
        if run and run["state"] in ENDED and all(p["exited"] for p in hook_processes(run)):
            return run
        time.sleep(0.1)
    return run


def read_journal(demo: Demo, run_id: str, replays: int, wait: float = 2.5) -> dict[str, Any]:
    """The run with its journal entries (admin API), once ``replays`` replays are counted:
    the proxy adds replay counts to the store once a second, not on the request path."""
    deadline = time.monotonic() + wait
    while True:
        journal = get_json(f"{demo.proxy_url}/admin/runs/{run_id}", demo.admin_token)
        if sum(e.get("replays") or 0 for e in journal["steps"]) >= replays or time.monotonic() > deadline:
            return journal
        time.sleep(0.1)


def stop_restarted_attempts(run: dict[str, Any] | None) -> None:
    """Kill attempts the supervisor started that are still running (on a timeout).

    Each was started in its own session, so its process group is its pid: the group
    takes the agent along with a wrapper such as only_env.sh."""
    for attempt in hook_processes(run or {}):
        if not attempt["exited"]:
            try:
                os.killpg(attempt["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- one demo -------------------------------------------------------------------------------

def run_demo(example: Example, steps: int, crash_at: int, workdir: Path, store_url: str | None,
             timeout: float) -> dict[str, Any]:
    """Start everything, crash the first attempt, wait for the run to end; the summary."""
    demo = Demo(example, workdir, store_url or f"sqlite:///{workdir / 'journal.db'}")
    run_id = f"{example.name}-demo-{secrets.token_hex(4)}"
    env = demo.environment(steps)
    run: dict[str, Any] | None = None
    try:
        demo.start_services(env)
        started = time.time()
        deadline = time.monotonic() + timeout
        first = demo.spawn("attempt-0", example.first_attempt(demo.python, steps, crash_at),
                           {**env, "IDEM_PROXY_URL": demo.proxy_url, "IDEM_RUN_ID": run_id})
        try:
            first_exit = first.wait(max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            first.kill()
            first_exit = first.wait()
        crashed = time.time()
        run = wait_for_end(demo, run_id, deadline)
        calls = get_json(f"{demo.fake_url}/_calls")
        if demo.mcp_url:
            calls.update({f"mcp:{tool}": n for tool, n in get_json(f"{demo.mcp_url}/calls").items()})
        journal = read_journal(demo, run_id, replays=2 * crash_at) if run else None
    finally:
        stop_restarted_attempts(run)
        demo.stop()
    summary = summarize(demo, run_id, steps, crash_at, run or {}, calls, journal or {})
    summary["first_attempt"]["exit_code"] = first_exit
    ended_at, restart_at = summary["ended_at"], summary["restart_at"]
    summary["timings_s"] = {
        "first_attempt_until_crash": round(crashed - started, 3),
        "crash_until_restart": round(restart_at - crashed, 3) if restart_at else None,
        "restart_until_completed": round(ended_at - restart_at, 3) if restart_at and ended_at else None,
        "total": round((ended_at or time.time()) - started, 3),
    }
    return summary


def summarize(demo: Demo, run_id: str, steps: int, crash_at: int, run: dict[str, Any],
              calls: dict[str, int], journal: dict[str, Any]) -> dict[str, Any]:
    """What happened, from the run, the upstreams' counters, the journal and the logs."""
    example = demo.example
    outbox = ([json.loads(line) for line in demo.outbox.read_text().splitlines() if line]
              if demo.outbox.exists() else [])
    if example.email_server:
        calls = {**calls, "outbox": len(outbox)}
    first_output = (demo.workdir / "attempt-0.log").read_text(errors="replace")
    restarted = []
    for attempt in hook_processes(run):
        log = Path(attempt["log"])
        output = log.read_text(errors="replace") if log.exists() else ""
        restarted.append({**attempt, "output": output, **attempt_summary(output)})
    history = run.get("history", [])
    expected = {example.model_call: steps, example.tool_call: steps}
    entries = journal.get("steps", [])
    summary = {
        "example": example.name, "run_id": run_id, "workdir": str(demo.workdir),
        "steps": steps, "crash_at": crash_at,
        "state": run.get("state"), "epoch": run.get("epoch"), "restarts": run.get("restarts"),
        "calls": dict(calls), "expected": expected,
        "journal": {"entries": len(entries), "replays": sum(e.get("replays") or 0 for e in entries),
                    "states": sorted({e.get("state") for e in entries})},
        "outbox": outbox,
        "first_attempt": {"output": first_output, **attempt_summary(first_output)},
        "restarted_attempts": restarted,
        "history": history,
        "restart_at": next((e["at"] for e in history if e.get("event") == "restart"), None),
        "ended_at": run.get("ended_at"),
    }
    summary["ok"] = bool(summary["state"] == "completed"
                         and all(calls.get(name) == n for name, n in expected.items()))
    return summary


def report(summary: dict[str, Any]) -> str:
    """The summary for a person."""
    first = summary["first_attempt"]
    lines = [f"== example {summary['example']}: run {summary['run_id']}, {summary['steps']} steps, "
             f"crash after step {summary['crash_at']}",
             f"-- first attempt (exit {first['exit_code']}):", first["output"].rstrip()]
    for attempt in summary["restarted_attempts"]:
        lines += [f"-- attempt at epoch {attempt['epoch']}, started by the supervisor "
                  f"(exit {attempt['code']}):", attempt["output"].rstrip()]
    lines.append(f"== run {summary['state']}, epoch {summary['epoch']}, restarts {summary['restarts']}")
    counted = ", ".join(f"{name} {summary['calls'].get(name)} (expected {n})"
                        for name, n in summary["expected"].items())
    lines.append(f"== upstream calls: {counted}")
    journal = summary["journal"]
    lines.append(f"== journal: {journal['entries']} entries, {journal['replays']} replays")
    if summary["outbox"]:
        lines.append("== outbox: " + ", ".join(m["to"] for m in summary["outbox"]))
    timings = summary["timings_s"]
    lines.append("== timings: " + ", ".join(f"{k.replace('_', ' ')} {v}s" for k, v in timings.items()
                                            if v is not None))
    lines.append("== OK" if summary["ok"] else f"== NOT OK (files kept in {summary['workdir']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", choices=sorted(EXAMPLES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--crash-at", type=int, default=3, metavar="K")
    parser.add_argument("--store", help="store URL (default: SQLite in the work folder)")
    parser.add_argument("--workdir", type=Path, help="keep journal and logs here (default: a "
                        "temporary folder, removed unless the demo fails)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole run")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if not 1 <= args.crash_at < args.steps:
        parser.error("--crash-at must be at least 1 and less than --steps")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"idemproxy-demo-{args.example}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    summary = run_demo(EXAMPLES[args.example], args.steps, args.crash_at, workdir.resolve(),
                       args.store, args.timeout)
    print(json.dumps(summary) if args.json else report(summary), flush=True)
    if args.workdir is None and summary["ok"]:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
