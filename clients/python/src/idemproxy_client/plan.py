"""How a run begins and ends, written once for sync and async callers.

Each plan is a generator that yields the runs-API calls to make and receives their
answers (or has the call's error thrown into it); :func:`drive` and :func:`adrive` do
the I/O. This keeps the decisions — adopt, register, new attempt, complete, fail,
leave running — in one place.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Generator, TypeVar

from . import api
from .api import Answer, Call, RunOptions
from .errors import IdemProxyError, RunEnded, RunExists, RunNotFound, Superseded
from .info import RunInfo, RunState

log = logging.getLogger("idemproxy_client")

T = TypeVar("T")
Plan = Generator[Call, Answer, T]


def begin(run_id: str, handed_epoch: int | None, options: RunOptions, resume: bool) -> Plan[RunInfo]:
    """The run this process works in, at the epoch it must use.

    - Handed an epoch (by the supervisor's environment or explicitly): the attempt was
      already started for us; load the run (registering it if it is unknown) and refuse to
      work if it has ended or moved past our epoch.
    - Otherwise register the run. If it already existed, this process was started again
      by something other than the supervisor: start a new attempt, which fences any
      earlier process still running (or refuse, with ``resume=False``).
    """
    if handed_epoch is not None:
        try:
            answer = yield (api.show(run_id) if options.empty else api.register(run_id, options))
        except RunNotFound:
            answer = yield api.register(run_id, options)
        return checked(answer.run, handed_epoch)
    answer = yield api.register(run_id, options)
    if answer.created:
        return answer.run
    if not resume:
        raise RunExists(409, "run-exists", f"run {run_id} already exists (resume=False)",
                        answer.run.raw)
    if answer.run.ended:
        raise RunEnded(409, "run-ended", f"run {run_id} is {answer.run.state}", answer.run.raw)
    answer = yield api.new_attempt(run_id)
    return answer.run


def outcome_of(error: BaseException | None) -> RunState | None:
    """How a block that ended with ``error`` (None: normally) marks its run.

    - Normal exit, or ``SystemExit`` with code 0/None: ``completed``.
    - An ``Exception``: ``failed`` (ended runs are never restarted).
    - ``KeyboardInterrupt``, other ``SystemExit`` codes, ``asyncio.CancelledError``,
      ``GeneratorExit``: None, nothing. The process was stopped, the work did not fail;
      the run stays ``running`` as after a crash, so the supervisor (or the next start)
      resumes it.
    """
    if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
        return RunState.COMPLETED
    if isinstance(error, Exception):
        return RunState.FAILED
    return None


def finish(run_id: str, epoch: int, outcome: RunState | None) -> Plan[RunInfo | None]:
    """Mark the run ``outcome`` (``completed`` or ``failed``); None leaves it running."""
    if outcome is None:
        log.info("run %s left running: its process was interrupted", run_id)
        return None
    call = api.complete(run_id, epoch) if outcome is RunState.COMPLETED else api.fail(run_id, epoch)
    try:
        answer = yield call
    except RunEnded as exc:
        log.warning("run %s had already ended: %s", run_id, exc)
        return None
    return answer.run


def checked(run: RunInfo, epoch: int) -> RunInfo:
    """``run`` unless it shows that this attempt is over: superseded by a newer epoch, or
    the run ended (completed, failed, dead) by someone else."""
    if run.ended:
        raise RunEnded(409, "run-ended", f"run {run.run_id} is {run.state}", run.raw)
    if run.epoch > epoch:
        raise Superseded(412, "stale-epoch", f"run {run.run_id} moved on to epoch {run.epoch}; "
                         f"this attempt (epoch {epoch}) has been superseded", run.raw)
    return run


def drive(plan: Plan[T], send: Callable[[Call], Answer]) -> T:
    """Run a plan with a blocking ``send``."""
    try:
        call = next(plan)
        while True:
            try:
                answer = send(call)
            except IdemProxyError as exc:
                call = plan.throw(exc)
            else:
                call = plan.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def adrive(plan: Plan[T], send: Callable[[Call], Awaitable[Answer]]) -> T:
    """Run a plan with an awaitable ``send``."""
    try:
        call = next(plan)
        while True:
            try:
                answer = await send(call)
            except IdemProxyError as exc:
                call = plan.throw(exc)
            else:
                call = plan.send(answer)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
