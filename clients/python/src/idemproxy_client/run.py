"""``Run``: one agent run behind idemproxy, for blocking code (``with Run(...) as run:``)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from . import plan, sdk
from .api import RunsAPI
from .attach import Attachment
from .base import BaseRun
from .heartbeat import HeartbeatThread
from .info import RunInfo, RunState
from .tls import client_options

if TYPE_CHECKING:
    # Imported by name: Run's own methods are called openai and anthropic.
    from anthropic import Anthropic
    from openai import OpenAI


class Run(BaseRun):
    """A run of an agent: its id, its epoch (attempt), keys, heartbeats and its end.

    Use it as ``with Run(...) as run:``; asyncio code uses :class:`AsyncRun`, which takes
    the same arguments (see :class:`BaseRun`). On entry the run is found or created:

    - started by the supervisor (``IDEM_RUN_ID`` and ``IDEM_EPOCH`` in the environment,
      or ``epoch=`` given): continue that run at that epoch;
    - otherwise register ``run_id`` (a new random id when none is given). When the run
      already exists, this process was started again by something else (a Kubernetes Job,
      systemd, a person): a new attempt begins, fencing any earlier process still running.
      With ``resume=False`` an existing run is an error (:class:`RunExists`).

    In the block, point clients at :meth:`url` (or use :meth:`openai`,
    :meth:`anthropic`, :meth:`client`), and give side-effecting calls a key from
    :meth:`key`. Heartbeats go out from a background thread. On exit the run is marked
    ``completed`` (normal exit, or ``SystemExit(0)``) or ``failed`` (an ``Exception``).
    ``KeyboardInterrupt`` and a non-zero ``SystemExit`` leave it ``running``, like a
    crash: the process was stopped, the work did not fail, so the supervisor or the next
    start resumes it. ``finish=False`` never marks the run (one run spanning several
    processes).
    """

    # Set by start(), until close(). The beat thread has a connection of its own: one
    # httpx.Client is not shared across threads.
    _api: RunsAPI | None = None
    _beats_api: RunsAPI | None = None
    _beats: HeartbeatThread | None = None
    _attachment: Attachment | None = None

    # -- clients on the run-scoped URL ---------------------------------------------------

    def client(self, upstream: str, **kwargs: Any) -> httpx.Client:
        """An ``httpx.Client`` for ``upstream``: relative URLs join its run-scoped URL."""
        headers = self._client_headers(kwargs.pop("headers", None))
        return httpx.Client(base_url=self.url(upstream), headers=headers, **client_options(kwargs))

    def openai(self, upstream: str = "openai", **kwargs: Any) -> OpenAI:
        """An ``openai.OpenAI`` client on ``run.url(upstream, "/v1")`` (extra ``openai``)."""
        return sdk.openai_client(self.url(upstream, "/v1"), self._client_headers(), **kwargs)

    def anthropic(self, upstream: str = "anthropic", **kwargs: Any) -> Anthropic:
        """An ``anthropic.Anthropic`` client on ``run.url(upstream)`` (extra ``anthropic``)."""
        return sdk.anthropic_client(self.url(upstream), self._client_headers(), **kwargs)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Run:
        """Find or create the run and start heartbeats; ``with`` calls this for you."""
        self._claim_start()
        self._api = self._new_api()
        try:
            plan.drive(self._start_plan(), self._api.send)
        except BaseException:
            self.close()
            raise
        self._api.bind(self._token)
        interval = self._beat_interval()
        if interval:
            self._beats_api = beats_api = self._new_api()
            self._beats = HeartbeatThread(lambda: plan.drive(self._beat_plan(), beats_api.send),
                                          interval, self._attempt_over)
            self._beats.start()
        if self._attach:
            self._attachment = Attachment(self.run_id, self.epoch, proxy_url=self.proxy_url, tenant=self.tenant,
                                          token=self._token, on_over=self._attempt_over).start()
        return self

    @property
    def attachment(self) -> Attachment | None:
        """The held connection of ``attach=True``, while the run is open."""
        return self._attachment

    def heartbeat(self) -> RunInfo:
        """Tell the proxy this attempt is alive now; raises :class:`Superseded` if replaced."""
        return plan.drive(self._beat_plan(), self._connection().send)

    def refresh(self) -> RunInfo:
        """The run as the proxy has it now."""
        return plan.drive(self._refresh_plan(), self._connection().send)

    def complete(self) -> RunInfo | None:
        """Mark the run ``completed`` now (the block's end then does nothing more)."""
        return plan.drive(self._end_plan(RunState.COMPLETED), self._connection().send)

    def fail(self) -> RunInfo | None:
        """Mark the run ``failed`` now: it is never restarted."""
        return plan.drive(self._end_plan(RunState.FAILED), self._connection().send)

    def close(self) -> None:
        """Stop heartbeats and close connections, leaving the run's state as it is (a held
        connection is let go on purpose: its end restarts nothing)."""
        self._drop_attachment(let_go=True)
        if self._beats is not None:
            self._beats.stop()
        self._beats = None
        for runs_api in (self._beats_api, self._api):
            if runs_api is not None:
                runs_api.close()
        self._beats_api = self._api = None

    def __enter__(self) -> Run:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._beats is not None:
                self._beats.stop()  # no beat may land after the run is marked
            if self._finish and self._api is not None:
                plan.drive(self._end_plan(plan.outcome_of(exc), quiet=exc is not None),
                           self._api.send)
        finally:
            self._drop_attachment(let_go=exc is None)
            self.close()

    def _drop_attachment(self, let_go: bool) -> None:
        attachment, self._attachment = self._attachment, None
        if attachment is None:
            return
        if let_go and self._api is not None:
            plan.drive(self._let_go_plan(), self._api.send)
        attachment.stop()

    def _new_api(self) -> RunsAPI:
        return RunsAPI(self.proxy_url, tenant=self.tenant, token=self._token, timeout=self._http_timeout)

    def _connection(self) -> RunsAPI:
        if self._api is None:
            raise RuntimeError("the run is not started: use `with Run(...) as run:` or start()")
        return self._api
