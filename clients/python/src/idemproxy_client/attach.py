"""Holding an attempt's connection to the proxy: ``POST /runs/{id}/attach``, kept open.

When this process dies, its kernel closes the socket; the proxy waits a short grace
(``[runs] attach_grace_s``) and marks the attempt lost, so a supervisor restarts the run
at once instead of after ``timeout_s`` of silence. A proxy on this host skips the grace
once it sees the process gone (``Idem-Process``, see :mod:`.process`). A connection that breaks while the
process lives (a network blip, a proxy replica going away) is made again at once, then
with backoff, well within the grace: it restarts nothing.

``Attachment`` holds it from a daemon thread with an event loop of its own (any code, and
scripts that know only the hook's environment)::

    from idemproxy_client import Attachment
    Attachment.from_env().start()     # IDEM_PROXY_URL, IDEM_RUN_ID, IDEM_EPOCH

``AsyncAttachment`` does the same from an asyncio task. ``Run(attach=True)`` and
``AsyncRun(attach=True)`` use them for their attempt. The hold ends by itself when the
proxy says the attempt is over (the run ended, a newer attempt exists, the attempt was
found lost); ``on_over`` hears why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, Callable, Mapping

import httpx

from . import api
from .errors import IdemProxyError, ProblemError, RunEnded, Superseded, problem_from_response
from .heartbeat import cancelled, ends_beating
from .launch import DEFAULT_PROXY_URL, Launch, tenant_of
from .process import process_token
from .tls import shared_context

log = logging.getLogger("idemproxy_client")

RECONNECT_S = (0.05, 1.0)  # waits between failed tries, first and most; a break is retried at once
READ_TIMEOUT_S = 60.0  # the proxy sends a line at least every 20 s; silence past this is a dead link
CONNECT_TIMEOUT_S = 5.0


class _Holding:
    """What both kinds share: the attempt, the coroutine that holds it, what it has seen."""

    def __init__(self, run_id: str, epoch: int, *, proxy_url: str | None = None,
                 tenant: str | None = None, token: str | None = None,
                 on_over: Callable[[IdemProxyError], None] | None = None) -> None:
        self.run_id = run_id
        self.epoch = epoch
        self.proxy_url = (proxy_url or DEFAULT_PROXY_URL).rstrip("/")
        self.tenant = tenant
        self.token = token  # the run's capability, when the attempt has one
        self.connections = 0  # connections the proxy accepted so far
        self.attached = threading.Event()  # set once the first is accepted
        self.over: IdemProxyError | None = None  # why the hold ended by itself
        self._on_over = on_over

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any):
        """The attempt a hook started this process for (``IDEM_RUN_ID``, ``IDEM_EPOCH``,
        ``IDEM_PROXY_URL``, ``IDEM_NAMESPACE``, ``IDEM_RUN_TOKEN``)."""
        launch = Launch.from_env(env)
        if launch.run_id is None or launch.epoch is None:
            raise ValueError("IDEM_RUN_ID and IDEM_EPOCH name the attempt to hold")
        tenant = tenant_of(launch.namespace)  # a trusted tenant's name only
        return cls(launch.run_id, launch.epoch, proxy_url=launch.proxy_url, tenant=tenant, token=launch.token,
                   **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, epoch={self.epoch}, connections={self.connections})"

    async def _hold(self) -> None:
        headers = {api.EPOCH_HEADER: str(self.epoch), "Accept": "application/x-ndjson"}
        if (process := process_token()) is not None:  # a proxy on this host then sees it exit
            headers[api.PROCESS_HEADER] = process
        if self.tenant:
            headers[api.TENANT_HEADER] = self.tenant
        if self.token:
            headers[api.RUN_TOKEN_HEADER] = self.token
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
        delay = 0.0
        async with httpx.AsyncClient(base_url=self.proxy_url, headers=headers, timeout=timeout,
                                     verify=shared_context()) as client:
            while True:
                held_before = self.connections
                try:
                    over = await self._connection(client)
                except ProblemError as exc:
                    over = exc if ends_beating(exc) else None
                    if over is None:
                        log.warning("run %s: attach refused (%s); trying again", self.run_id, exc)
                except (httpx.HTTPError, ValueError) as exc:  # ValueError: a line that is not JSON
                    over = None
                    log.info("run %s: held connection broke (%r); reconnecting", self.run_id, exc)
                if over is not None:
                    self.over = over
                    if self._on_over is not None:
                        self._on_over(over)
                    return
                if self.connections > held_before:  # it was up: try again at once
                    delay = 0.0
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, RECONNECT_S[0]), RECONNECT_S[1])

    async def _connection(self, client: httpx.AsyncClient) -> IdemProxyError | None:
        """One connection, until it ends: why the attempt is over, or None (reconnect)."""
        async with client.stream("POST", api.attach_path(self.run_id)) as response:
            if response.status_code >= 400:
                await response.aread()
                try:
                    body = response.json()
                except ValueError:
                    body = None
                raise problem_from_response(response.status_code, body)
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                said = json.loads(line)
                if "attached" in said:
                    self.connections += 1
                    self.attached.set()
                over = self._over(said)
                if over is not None:
                    return over
        return None  # the proxy is shutting down ({"closing": true}), or the stream was cut

    def _over(self, said: Mapping[str, Any]) -> IdemProxyError | None:
        if "ended" in said:
            return RunEnded(409, "run-ended", f"run {self.run_id} is {said['ended']}", said)
        if "superseded" in said:
            return Superseded(412, "stale-epoch", f"run {self.run_id} moved on to epoch "
                              f"{said['superseded']}; this attempt ({self.epoch}) is superseded", said)
        if "lost" in said:
            return Superseded(409, "attempt-lost", f"attempt {self.epoch} of run {self.run_id} was "
                              "found lost; a new one is starting", said)
        return None


class Attachment(_Holding):
    """Holds an attempt's connection from a daemon thread; see the module docstring."""

    _loop: asyncio.AbstractEventLoop | None = None
    _task: asyncio.Task[None] | None = None

    def __init__(self, run_id: str, epoch: int, **kwargs: Any) -> None:
        super().__init__(run_id, epoch, **kwargs)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True,
                                        name="idemproxy-attachment")

    def start(self) -> Attachment:
        self._thread.start()
        return self

    def wait_attached(self, timeout: float | None = None) -> bool:
        """Whether the proxy accepted a connection (within ``timeout`` seconds)."""
        return self.attached.wait(timeout)

    def stop(self) -> None:
        """Close the connection and end the thread (the proxy then waits out its grace)."""
        if not self._thread.is_alive():
            return
        self._ready.wait()
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)  # type: ignore[union-attr]
        except RuntimeError:  # its loop has closed: the hold ended by itself
            pass
        self._thread.join()

    def __enter__(self) -> Attachment:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.ensure_future(self._hold())
        self._ready.set()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class AsyncAttachment(_Holding):
    """Holds an attempt's connection from an asyncio task; see the module docstring."""

    _task: asyncio.Task[None] | None = None

    def start(self) -> AsyncAttachment:
        self._task = asyncio.get_running_loop().create_task(self._hold(), name="idemproxy-attachment")
        return self

    async def stop(self) -> None:
        """Close the connection and end the task."""
        task, self._task = self._task, None
        await cancelled(task)

    async def __aenter__(self) -> AsyncAttachment:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
