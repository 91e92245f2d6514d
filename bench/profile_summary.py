"""Where the time goes: a text summary of a py-spy ``--format raw`` (collapsed) profile.

Each line of a collapsed profile is one stack, ``frame;frame;...;frame count``, a frame
being ``function (file:line)``. We list the functions with the most samples on top of the
stack (self), the most samples anywhere in the stack (inclusive), and the inclusive
share per source file, which is what says "handler.py costs this much per request".

    python bench/profile_summary.py bench/results/profile/sqlite-w1-record.collapsed
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
TOP = 30


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for raw in stack.split(";"):
        m = FRAME.match(raw.strip())
        if m:
            out.append((m["func"], _short(m["file"])))
        else:
            out.append((raw.strip(), ""))
    return out


def _short(path: str) -> str:
    for marker in ("site-packages/", "/main/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def summarize(path: Path, requests: int | None = None, rate: int | None = None) -> str:
    """The summary as text; with ``requests`` and the sampling ``rate``, also in µs per request."""
    self_time: Counter = Counter()
    inclusive: Counter = Counter()
    files: Counter = Counter()
    total = 0
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in _frames(stack) if f[1]]  # drop process and thread names
        if not frames:
            continue
        self_time[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
        for file in {f for _, f in frames}:
            files[file] += n
    if not total:
        return f"{path}: no samples\n"

    per_request = 1e6 / rate / requests if requests and rate else None

    def table(title: str, counter: Counter, key) -> list[str]:
        out = [f"\n## {title}", f"{'%':>6}  {'samples':>8}  {'us/req':>7}  what"]
        for item, n in counter.most_common(TOP):
            us = f"{n * per_request:7.1f}" if per_request else f"{'':7}"
            out.append(f"{100 * n / total:6.1f}  {n:8d}  {us}  {key(item)}")
        return out

    lines = [f"# {Path(path).name}: {total} samples (idle excluded)"
             + (f", {requests} requests at {rate} Hz" if per_request else "")]
    lines += table("self (top of stack)", self_time, lambda f: f"{f[0]}  [{f[1]}]")
    lines += table("inclusive (anywhere in the stack)", inclusive, lambda f: f"{f[0]}  [{f[1]}]")
    lines += table("inclusive by file", files, str)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) not in (2, 4):
        sys.exit("usage: profile_summary.py FILE.collapsed [REQUESTS RATE]")
    print(summarize(Path(sys.argv[1]), *(int(x) for x in sys.argv[2:])))
