"""Every example in examples/ run end to end, the way a person runs it.

Each test runs ``examples/run_demo.py EXAMPLE --json`` in a subprocess: real fake
provider, real ``idemproxy serve --config examples/config.toml`` with the supervisor
in-process and a SQLite journal, the example's first attempt started with
``--steps 5 --crash-at 3``. The attempt SIGKILLs itself; the supervisor notices the
silence and starts the example again through its ``[hooks.*]`` command; the new attempt
replays steps 1-3 from the journal and goes live at step 4. The tests check what the
upstreams counted (exactly one model call and one tool call per step), the run (completed,
epoch 1, one restart) and what each attempt saw.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example runs as a subprocess demo that SIGKILLs itself and is restarted

REPO = Path(__file__).resolve().parents[2]
RUN_DEMO = REPO / "examples" / "run_demo.py"
STEPS, CRASH_AT = 5, 3  # not the agents' default of 6: the restarted attempt must read it back
SIGKILLED = (-9, 137)  # python killed by SIGKILL; the sh wrapper reporting its child's death

EXPECTED_CALLS = {
    "openai": {"chat": STEPS, "tool:record_step": STEPS},
    "anthropic": {"messages": STEPS, "tool:record_step": STEPS},
    "langgraph": {"chat": STEPS, "tool:record_step": STEPS},
    "email": {"chat": STEPS, "outbox": STEPS},
    "plain": {"chat": STEPS, "tool:log_step": STEPS},
    "mcp": {"chat": STEPS, "mcp:send_email": STEPS},
    "mcp_stateless": {"chat": STEPS, "mcp:send_email": STEPS},
}


def run_demo(example: str, workdir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, str(RUN_DEMO), example, "--json", "--workdir", str(workdir),
         "--steps", str(STEPS), "--crash-at", str(CRASH_AT), "--timeout", "40"],
        cwd=REPO, capture_output=True, text=True, timeout=55)
    assert done.stdout.strip(), f"run_demo printed nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["exit_code"] = done.returncode
    return summary


def explain(summary: dict, workdir: Path) -> str:
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(workdir.rglob("*.log"))}
    return json.dumps({k: summary.get(k) for k in ("state", "epoch", "restarts", "calls", "history")},
                      indent=1) + "\n" + "\n".join(f"--- {name}\n{text}" for name, text in logs.items())


def check_crash_and_resume(summary: dict, workdir: Path, example: str) -> dict:
    """What every example must show; returns the restarted attempt for further checks."""
    why = explain(summary, workdir)
    assert summary["exit_code"] == 0 and summary["ok"], why
    assert summary["state"] == "completed", why
    assert summary["epoch"] == 1 and summary["restarts"] == 1, why
    assert summary["calls"] == EXPECTED_CALLS[example], why  # nothing paid or sent twice

    first = summary["first_attempt"]
    assert first["exit_code"] in SIGKILLED and first["crashed"], why
    assert not first["done"]

    (restarted,) = summary["restarted_attempts"]
    assert restarted["epoch"] == 1 and restarted["code"] == 0 and restarted["done"], why
    restart_events = [e for e in summary["history"] if e["event"] == "restart"]
    assert [e["epoch"] for e in restart_events] == [1]

    # The journal holds one entry per call of the run, all recorded, and the restarted
    # attempt was answered from it for the crashed attempt's calls.
    journal = summary["journal"]
    assert journal["entries"] == 2 * STEPS and journal["states"] == ["complete"], journal
    assert journal["replays"] == 2 * CRASH_AT, journal
    return restarted


def check_served(first: dict, restarted: dict) -> None:
    """Steps 1..K live in the first attempt; replayed, then live from K+1, in the second."""
    assert first["served"] == [[n, "live", "live"] for n in range(1, CRASH_AT + 1)]
    assert restarted["served"] == (
        [[n, "replayed", "replayed"] for n in range(1, CRASH_AT + 1)]
        + [[n, "live", "live"] for n in range(CRASH_AT + 1, STEPS + 1)])


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


def replies(output: str) -> list[str]:
    """What each step printed after "step n/N: model X, tool Y: " (the model's reply)."""
    return [line.split(": ", 2)[2] for line in step_lines(output)]


@pytest.mark.parametrize("example", ["openai", "anthropic", "langgraph"])
def test_sdk_agent_resumes_after_crash(example, tmp_path):
    summary = run_demo(example, tmp_path / "demo")
    restarted = check_crash_and_resume(summary, tmp_path / "demo", example)
    check_served(summary["first_attempt"], restarted)
    # A replay is the recorded answer: the restarted attempt saw the same replies.
    assert replies(restarted["output"])[:CRASH_AT] == replies(summary["first_attempt"]["output"])
    assert len(set(replies(restarted["output"]))) == STEPS


def test_email_agent_sends_each_email_once(tmp_path):
    summary = run_demo("email", tmp_path / "demo")
    restarted = check_crash_and_resume(summary, tmp_path / "demo", "email")
    check_served(summary["first_attempt"], restarted)

    recipients = [f"person{n}@example.com" for n in range(1, STEPS + 1)]
    outbox = summary["outbox"]
    assert [m["to"] for m in outbox] == recipients  # each once, in order
    assert len({m["id"] for m in outbox}) == STEPS
    assert all(m["subject"] == "Status" and m["body"] for m in outbox)
    # The restarted attempt was told the ids of the emails the crashed one sent: the
    # journal answered for them, the sender never heard of the retry.
    first_ids = replies(summary["first_attempt"]["output"])
    again_ids = replies(restarted["output"])
    assert again_ids[:CRASH_AT] == first_ids
    assert [f"{m['id']} to {m['to']}" for m in outbox] == again_ids


def test_plain_agent_resumes_with_environment_only(tmp_path):
    summary = run_demo("plain", tmp_path / "demo")
    restarted = check_crash_and_resume(summary, tmp_path / "demo", "plain")
    first_lines = step_lines(summary["first_attempt"]["output"])
    again_lines = step_lines(restarted["output"])
    assert [line.split(":")[0] for line in first_lines] == [f"step {n}/{STEPS}" for n in range(1, CRASH_AT + 1)]
    assert [line.split(":")[0] for line in again_lines] == [f"step {n}/{STEPS}" for n in range(1, STEPS + 1)]
    # Derived keys: the n-th identical request of the new attempt got the n-th record.
    assert again_lines[:CRASH_AT] == first_lines
    # The wrapper, not the agent, marked the run completed after a clean exit.
    assert "only_env.sh: run" in restarted["output"] and restarted["output"].rstrip().endswith("completed")
    module = ast.parse((REPO / "examples" / "plain_agent.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(module)
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert imported == {"__future__", "argparse", "os", "signal", "sys", "httpx", "openai"}
    strings = {node.value for node in ast.walk(module) if isinstance(node, ast.Constant)
               and isinstance(node.value, str)} - {ast.get_docstring(module, clean=False)}
    assert not any("IDEM" in s.upper() for s in strings)  # no run id, epoch or key of its own


@pytest.mark.parametrize("example", ["mcp", "mcp_stateless"])
def test_mcp_agent_runs_each_tool_once(example, tmp_path):
    """The MCP agent over 2025-11-25 sessions (a new session after the restart) and over
    2026-07-28 (stateless): each email sent once, the replayed steps answered the same."""
    summary = run_demo(example, tmp_path / "demo")
    restarted = check_crash_and_resume(summary, tmp_path / "demo", example)
    check_served(summary["first_attempt"], restarted)
    assert replies(restarted["output"])[:CRASH_AT] == replies(summary["first_attempt"]["output"])
    assert len(set(replies(restarted["output"]))) == STEPS
