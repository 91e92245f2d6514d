"""``AsyncRun``: one agent run behind idemproxy, for asyncio code (``async with AsyncRun(...)``)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from . import plan, sdk
from .api import AsyncRunsAPI
from .attach import AsyncAttachment
from .base import BaseRun
from .heartbeat import HeartbeatTask
from .info import RunInfo, RunState
from .tls import client_options

if TYPE_CHECKING:
    # Imported by name: AsyncRun's own methods are called openai and anthropic.
    from aiohttp import ClientSession
    from anthropic import AsyncAnthropic
    from openai import AsyncOpenAI


class AsyncRun(BaseRun):
    """:class:`Run` for asyncio code: ``async with AsyncRun(...) as run:``.

    It takes the same arguments and finds, starts and ends the run the same way. Its
    lifecycle methods are coroutines, heartbeats come from an asyncio task, and its
    factories make async clients (``run.openai()`` is an ``openai.AsyncOpenAI``).
    Task cancellation, like ``KeyboardInterrupt``, leaves the run ``running``.
    """

    # Set by start(), until aclose().
    _api: AsyncRunsAPI | None = None
    _beats: HeartbeatTask | None = None
    _attachment: AsyncAttachment | None = None

    # -- clients on the run-scoped URL ---------------------------------------------------

    def client(self, upstream: str, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` for ``upstream``: relative URLs join its run-scoped URL."""
        headers = self._client_headers(kwargs.pop("headers", None))
        return httpx.AsyncClient(base_url=self.url(upstream), headers=headers, **client_options(kwargs))

    def openai(self, upstream: str = "openai", **kwargs: Any) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client on ``run.url(upstream, "/v1")`` (extra ``openai``)."""
        return sdk.async_openai_client(self.url(upstream, "/v1"), self._client_headers(), **kwargs)

    def anthropic(self, upstream: str = "anthropic", **kwargs: Any) -> AsyncAnthropic:
        """An ``anthropic.AsyncAnthropic`` client on ``run.url(upstream)`` (extra ``anthropic``)."""
        return sdk.async_anthropic_client(self.url(upstream), self._client_headers(), **kwargs)

    def aiohttp_session(self, upstream: str, **kwargs: Any) -> ClientSession:
        """An ``aiohttp.ClientSession`` for ``upstream`` (extra ``aiohttp``): request
        relative paths without a leading slash (``session.post("email/send")``)."""
        return sdk.aiohttp_session(self.url(upstream), self._client_headers(), **kwargs)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> AsyncRun:
        """Find or create the run and start heartbeats; ``async with`` calls this for you."""
        self._claim_start()
        self._api = AsyncRunsAPI(self.proxy_url, tenant=self.tenant, token=self._token,
                                 timeout=self._http_timeout)
        try:
            await plan.adrive(self._start_plan(), self._api.send)
        except BaseException:
            await self.aclose()
            raise
        self._api.bind(self._token)
        interval = self._beat_interval()
        if interval:
            self._beats = HeartbeatTask(self.heartbeat, interval, self._attempt_over)
            self._beats.start()
        if self._attach:
            self._attachment = AsyncAttachment(self.run_id, self.epoch, proxy_url=self.proxy_url,
                                               tenant=self.tenant, token=self._token,
                                               on_over=self._attempt_over).start()
        return self

    @property
    def attachment(self) -> AsyncAttachment | None:
        """The held connection of ``attach=True``, while the run is open."""
        return self._attachment

    async def heartbeat(self) -> RunInfo:
        """Tell the proxy this attempt is alive now; raises :class:`Superseded` if replaced."""
        return await plan.adrive(self._beat_plan(), self._connection().send)

    async def refresh(self) -> RunInfo:
        """The run as the proxy has it now."""
        return await plan.adrive(self._refresh_plan(), self._connection().send)

    async def complete(self) -> RunInfo | None:
        """Mark the run ``completed`` now (the block's end then does nothing more)."""
        return await plan.adrive(self._end_plan(RunState.COMPLETED), self._connection().send)

    async def fail(self) -> RunInfo | None:
        """Mark the run ``failed`` now: it is never restarted."""
        return await plan.adrive(self._end_plan(RunState.FAILED), self._connection().send)

    async def aclose(self) -> None:
        """Stop heartbeats and close the connection, leaving the run's state as it is (a held
        connection is let go on purpose: its end restarts nothing)."""
        await self._drop_attachment(let_go=True)
        if self._beats is not None:
            await self._beats.stop()
        self._beats = None
        if self._api is not None:
            await self._api.aclose()
        self._api = None

    async def __aenter__(self) -> AsyncRun:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if self._beats is not None:
                await self._beats.stop()  # no beat may land after the run is marked
            if self._finish and self._api is not None:
                await plan.adrive(self._end_plan(plan.outcome_of(exc), quiet=exc is not None),
                                  self._api.send)
        finally:
            await self._drop_attachment(let_go=exc is None)
            await self.aclose()

    async def _drop_attachment(self, let_go: bool) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is None:
            return
        if let_go and self._api is not None:
            await plan.adrive(self._let_go_plan(), self._api.send)
        await attachment.stop()

    def _connection(self) -> AsyncRunsAPI:
        if self._api is None:
            raise RuntimeError("the run is not started: use `async with AsyncRun(...) as run:` "
                               "or `await run.start()`")
        return self._api
