"""Batches: store calls that arrive together are sent together, each caller gets its own answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from idemproxy.proxy.store.errors import StoreUnavailable
from idemproxy.proxy.store.batching import AGAIN_S, Batches, GiveBack


class Server:
    """Stands for a store server: answers a batch after ``delay`` and remembers the batches."""

    def __init__(self, delay: float = 0.01):
        self.delay = delay
        self.batches: list[list[int]] = []
        self.fail: Exception | None = None

    async def send(self, items: list[int]) -> list[object]:
        self.batches.append(items)
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


async def test_a_lone_call_goes_at_once():
    server = Server()
    batches = Batches("test", server.send, timeout=1)
    assert await batches(2) == 20
    assert server.batches == [[2]]


async def test_calls_arriving_while_a_batch_is_out_form_the_next():
    server = Server()
    batches = Batches("test", server.send, timeout=1)
    results = await asyncio.gather(*(batches(i * 2) for i in range(10)))
    assert results == [i * 20 for i in range(10)]
    assert server.batches == [[0, 2, 4, 6, 8, 10, 12, 14, 16, 18]]  # one turn of the loop: one batch
    first = asyncio.ensure_future(batches(100))
    await asyncio.sleep(0.001)  # on the wire now
    rest = [asyncio.ensure_future(batches(i)) for i in (102, 104)]
    assert await asyncio.gather(first, *rest) == [1000, 1020, 1040]
    assert server.batches[1:] == [[100], [102, 104]]


async def test_an_error_for_one_item_reaches_that_caller_only():
    batches = Batches("test", Server().send, timeout=1)
    results = await asyncio.gather(batches(2), batches(3), batches(4), return_exceptions=True)
    assert results[0] == 20 and results[2] == 40
    assert isinstance(results[1], ValueError)


async def test_a_failed_batch_fails_each_of_its_callers_and_the_next_batch_goes_on():
    server = Server()
    batches = Batches("test", server.send, timeout=1)
    server.fail = StoreUnavailable("down")
    results = await asyncio.gather(batches(2), batches(4), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) for r in results)
    server.fail = None
    assert await batches(6) == 60


async def test_a_caller_waits_no_longer_than_the_timeout():
    batches = Batches("test", Server(delay=0.5).send, timeout=0.05)
    with pytest.raises(StoreUnavailable, match="no answer within"):
        await batches(2)
    await batches.flushed()  # the batch still ends; nobody is left to read its answer


async def test_each_caller_is_held_to_its_own_deadline_by_one_watchdog():
    """One timer serves every caller (batching.Watchdog): a caller that came later fails at
    its own deadline, not at the next round after the first caller's, nor never."""
    batches = Batches("test", Server(delay=1.0).send, timeout=0.2)

    async def timed() -> float:
        began = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no answer within 0.2s"):
            await batches(2)
        return time.monotonic() - began
    first = asyncio.ensure_future(timed())
    await asyncio.sleep(0.1)
    later = await timed()
    assert 0.19 <= await first < 0.28
    assert 0.19 <= later < 0.28  # a dog that looked again a whole timeout later: ~0.3
    await batches.flushed()


async def test_an_item_whose_caller_gave_up_before_its_turn_is_never_sent():
    server = Server(delay=0.2)
    heard = []
    batches = Batches("test", server.send, timeout=0.05, unanswered=lambda *a: heard.append(a))
    first = asyncio.ensure_future(batches(2))  # on the wire for 0.2 s
    await asyncio.sleep(0.01)
    with pytest.raises(StoreUnavailable):
        await batches(4)  # queued behind it; gives up at 0.05 s
    with pytest.raises(StoreUnavailable):
        await first
    await asyncio.sleep(0.25)  # the batch ends
    assert server.batches == [[2]]  # 4 was dropped, unsent
    assert heard == [(2, 20)]  # 2 was sent: its outcome goes to unanswered, as nobody read it


async def test_every_item_of_a_failed_batch_is_unanswered():
    server = Server()
    heard = []
    batches = Batches("test", server.send, timeout=1, unanswered=lambda item, outcome: heard.append(item))
    server.fail = StoreUnavailable("down")
    await asyncio.gather(batches(2), batches(4), return_exceptions=True)
    assert heard == [2, 4]
    server.fail = None
    assert await batches(6) == 60 and heard == [2, 4]  # an answered item is not


class Releases:
    """Stands for a store's release(): unreachable until told otherwise."""

    def __init__(self):
        self.up = False
        self.done: list[tuple[str, str, float]] = []

    async def release(self, kid: str, owner: str) -> None:
        if not self.up:
            raise StoreUnavailable("down")
        self.done.append((kid, owner, time.monotonic()))


@pytest.mark.slow  # seconds of retry timing
async def test_a_claim_is_given_back_when_the_store_answers_and_once_more_after():
    releases = Releases()
    give_back = GiveBack(releases.release)
    give_back.add("kid-1", "owner-1", lease_s=30)
    await asyncio.sleep(0.3)
    assert releases.done == []  # the store is down: it keeps trying
    releases.up = True
    await asyncio.sleep(2 * AGAIN_S + 2.5)
    assert [(kid, owner) for kid, owner, _ in releases.done] == [("kid-1", "owner-1")] * 2
    assert releases.done[1][2] - releases.done[0][2] >= AGAIN_S * 0.9
    await give_back.aclose()


@pytest.mark.slow  # waits out a lease
async def test_a_claim_is_no_longer_given_back_once_its_lease_is_over():
    releases = Releases()
    give_back = GiveBack(releases.release)
    give_back.add("kid-1", "owner-1", lease_s=0.2)
    await asyncio.sleep(0.4)
    releases.up = True
    await asyncio.sleep(2.5)
    assert releases.done == []
    await give_back.aclose()
