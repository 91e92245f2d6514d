"""How the console writes times, durations, money, counts and header values (Jinja filters)."""

from __future__ import annotations

import math
import time

from ..upstream.wire import as_text

FILTERS = {}


def _filter(fn):
    FILTERS[fn.__name__] = fn
    return fn


@_filter
def clock(at: float | None) -> str:
    """``14:03:07`` (UTC)."""
    return time.strftime("%H:%M:%S", time.gmtime(at)) if at else "–"


@_filter
def stamp(at: float | None) -> str:
    """``2026-12-01 14:03:07 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if at else "–"


@_filter
def ago(at: float | None) -> str:
    if not at:
        return "–"
    seconds = max(0.0, time.time() - at)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


@_filter
def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


@_filter
def usd(amount: float | None) -> str:
    """Dollars to the cent, and fractions of a cent to two significant digits: one model call
    costs millionths of a dollar, and ``$0.00`` would say it cost nothing."""
    if amount is None:
        return "–"
    if amount == 0 or amount >= 0.01:
        return f"${amount:,.2f}"
    return f"${amount:.{min(12, 1 - math.floor(math.log10(amount)))}f}"


@_filter
def seconds(value: float) -> str:
    """A configured timeout as written: ``60 s``, ``0.5 s``."""
    return f"{value:g} s"


@_filter
def num(n: int | float | None) -> str:
    return "–" if n is None else f"{n:,.0f}"


@_filter
def header_text(value: str) -> str:
    """A kept header value as text (its bytes read as UTF-8: wire.as_text)."""
    return as_text(value)


@_filter
def short(kid: str | None) -> str:
    return (kid or "")[:12]


@_filter
def tool(path: str) -> str:
    """The MCP tool a journaled ``tools/call`` named (its path is ``/mcp#send_email``), or ''."""
    return path.partition("#")[2]


@_filter
def bare_path(path: str) -> str:
    return path.partition("#")[0]
