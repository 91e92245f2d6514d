"""Charts drawn on the server as inline SVG: no script, no library, nothing fetched."""

from __future__ import annotations

import math
import time
from html import escape
from typing import Callable

# bucket widths a time axis may use, smallest first: at most MAX_BARS bars across the span
BUCKETS_S = (60, 300, 900, 3600, 6 * 3600, 86400)
MAX_BARS = 48
MIN_BARS = 24
Format = Callable[[float], str]


def bucket_size(first: float, last: float) -> int:
    span = max(last - first, 1.0)
    return next((b for b in BUCKETS_S if span / b <= MAX_BARS), BUCKETS_S[-1])


def over_time(points: list[tuple[float, float]], fmt: Format, *, title: str,
              width: int = 1160, height: int = 220) -> str:
    """Vertical bars: ``points`` (time, amount) summed per bucket, the bucket chosen for the span."""
    if not points:
        return _empty(title, width)
    now = time.time()
    size = bucket_size(min(t for t, _ in points), max(now, max(t for t, _ in points)))
    sums: dict[int, float] = {}
    for at, amount in points:
        sums[int(at // size)] = sums.get(int(at // size), 0.0) + amount
    last = max(int(now // size), max(sums))
    first = min(min(sums), last - MIN_BARS + 1)  # a few bars' worth of axis even for one busy minute
    slots = list(range(first, last + 1))
    left, right, top, bottom = 72, 12, 28, 30
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = _nice(max(sums.values()))
    slot_w = plot_w / len(slots)
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="100%" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text class="chart-title" x="{left}" y="16">{escape(title)}</text>']
    for i in range(5):  # grid lines with their amounts
        y = top + plot_h - plot_h * i / 4
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="axis" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(fmt(peak * i / 4))}</text>')
    label_every = max(1, math.ceil(len(slots) / 8))
    for i, slot in enumerate(slots):
        amount = sums.get(slot, 0.0)
        h = plot_h * amount / peak if peak else 0
        x = left + i * slot_w
        when = _when(slot * size, size)
        parts.append(f'<rect class="bar" x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(slot_w - 2, 1):.1f}" '
                     f'height="{h:.1f}"><title>{escape(when)}: {escape(fmt(amount))}</title></rect>')
        if i % label_every == 0:
            parts.append(f'<text class="axis" x="{x + slot_w / 2:.1f}" y="{height - 10}" '
                         f'text-anchor="middle">{escape(when)}</text>')
    parts.append(f'<text class="axis" x="{width - right}" y="16" text-anchor="end">'
                 f'per {escape(_duration(size))}, UTC</text></svg>')
    return "".join(parts)


def by_name(items: list[tuple[str, float, str]], fmt: Format, *, title: str, width: int = 1160) -> str:
    """Horizontal bars, largest first: (label, amount, link) each."""
    items = sorted((i for i in items if i[1] > 0), key=lambda i: -i[1])
    if not items:
        return _empty(title, width)
    row, top, label_w = 24, 28, 260
    height = top + row * len(items) + 8
    peak = max(amount for _, amount, _ in items)
    bar_room = width - label_w - 120
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="100%" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<text class="chart-title" x="0" y="16">{escape(title)}</text>']
    for i, (label, amount, link) in enumerate(items):
        y = top + i * row
        w = max(bar_room * amount / peak, 1)
        shown = label if len(label) <= 34 else label[:33] + "…"
        parts.append(f'<a href="{escape(link)}"><text class="label" x="{label_w - 8}" y="{y + 16}" '
                     f'text-anchor="end">{escape(shown)}</text></a>'
                     f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row - 8}">'
                     f'<title>{escape(label)}: {escape(fmt(amount))}</title></rect>'
                     f'<text class="value" x="{label_w + w + 6:.1f}" y="{y + 16}">{escape(fmt(amount))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _empty(title: str, width: int) -> str:
    return (f'<svg class="chart empty" role="img" viewBox="0 0 {width} 60" width="100%">'
            f'<text class="chart-title" x="0" y="16">{escape(title)}</text>'
            f'<text class="axis" x="0" y="44">nothing replayed yet</text></svg>')


def _nice(peak: float) -> float:
    """The top of the axis: four round steps (1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power of
    ten) that reach ``peak``, so each grid line reads as a round number."""
    if peak <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(peak / 4))
    step = next(m * power for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if 4 * m * power >= peak)
    return 4 * step


def _when(at: float, size: int) -> str:
    fmt = "%b %d" if size >= 86400 else "%H:%M" if size < 6 * 3600 else "%b %d %H:%M"
    return time.strftime(fmt, time.gmtime(at))


def _duration(seconds: int) -> str:
    return f"{seconds // 86400} day" if seconds >= 86400 else \
        f"{seconds // 3600} h" if seconds >= 3600 else f"{seconds // 60} min"
