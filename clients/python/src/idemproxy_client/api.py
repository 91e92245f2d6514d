"""The agent-facing runs API of idemproxy, over httpx, sync and async.

Each call is described once (:class:`Call`) and sent by :class:`RunsAPI` or
:class:`AsyncRunsAPI`; answers are parsed and errors translated in one place
(:func:`_answer`), so the two flavours cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote

import httpx

from .errors import IdemProxyError, ProxyUnreachable, problem_from_response
from .info import RunInfo
from .tls import shared_context

RUN_HEADER = "Idem-Run"
EPOCH_HEADER = "Idem-Epoch"
TENANT_HEADER = "Idem-Tenant"
RUN_TOKEN_HEADER = "Idem-Run-Token"  # the run's capability: its calls are the run's, whatever their credential
KEY_HEADER = "Idempotency-Key"
MCP_KEY_META = "dev.idemproxy/idempotencyKey"  # an explicit key in a tools/call's _meta (docs/mcp.md)
POLICY_HEADER = "Idem-Policy"
PROCESS_HEADER = "Idem-Process"  # this process, so a proxy on its host sees it exit (attach)


@dataclass(frozen=True)
class RunOptions:
    """What a run is registered with; None leaves the proxy's value (or its default)."""

    timeout_s: float | None = None
    grace_s: float | None = None
    max_restarts: int | None = None
    hook: str | None = None
    metadata: Mapping[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body of ``POST /runs/{run_id}``: only the options that were set."""
        fields = {"timeout_s": self.timeout_s, "grace_s": self.grace_s,
                  "max_restarts": self.max_restarts, "hook": self.hook,
                  "metadata": dict(self.metadata) if self.metadata is not None else None}
        return {name: value for name, value in fields.items() if value is not None}

    @property
    def empty(self) -> bool:
        return not self.body()


@dataclass(frozen=True)
class Call:
    """One request of the runs API."""

    method: str
    path: str
    json: Mapping[str, Any] | None = None
    epoch: int | None = None  # sent as Idem-Epoch, so a proxy can fence a zombie's call


def register(run_id: str, options: RunOptions) -> Call:
    return Call("POST", f"/runs/{_segment(run_id)}", options.body())


def show(run_id: str) -> Call:
    return Call("GET", f"/runs/{_segment(run_id)}")


def new_attempt(run_id: str) -> Call:
    return Call("POST", f"/runs/{_segment(run_id)}/attempts")


def heartbeat(run_id: str, epoch: int | None) -> Call:
    return Call("POST", f"/runs/{_segment(run_id)}/heartbeat", epoch=epoch)


def attach_path(run_id: str) -> str:
    """Where an attempt's connection is held (streamed, so sent by :mod:`.attach`, not as a Call)."""
    return f"/runs/{_segment(run_id)}/attach"


def detach(run_id: str, epoch: int) -> Call:
    """Let the attempt's held connections go on purpose: their drop then restarts nothing."""
    return Call("POST", f"/runs/{_segment(run_id)}/detach", epoch=epoch)


def complete(run_id: str, epoch: int | None) -> Call:
    return Call("POST", f"/runs/{_segment(run_id)}/complete", epoch=epoch)


def fail(run_id: str, epoch: int | None) -> Call:
    return Call("POST", f"/runs/{_segment(run_id)}/fail", epoch=epoch)


@dataclass(frozen=True)
class Answer:
    """A successful answer: the run, and whether the call created something (201)."""

    run: RunInfo
    created: bool


class RunsAPI:
    """Blocking client of the runs API (one ``httpx.Client``; not shared across threads)."""

    def __init__(self, proxy_url: str, *, tenant: str | None = None, token: str | None = None,
                 timeout: float = 10.0):
        self._client = httpx.Client(base_url=proxy_url, headers=_headers(tenant, token), timeout=timeout,
                                    verify=shared_context())

    def bind(self, token: str | None) -> None:
        """Send the run's token from now on (learned from its registration)."""
        if token:
            self._client.headers[RUN_TOKEN_HEADER] = token

    def send(self, call: Call) -> Answer:
        """Send one call; raise :class:`ProblemError` or :class:`ProxyUnreachable`."""
        try:
            response = self._client.request(call.method, call.path, json=call.json,
                                            headers=_epoch_header(call))
        except httpx.TransportError as exc:
            raise ProxyUnreachable(f"{call.method} {call.path}: {exc!r}") from exc
        return _answer(response)

    def close(self) -> None:
        self._client.close()


class AsyncRunsAPI:
    """Asynchronous client of the runs API (one ``httpx.AsyncClient``)."""

    def __init__(self, proxy_url: str, *, tenant: str | None = None, token: str | None = None,
                 timeout: float = 10.0):
        self._client = httpx.AsyncClient(base_url=proxy_url, headers=_headers(tenant, token),
                                         timeout=timeout, verify=shared_context())

    def bind(self, token: str | None) -> None:
        """Send the run's token from now on (learned from its registration)."""
        if token:
            self._client.headers[RUN_TOKEN_HEADER] = token

    async def send(self, call: Call) -> Answer:
        """Send one call; raise :class:`ProblemError` or :class:`ProxyUnreachable`."""
        try:
            response = await self._client.request(call.method, call.path, json=call.json,
                                                  headers=_epoch_header(call))
        except httpx.TransportError as exc:
            raise ProxyUnreachable(f"{call.method} {call.path}: {exc!r}") from exc
        return _answer(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def _headers(tenant: str | None, token: str | None = None) -> dict[str, str]:
    headers = {"Accept": "application/json"}
    if tenant:
        headers[TENANT_HEADER] = tenant
    if token:
        headers[RUN_TOKEN_HEADER] = token
    return headers


def _epoch_header(call: Call) -> dict[str, str]:
    return {EPOCH_HEADER: str(call.epoch)} if call.epoch is not None else {}


def _answer(response: httpx.Response) -> Answer:
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = None
    if response.is_success:
        if not isinstance(body, dict) or "run_id" not in body:
            raise IdemProxyError(f"{response.request.method} {response.request.url.path}: "
                                 f"answer {response.status_code} is not run JSON")
        return Answer(RunInfo.from_json(body), created=response.status_code == 201)
    raise problem_from_response(response.status_code, body)


def _segment(run_id: str) -> str:
    # Run ids are [A-Za-z0-9._:-]; quoting anyway keeps a bad id from changing the path.
    return quote(run_id, safe=":")
