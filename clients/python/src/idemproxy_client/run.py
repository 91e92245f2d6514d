"""``Run``: one agent run behind idemproxy, as a sync or async context manager."""

from __future__ import annotations

import logging
import re
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any, Mapping

import httpx

from . import api, plan, sdk
from .api import AsyncRunsAPI, RunOptions, RunsAPI
from .errors import IdemProxyError, RunEnded, Superseded
from .heartbeat import HeartbeatTask, HeartbeatThread, interval_for
from .info import RunInfo
from .keys import KeyPart, step_key
from .launch import DEFAULT_NAMESPACE, DEFAULT_PROXY_URL, Launch

if TYPE_CHECKING:
    # Imported by name: Run's own methods are called openai and anthropic.
    from aiohttp import ClientSession
    from anthropic import Anthropic, AsyncAnthropic
    from openai import AsyncOpenAI, OpenAI

log = logging.getLogger("idemproxy_client")

RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UPSTREAM_NAME = re.compile(r"[A-Za-z0-9_.~-]+")


class Run:
    """A run of an agent: its id, its epoch (attempt), keys, heartbeats and its end.

    Use it as ``with Run(...) as run:`` in sync code or ``async with Run(...) as run:`` in
    async code. On entry the run is found or created:

    - started by the supervisor (``IDEM_RUN_ID`` and ``IDEM_EPOCH`` in the environment,
      or ``epoch=`` given): continue that run at that epoch;
    - otherwise register ``run_id`` (a new random id when none is given). When the run
      already exists, this process was started again by something else (a Kubernetes Job,
      systemd, a person): a new attempt begins, fencing any earlier process still running.
      With ``resume=False`` an existing run is an error (:class:`RunExists`).

    In the block, point clients at :meth:`url` (or use :meth:`openai`,
    :meth:`anthropic`, :meth:`client`), and give side-effecting calls a key from
    :meth:`key`. Heartbeats go out in the background (a thread, or a task under
    ``async with``). On exit the run is marked ``completed`` (normal exit, or
    ``SystemExit(0)``) or ``failed`` (an ``Exception``). ``KeyboardInterrupt``, a
    non-zero ``SystemExit`` and task cancellation leave it ``running``, like a crash: the
    process was stopped, the work did not fail, so the supervisor or the next start
    resumes it. ``finish=False`` never marks the run (one run spanning several processes).

    Args:
        run_id: the run's id, 1-128 of ``[A-Za-z0-9._:-]``. Default: ``IDEM_RUN_ID``, else new.
        proxy_url: the proxy. Default: ``IDEM_PROXY_URL``, else ``http://127.0.0.1:8787``.
        epoch: continue this attempt instead of starting one (default: ``IDEM_EPOCH`` when
            ``IDEM_RUN_ID`` names this run).
        resume: start a new attempt when the run exists (default) rather than refuse.
        timeout_s, grace_s, max_restarts, hook, metadata: registered with the run; None
            keeps the proxy's value.
        heartbeat: True for beats at a third of the run's timeout, a number for that
            interval in seconds, False for none.
        finish: mark the run completed/failed when the block ends.
        tenant: sent as ``Idem-Tenant`` (only honoured from trusted sources). Default:
            ``IDEM_NAMESPACE`` when it is not ``default``.
        http_timeout: timeout of runs-API calls, in seconds.
        env: the environment to read ``IDEM_*`` from (default ``os.environ``).
    """

    def __init__(self, run_id: str | None = None, *, proxy_url: str | None = None,
                 epoch: int | None = None, resume: bool = True,
                 timeout_s: float | None = None, grace_s: float | None = None,
                 max_restarts: int | None = None, hook: str | None = None,
                 metadata: Mapping[str, Any] | None = None, heartbeat: bool | float = True,
                 finish: bool = True, tenant: str | None = None, http_timeout: float = 10.0,
                 env: Mapping[str, str] | None = None) -> None:
        launch = Launch.from_env(env)
        handed = launch.run_id is not None and run_id in (None, launch.run_id)
        self.run_id: str = run_id or launch.run_id or f"run-{uuid.uuid4().hex}"
        if not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"run id must be 1-128 characters of [A-Za-z0-9._:-], got {self.run_id!r}")
        if epoch is not None and epoch < 0:
            raise ValueError("epoch must be a non-negative integer")
        self.proxy_url: str = (proxy_url or launch.proxy_url or DEFAULT_PROXY_URL).rstrip("/")
        namespace = launch.namespace if launch.namespace != DEFAULT_NAMESPACE else None
        self.tenant: str | None = tenant or namespace
        self._handed_epoch = epoch if epoch is not None else (launch.epoch if handed else None)
        self._epoch = self._handed_epoch
        self._options = RunOptions(timeout_s, grace_s, max_restarts, hook, metadata)
        self._resume = resume
        self._heartbeat = heartbeat
        self._finish = finish
        self._http_timeout = http_timeout
        self._info: RunInfo | None = None
        self._api: RunsAPI | None = None
        self._async_api: AsyncRunsAPI | None = None
        self._beats: HeartbeatThread | HeartbeatTask | None = None
        self._beats_api: RunsAPI | None = None
        self._started = False
        self._ended = False
        self._superseded = False

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, epoch={self._epoch}, proxy_url={self.proxy_url!r})"

    # -- identity ------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """This process's attempt number; known once the run has started."""
        if self._epoch is None:
            raise RuntimeError("the run's epoch is known once it has started (enter the block)")
        return self._epoch

    @property
    def info(self) -> RunInfo | None:
        """The latest run JSON seen from the proxy (at start, heartbeat or end)."""
        return self._info

    @property
    def superseded(self) -> bool:
        """True once a newer attempt of this run is known: this process should stop."""
        return self._superseded

    def key(self, step: str, *parts: KeyPart) -> str:
        """A stable idempotency key for ``step`` with ``parts`` in this run (any attempt).

        ``run.key("charge", order_id)`` is the same string in every attempt of the run, so
        a restarted attempt's call meets the journal entry of the crashed one.
        """
        return step_key(self.run_id, step, *parts)

    # -- where to send requests ----------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``{proxy}/runs/{run_id}/epochs/{epoch}``: prefix of every run-scoped upstream URL."""
        return f"{self.proxy_url}/runs/{self.run_id}/epochs/{self.epoch}"

    def url(self, upstream: str, path: str = "") -> str:
        """The run-scoped URL of ``path`` on a configured upstream.

        ``run.url("openai", "/v1")`` is the ``base_url`` for the OpenAI SDK;
        ``run.url("tools", "/email/send")`` a tool endpoint.
        """
        if not UPSTREAM_NAME.fullmatch(upstream):
            raise ValueError(f"not an upstream name: {upstream!r}")
        tail = "/" + path.lstrip("/") if path else ""
        return f"{self.base_url}/{upstream}{tail}"

    def headers(self, key: str | None = None, *, policy: str | None = None) -> dict[str, str]:
        """Headers that tie a request to this run and attempt.

        Use them with the plain ``{proxy}/{upstream}/...`` form, or add an explicit key
        (``run.headers(run.key("email", to))``) or a policy (``"record"``,
        ``"passthrough"``) to any request.
        """
        headers = {api.RUN_HEADER: self.run_id, api.EPOCH_HEADER: str(self.epoch)}
        if self.tenant:
            headers[api.TENANT_HEADER] = self.tenant
        if key is not None:
            headers[api.KEY_HEADER] = key
        if policy is not None:
            headers[api.POLICY_HEADER] = policy
        return headers

    def _sdk_headers(self) -> dict[str, str]:
        return {api.TENANT_HEADER: self.tenant} if self.tenant else {}

    def client(self, upstream: str, **kwargs: Any) -> httpx.Client:
        """An ``httpx.Client`` for ``upstream``: relative URLs join its run-scoped URL."""
        headers = {**(kwargs.pop("headers", None) or {}), **self._sdk_headers()}
        return httpx.Client(base_url=self.url(upstream), headers=headers, **kwargs)

    def async_client(self, upstream: str, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` for ``upstream``, like :meth:`client`."""
        headers = {**(kwargs.pop("headers", None) or {}), **self._sdk_headers()}
        return httpx.AsyncClient(base_url=self.url(upstream), headers=headers, **kwargs)

    def openai(self, upstream: str = "openai", **kwargs: Any) -> OpenAI:
        """An ``openai.OpenAI`` client on ``run.url(upstream, "/v1")`` (extra ``openai``)."""
        return sdk.openai_client(self.url(upstream, "/v1"), self._sdk_headers(), **kwargs)

    def async_openai(self, upstream: str = "openai", **kwargs: Any) -> AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client, like :meth:`openai`."""
        return sdk.async_openai_client(self.url(upstream, "/v1"), self._sdk_headers(), **kwargs)

    def anthropic(self, upstream: str = "anthropic", **kwargs: Any) -> Anthropic:
        """An ``anthropic.Anthropic`` client on ``run.url(upstream)`` (extra ``anthropic``)."""
        return sdk.anthropic_client(self.url(upstream), self._sdk_headers(), **kwargs)

    def async_anthropic(self, upstream: str = "anthropic",
                        **kwargs: Any) -> AsyncAnthropic:
        """An ``anthropic.AsyncAnthropic`` client, like :meth:`anthropic`."""
        return sdk.async_anthropic_client(self.url(upstream), self._sdk_headers(), **kwargs)

    def aiohttp_session(self, upstream: str, **kwargs: Any) -> ClientSession:
        """An ``aiohttp.ClientSession`` for ``upstream`` (extra ``aiohttp``): request
        relative paths without a leading slash (``session.post("email/send")``)."""
        return sdk.aiohttp_session(self.url(upstream), self._sdk_headers(), **kwargs)

    # -- sync lifecycle ------------------------------------------------------------------

    def start(self) -> Run:
        """Find or create the run and start heartbeats; ``with`` calls this for you."""
        self._begin_once()
        self._api = RunsAPI(self.proxy_url, tenant=self.tenant, timeout=self._http_timeout)
        try:
            self._adopt(plan.drive(self._begin_plan(), self._api.send))
        except BaseException:
            self._api.close()
            raise
        interval = self._beat_interval()
        if interval:
            self._beats_api = RunsAPI(self.proxy_url, tenant=self.tenant, timeout=self._http_timeout)
            self._beats = HeartbeatThread(self._beat_from_thread, interval, self._beats_stopped)
            self._beats.start()
        return self

    def heartbeat(self) -> RunInfo:
        """Tell the proxy this attempt is alive now; raises :class:`Superseded` if replaced."""
        try:
            answer = self._sync().send(api.heartbeat(self.run_id, self.epoch))
        except Superseded as exc:  # refused (412): the proxy fences a replaced attempt's beats
            self._beats_stopped(exc)
            raise
        return self._seen(answer.run)

    def refresh(self) -> RunInfo:
        """The run as the proxy has it now."""
        return self._seen(self._sync().send(api.show(self.run_id)).run)

    def complete(self) -> RunInfo | None:
        """Mark the run ``completed`` now (the block's end then does nothing more)."""
        return self._end_sync(plan.COMPLETED)

    def fail(self) -> RunInfo | None:
        """Mark the run ``failed`` now: it is never restarted."""
        return self._end_sync(plan.FAILED)

    def close(self) -> None:
        """Stop heartbeats and close connections, leaving the run's state as it is."""
        if isinstance(self._beats, HeartbeatThread):
            self._beats.stop()
        self._beats = None
        for client in (self._beats_api, self._api):
            if client is not None:
                client.close()
        self._beats_api = self._api = None

    def __enter__(self) -> Run:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if isinstance(self._beats, HeartbeatThread):
                self._beats.stop()  # no beat may land after the run is marked
            if self._finish and self._api is not None:
                self._end_sync(plan.outcome_of(exc), quiet=exc is not None)
        finally:
            self.close()

    def _end_sync(self, outcome: str | None, quiet: bool = False) -> RunInfo | None:
        if self._ended or self._superseded:
            return None
        try:
            run = plan.drive(plan.finish(self.run_id, self.epoch, outcome), self._sync().send)
        except IdemProxyError as exc:
            if isinstance(exc, Superseded):  # refused (412): a newer attempt owns the run
                self._beats_stopped(exc)
            if not quiet:
                raise
            log.warning("run %s not marked at exit: %s", self.run_id, exc)
            return None
        return self._ended_with(run)

    def _beat_from_thread(self) -> RunInfo:
        assert self._beats_api is not None
        return self._seen(self._beats_api.send(api.heartbeat(self.run_id, self.epoch)).run)

    def _sync(self) -> RunsAPI:
        if self._api is None:
            raise RuntimeError("not started with `with` or start(); under `async with` use the a*() methods")
        return self._api

    # -- async lifecycle -----------------------------------------------------------------

    async def astart(self) -> Run:
        """Find or create the run and start heartbeats; ``async with`` calls this for you."""
        self._begin_once()
        self._async_api = AsyncRunsAPI(self.proxy_url, tenant=self.tenant, timeout=self._http_timeout)
        try:
            self._adopt(await plan.adrive(self._begin_plan(), self._async_api.send))
        except BaseException:
            await self._async_api.aclose()
            raise
        interval = self._beat_interval()
        if interval:
            self._beats = HeartbeatTask(self.aheartbeat, interval, self._beats_stopped)
            self._beats.start()
        return self

    async def aheartbeat(self) -> RunInfo:
        """Async :meth:`heartbeat`."""
        try:
            answer = await self._async().send(api.heartbeat(self.run_id, self.epoch))
        except Superseded as exc:
            self._beats_stopped(exc)
            raise
        return self._seen(answer.run)

    async def arefresh(self) -> RunInfo:
        """Async :meth:`refresh`."""
        return self._seen((await self._async().send(api.show(self.run_id))).run)

    async def acomplete(self) -> RunInfo | None:
        """Async :meth:`complete`."""
        return await self._end_async(plan.COMPLETED)

    async def afail(self) -> RunInfo | None:
        """Async :meth:`fail`."""
        return await self._end_async(plan.FAILED)

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        if isinstance(self._beats, HeartbeatTask):
            await self._beats.stop()
        self._beats = None
        if self._async_api is not None:
            await self._async_api.aclose()
        self._async_api = None

    async def __aenter__(self) -> Run:
        return await self.astart()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            if isinstance(self._beats, HeartbeatTask):
                await self._beats.stop()
            if self._finish and self._async_api is not None:
                await self._end_async(plan.outcome_of(exc), quiet=exc is not None)
        finally:
            await self.aclose()

    async def _end_async(self, outcome: str | None, quiet: bool = False) -> RunInfo | None:
        if self._ended or self._superseded:
            return None
        try:
            run = await plan.adrive(plan.finish(self.run_id, self.epoch, outcome), self._async().send)
        except IdemProxyError as exc:
            if isinstance(exc, Superseded):
                self._beats_stopped(exc)
            if not quiet:
                raise
            log.warning("run %s not marked at exit: %s", self.run_id, exc)
            return None
        return self._ended_with(run)

    def _async(self) -> AsyncRunsAPI:
        if self._async_api is None:
            raise RuntimeError("not started with `async with` or astart(); under `with` use the sync methods")
        return self._async_api

    # -- shared --------------------------------------------------------------------------

    def _begin_once(self) -> None:
        if self._started:
            raise RuntimeError("a Run is entered once; create a new Run for another block")
        self._started = True

    def _begin_plan(self) -> plan.Plan[RunInfo]:
        return plan.begin(self.run_id, self._handed_epoch, self._options, self._resume)

    def _adopt(self, run: RunInfo) -> None:
        self._info = run
        if self._epoch is None:
            self._epoch = run.epoch
        log.info("run %s: attempt at epoch %d (%s)", self.run_id, self._epoch, self.base_url)

    def _beat_interval(self) -> float:
        if self._heartbeat is False:
            return 0.0
        if self._heartbeat is True:
            return interval_for(self._info.timeout_s if self._info else 60.0)
        return float(self._heartbeat)

    def _seen(self, run: RunInfo) -> RunInfo:
        """Keep the latest run JSON; raise if it shows this attempt is over."""
        self._info = run
        try:
            return plan.checked(run, self.epoch)
        except IdemProxyError as exc:
            self._beats_stopped(exc)
            raise

    def _ended_with(self, run: RunInfo | None) -> RunInfo | None:
        self._ended = True
        if run is not None:
            self._info = run
        return run

    def _beats_stopped(self, exc: IdemProxyError) -> None:
        """Note why this attempt is over, so the block's end does not mark the run."""
        if isinstance(exc, Superseded):
            if not self._superseded:
                log.warning("run %s: this attempt (epoch %s) was superseded: %s", self.run_id,
                            self._epoch, exc)
            self._superseded = True
        elif isinstance(exc, RunEnded):
            if not self._ended:
                log.warning("run %s ended elsewhere: %s", self.run_id, exc)
            self._ended = True
        else:
            log.warning("run %s: heartbeats stopped: %s", self.run_id, exc)
