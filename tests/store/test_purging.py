"""Purges pace themselves (proxy/store/purging.py): after each full batch, a pause in
proportion to the time the batch took, so requests find the store free between batches.
What that buys while serving is measured by bench/million.py, not here."""

from __future__ import annotations

import asyncio
import time

from idemproxy.proxy.store.purging import PURGE_SHARE, paced

BATCH_S = 0.05


async def test_each_full_batch_is_followed_by_a_pause_and_the_last_is_not():
    began: list[float] = []
    rounds = iter([(100, True), (100, True), (7, False)])

    async def step() -> tuple[int, bool]:
        began.append(time.monotonic())
        await asyncio.sleep(BATCH_S)  # the batch's own work
        return next(rounds)

    started = time.monotonic()
    assert await paced(step) == 207
    finished = time.monotonic()
    pause = BATCH_S * (1 - PURGE_SHARE) / PURGE_SHARE
    gaps = [b - a for a, b in zip(began, began[1:])]
    assert len(gaps) == 2 and all(gap >= BATCH_S + pause for gap in gaps)  # sleeps never end early
    assert finished - began[-1] < BATCH_S + pause  # no pause once nothing more is due
    assert finished - started >= 3 * BATCH_S + 2 * pause


async def test_a_share_of_one_never_pauses():
    calls = 0

    async def step() -> tuple[int, bool]:
        nonlocal calls
        calls += 1
        return 1, calls < 50

    started = time.monotonic()
    assert await paced(step, share=1.0) == 50
    assert time.monotonic() - started < 1.0
