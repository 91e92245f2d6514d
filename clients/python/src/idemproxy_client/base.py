"""What :class:`Run` and :class:`AsyncRun` share: identity, URLs, headers, and their plans.

Everything here is free of I/O. The lifecycle steps (start, heartbeat, refresh, end) are
plans (see :mod:`.plan`) that also keep this attempt's bookkeeping; ``Run`` drives them
with blocking calls and ``AsyncRun`` with awaited ones.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from . import api, plan
from .api import RunOptions
from .errors import IdemProxyError, RunEnded, Superseded
from .heartbeat import interval_for
from .info import RunInfo, RunState
from .keys import KeyPart, step_key
from .launch import DEFAULT_PROXY_URL, Launch, tenant_of
from .standby import wait_for_assignment

log = logging.getLogger("idemproxy_client")

RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UPSTREAM_NAME = re.compile(r"[A-Za-z0-9_.~-]+")


class BaseRun:
    """A run of an agent: its id, its epoch (attempt), keys, and where requests go.

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
        attach: hold a connection to the proxy for this attempt (``POST /runs/{id}/attach``,
            see :mod:`.attach`): if this process dies, the proxy notices within its
            ``attach_grace_s`` and a supervisor restarts the run at once, whatever
            ``timeout_s`` says. For agents no command hook started (a hook-started agent is
            watched as a child already). A block that ends normally, or ``close()``, lets
            the connection go on purpose; one left by an exception the run was not marked
            for drops it like a crash.
        tenant: sent as ``Idem-Tenant`` (only honoured from trusted sources). Default:
            ``IDEM_NAMESPACE`` when it names a trusted tenant (not ``default``, nor a
            credential's namespace: ``anonymous``, ``k:…``).
        http_timeout: timeout of runs-API calls, in seconds.
        env: the environment to read ``IDEM_*`` from (default ``os.environ``; then, in a
            standby the supervisor started ahead, construction waits until it names the run:
            see :mod:`.standby`).
    """

    def __init__(self, run_id: str | None = None, *, proxy_url: str | None = None,
                 epoch: int | None = None, resume: bool = True,
                 timeout_s: float | None = None, grace_s: float | None = None,
                 max_restarts: int | None = None, hook: str | None = None,
                 metadata: Mapping[str, Any] | None = None, heartbeat: bool | float = True,
                 finish: bool = True, tenant: str | None = None, http_timeout: float = 10.0,
                 env: Mapping[str, str] | None = None, attach: bool = False) -> None:
        if env is None:
            wait_for_assignment()
        launch = Launch.from_env(env)
        handed = launch.run_id is not None and run_id in (None, launch.run_id)
        self.run_id: str = run_id or launch.run_id or f"run-{uuid.uuid4().hex}"
        if not RUN_ID.fullmatch(self.run_id):
            raise ValueError(f"run id must be 1-128 characters of [A-Za-z0-9._:-], got {self.run_id!r}")
        if epoch is not None and epoch < 0:
            raise ValueError("epoch must be a non-negative integer")
        self.proxy_url: str = (proxy_url or launch.proxy_url or DEFAULT_PROXY_URL).rstrip("/")
        self.tenant: str | None = tenant or tenant_of(launch.namespace)
        self._handed_epoch = epoch if epoch is not None else (launch.epoch if handed else None)
        self._token: str | None = launch.token if handed else None  # learned at start otherwise
        self._epoch = self._handed_epoch
        self._options = RunOptions(timeout_s, grace_s, max_restarts, hook, metadata)
        self._resume = resume
        self._heartbeat = heartbeat
        self._finish = finish
        self._attach = attach
        self._http_timeout = http_timeout
        self._info: RunInfo | None = None
        self._started = False
        self._ended = False
        self._superseded = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, epoch={self._epoch}, proxy_url={self.proxy_url!r})"

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
    def token(self) -> str | None:
        """The run's token, its capability, once known (from its registration, or
        ``IDEM_RUN_TOKEN``): calls that carry it are the run's, whatever their credential.
        Keep it as secret as a credential."""
        return self._token

    @property
    def base_url(self) -> str:
        """``{proxy}/runs/{run_id}/epochs/{epoch}/cap/{token}``: prefix of every run-scoped
        upstream URL (without ``/cap/…`` on a proxy that gives no token)."""
        base = f"{self.proxy_url}/runs/{self.run_id}/epochs/{self.epoch}"
        return f"{base}/cap/{self._token}" if self._token else base

    def url(self, upstream: str, path: str = "") -> str:
        """The run-scoped URL of ``path`` on a configured upstream.

        ``run.url("openai", "/v1")`` is the ``base_url`` for the OpenAI SDK;
        ``run.url("tools", "/email/send")`` a tool endpoint.
        """
        if not UPSTREAM_NAME.fullmatch(upstream):
            raise ValueError(f"not an upstream name: {upstream!r}")
        tail = "/" + path.lstrip("/") if path else ""
        return f"{self.base_url}/{upstream}{tail}"

    def mcp_url(self, upstream: str, path: str = "/mcp") -> str:
        """The run-scoped URL of the MCP endpoint of an upstream of ``kind = "mcp"``.

        ``mcp.Client(run.mcp_url("tools"))``: its ``tools/call`` are journaled and a restarted
        attempt's are replayed, under the new attempt's JSON-RPC ids, in either MCP revision.
        """
        return self.url(upstream, path)

    def mcp_meta(self, step: str, *parts: KeyPart) -> dict[str, str]:
        """A tools/call ``_meta`` with an explicit key, ``run.key(step, *parts)``:
        ``client.call_tool("charge", args, meta=run.mcp_meta("charge", order_id))``."""
        return {api.MCP_KEY_META: self.key(step, *parts)}

    def headers(self, key: str | None = None, *, policy: str | None = None) -> dict[str, str]:
        """Headers that tie a request to this run and attempt.

        Use them with the plain ``{proxy}/{upstream}/...`` form, or add an explicit key
        (``run.headers(run.key("email", to))``) or a policy (``"record"``,
        ``"passthrough"``) to any request.
        """
        headers = {api.RUN_HEADER: self.run_id, api.EPOCH_HEADER: str(self.epoch)}
        if self.tenant:
            headers[api.TENANT_HEADER] = self.tenant
        if self._token:
            headers[api.RUN_TOKEN_HEADER] = self._token
        if key is not None:
            headers[api.KEY_HEADER] = key
        if policy is not None:
            headers[api.POLICY_HEADER] = policy
        return headers

    def _client_headers(self, given: Mapping[str, str] | None = None) -> dict[str, str]:
        # Run and epoch are in the run-scoped URL already; only the tenant needs a header.
        return {**(given or {}), **({api.TENANT_HEADER: self.tenant} if self.tenant else {})}

    # -- the lifecycle as plans ----------------------------------------------------------

    def _claim_start(self) -> None:
        # Checked before a subclass opens its connections, so a second start leaks none.
        if self._started:
            raise RuntimeError(f"a {type(self).__name__} is started once; create a new one "
                               "for another block")
        self._started = True

    def _start_plan(self) -> plan.Plan[RunInfo]:
        run = yield from plan.begin(self.run_id, self._handed_epoch, self._options, self._resume)
        self._info = run
        self._token = run.token or self._token
        if self._epoch is None:
            self._epoch = run.epoch
        log.info("run %s: attempt at epoch %d (%s)", self.run_id, self._epoch, self.base_url)
        return run

    def _beat_plan(self) -> plan.Plan[RunInfo]:
        with self._watching():
            answer = yield api.heartbeat(self.run_id, self.epoch)
            return self._seen(answer.run)

    def _refresh_plan(self) -> plan.Plan[RunInfo]:
        with self._watching():
            answer = yield api.show(self.run_id)
            return self._seen(answer.run)

    def _end_plan(self, outcome: RunState | None, quiet: bool = False) -> plan.Plan[RunInfo | None]:
        """Mark the run ``outcome``, unless this attempt may no longer mark it.

        ``quiet`` (the block ended with an exception) logs a refusal instead of raising
        it, so the block's own exception is the one the caller sees.
        """
        if self._ended or self._superseded:
            return None
        try:
            with self._watching():
                run = yield from plan.finish(self.run_id, self.epoch, outcome)
        except IdemProxyError as exc:
            if not quiet:
                raise
            log.warning("run %s not marked at exit: %s", self.run_id, exc)
            return None
        self._ended = True
        if run is not None:
            self._info = run
        return run

    def _let_go_plan(self) -> plan.Plan[None]:
        """Let this attempt's held connection go on purpose, so that its end restarts
        nothing; not needed once the attempt is over anyway."""
        if self._ended or self._superseded:
            return None
        try:
            yield api.detach(self.run_id, self.epoch)
        except IdemProxyError as exc:
            log.warning("run %s: held connection not let go (%s); its end may restart the run",
                        self.run_id, exc)
        return None

    def _beat_interval(self) -> float:
        if self._heartbeat is False:
            return 0.0
        if self._heartbeat is True:
            return interval_for(self._info.timeout_s if self._info else 60.0)
        return float(self._heartbeat)

    def _seen(self, run: RunInfo) -> RunInfo:
        """Keep the latest run JSON; raise if it shows this attempt is over."""
        self._info = run
        return plan.checked(run, self.epoch)

    @contextmanager
    def _watching(self) -> Iterator[None]:
        """Note a refusal or an answer that shows this attempt is over, and let it raise:
        the proxy fences a replaced attempt (412), or someone else ended the run."""
        try:
            yield
        except (Superseded, RunEnded) as exc:
            self._attempt_over(exc)
            raise

    def _attempt_over(self, exc: IdemProxyError) -> None:
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
