"""Store calls that arrive together go to the server together.

Under load, many requests ask the store the same kind of thing at the same moment:
thirty-two replays each want one journal entry, thirty-two records each want their
answer committed. One round trip each costs the proxy's only core a driver call, a
pooled connection and a socket wake-up apiece. A :class:`Batches` queue instead sends
whatever has gathered as one statement or one pipeline while the previous batch is on
the wire, so N callers cost one round trip: a group commit, and the same for reads.

Nothing waits for company: an idle store sends a lone call at once (on the next turn
of the event loop), so one agent's latency does not change.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

from .base import StoreUnavailable

Item = TypeVar("Item")
Result = TypeVar("Result")


def _consume(future: asyncio.Future) -> None:
    """A caller that timed out no longer reads its result; do not warn about it."""
    if not future.cancelled():
        future.exception()


class Batches(Generic[Item, Result]):
    """Run ``send(items) -> results`` (one result per item, in order) over queued items.

    One batch is on the wire at a time; items queued meanwhile form the next, so batches
    grow with the load. (Two or four in flight were measured too: smaller batches cost
    more CPU, in the proxy and in the server, than the overlap saved.) An exception
    raised by ``send`` reaches every caller of that batch; an exception returned as one
    item's result reaches that caller alone. A caller waits at most ``timeout``
    seconds (StoreUnavailable after that); its item may still be sent, as a single call
    whose answer was lost may have run.
    """

    def __init__(self, what: str, send: Callable[[list[Item]], Awaitable[Sequence[Result]]],
                 timeout: float):
        self.what = what
        self.timeout = timeout
        self._send = send
        self._queued: list[tuple[Item, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    async def __call__(self, item: Item) -> Result:
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(_consume)
        self._queued.append((item, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._drain(), name=f"idemproxy-batch-{self.what}")
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            raise StoreUnavailable(f"{self.what}: no answer within {self.timeout}s") from None

    async def flushed(self) -> None:
        """Return once everything queued so far has been sent (for a clean close)."""
        if self._sender is not None:
            await asyncio.wait([self._sender], timeout=self.timeout)

    async def _drain(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                results = await self._send([item for item, _ in batch])
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
