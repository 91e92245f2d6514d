"""The SQLite writer's own thread, for what would block the event loop: a commit's fsync,
a write lock another process holds, a write of many rows.

A plain thread fed by a queue, not a ThreadPoolExecutor. Every batch of writes crosses
to it and back, and each crossing is paid twice: in Python bytecode, and in the GIL
handed between the two threads (futex calls and context switches), since the loop holds
the GIL whenever it works. The executor's bookkeeping (a concurrent future with its
condition, the idle semaphore, a weak reference) ran on this thread with the GIL held;
here it is one queue get, the call, and one ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable


class DiskThread:
    """Runs ``fn(*args)`` on one thread of its own, in the order asked."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """A future of ``fn(*args)``'s result (or exception), settled on the running loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        """Stop once everything asked so far has run."""
        self._jobs.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                outcome = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, on the loop
                outcome = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, outcome)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass


def _settle(future: asyncio.Future, outcome: tuple[Any, BaseException | None]) -> None:
    if future.cancelled():
        return
    value, exc = outcome
    if exc is None:
        future.set_result(value)
    else:
        future.set_exception(exc)
