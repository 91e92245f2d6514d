"""Purges that leave the store to the requests: bounded batches, each followed by a pause.

In steady state the purge timer (``[store] purge_interval``, a minute) finds a minute's
worth of expired entries. After a stop, a longer retention shortened, or a first start
on an old journal, it finds a backlog: a day of a million-entry journal is 125,000
entries. Sent back to back, their batches kept SQLite's one writer busy: the record rate
fell from 696 to 92 req/s, p99 from 131 to 483 ms, for the 19 s the purge took
(bench/million.py, 2026-12-01). Each batch now waits, after it, in proportion to the time
it took, so a purge takes at most ``PURGE_SHARE`` of the store's time, and a backlog is
cleared over a longer while instead of all at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

PURGE_SHARE = 0.25  # of the store's time, at most, while there is a backlog to purge


async def paced(step: Callable[[], Awaitable[tuple[int, bool]]], share: float = PURGE_SHARE) -> int:
    """Run ``step`` (one batch: entries deleted, and whether more are due) until nothing is
    due; the total deleted. After a full batch, pause ``(1 - share) / share`` times as long
    as it took, so the requests between batches find the store free."""
    total = 0
    while True:
        began = time.monotonic()
        deleted, more = await step()
        total += deleted
        if not more:
            return total
        await asyncio.sleep((time.monotonic() - began) * (1.0 - share) / share)
