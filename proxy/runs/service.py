"""The runs service: every change to a run, whoever asks for it (docs/restarts.md).

The agents' runs API, the admin API, the CLI and the supervisor all call this, so a
rule about runs lives in one place. It is plain Python: refusals are
:class:`~..problems.Problem` (the HTTP faces turn them into problem+json, the CLI into a
line on stderr), and hooks are fired through a :class:`Launcher` the composition root
hands in (supervisor/hooks.py's ``Hooks``), so this package never imports the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Any, AsyncIterator, Protocol

from ..config import Settings
from ..forward import NEVER_STORED, NOT_FORWARDED, storable_headers
from ..problems import Problem
from ..ratelimit import Counted, too_many
from ..store import Store
from ..store.model import ENDED, Action, Entry, EntryState, Recorded, Run, RunState, Scope
from .endings import end_ending, operator_ending, superseded_ending, with_log_tail
from .operators import body_digest

log = logging.getLogger("idemproxy.runs")

RESTART = "restart"  # the history event of a supervisor's restart
ADMIN_RESTART = "admin-restart"
KID_LENGTH, MIN_KID_PREFIX = 64, 6  # a kid is a SHA-256 in hex; tables show its first 12 digits
HEX = re.compile(r"[0-9a-f]+")


class Launcher(Protocol):
    """Starts a run's hook (a process or a webhook) for an attempt."""

    async def fire(self, hook: str | None, event: str, run: Run) -> str | None:
        """Fire ``hook`` for ``run``'s current attempt: None once started, else why not."""

    async def aclose(self, timeout: float = 5.0) -> None: """Let deliveries in flight finish."""

    def has_room(self) -> bool: """Whether another hook may start now (a bound on processes)."""

    def keep_standbys(self) -> None: """Keep command hooks' ``standby`` processes started ahead."""

    async def stop_standbys(self) -> None: """Terminate idle standbys (never an assigned one)."""


class RunsService:
    """Runs in a store, changed by the rules of docs/restarts.md: fenced by epoch, ended for good."""

    def __init__(self, store: Store, settings: Settings, launcher: Launcher):
        self.store = store
        self.settings = settings
        self.launcher = launcher
        # new runs per minute from one namespace, and from one client, for every replica (proxy/ratelimit.py)
        self._registrations = Counted(store.audit, settings.runs.registrations_per_minute, 60.0)

    # -- agents: their own runs, in their namespace -------------------------------------------

    async def register(self, namespace: str, run_id: str, options: dict, *,
                       operator: str | None = None, client: str | None = None) -> tuple[Run, bool]:
        """Create the run or update its options; (the run, whether it is new). Only an
        ``operator`` (the admin API, naming who; the audit keeps it) or a namespace the hook
        allows may arm a hook; anyone else's new runs are bounded (:meth:`_new_run_admitted`)."""
        existing = await self.store.runs.find(namespace, run_id)
        bounded = not existing and not operator
        async with self._new_run_admitted(namespace, client) if bounded else contextlib.nullcontext():
            run = existing[0] if existing else self.new_run(namespace, run_id, time.time(),
                                                            operator=operator is not None)
            hook = options.get("hook", run.hook)
            if hook not in (None, run.hook) and not operator and not self.settings.may_arm(hook, namespace):
                raise Problem("hook-not-allowed", f"hook {hook!r} is armed only through the admin API or for "
                              f"a namespace in [hooks.{hook}] allow_tenants; this caller's namespace is "
                              f"{namespace!r}", hook=hook, namespace=namespace)
            for name, value in options.items():
                setattr(run, name, value)
            registered = await self.store.runs.upsert(run)
        if operator:  # which options, never their values: metadata may hold anything
            await self._noted(operator, "register", registered, created=not existing, options=sorted(options),
                              hook=registered.hook)
        return registered, not existing

    async def get(self, namespace: str, run_id: str) -> Run:
        runs = await self.store.runs.find(namespace, run_id)
        if not runs:
            raise _no_such_run(run_id)
        return runs[0]

    async def heartbeat(self, namespace: str, run_id: str, epoch: int | None) -> Run:
        run = await self.store.runs.heartbeat(namespace, run_id, time.time(), epoch)
        if run is None:
            raise _no_such_run(run_id)
        _not_superseded(run, epoch)
        return run

    async def end(self, namespace: str, run_id: str, state: RunState, epoch: int | None = None, *,
                  by: str | None = None) -> Run:
        """End the run as ``state``, atomically fenced by ``epoch``; idempotent. ``by``: the
        operator, when not the agent (its attempt's ending says so, and the audit keeps it)."""
        runs = await self.store.runs.find(namespace, run_id)
        ending = await with_log_tail(runs[0], end_ending(state, by)) if runs else None
        ended = await self.store.runs.end(namespace, run_id, state, time.time(), epoch, ending)
        if ended is None:
            raise _no_such_run(run_id)
        _not_superseded(ended, epoch)
        if ended.state != state:
            raise Problem("run-ended", f"run {run_id} already ended as {ended.state}", state=ended.state)
        if by is not None:
            await self._noted(by, str(state), ended, epoch=ended.epoch)
        return ended

    async def new_attempt(self, namespace: str, run_id: str, client: str | None = None) -> Run:
        """Epoch + 1, fencing the attempt before; creates the run at epoch 0 if unknown."""
        runs = await self.store.runs.find(namespace, run_id)
        if not runs:
            async with self._new_run_admitted(namespace, client):
                return await self.store.runs.upsert(self.new_run(namespace, run_id, time.time()))
        run = await self.store.runs.new_attempt(namespace, run_id, None, time.time(), "attempt", restart=False,
                                                ended=superseded_ending())
        if run is None:
            raise Problem("run-ended", f"run {run_id} has ended ({runs[0].state}); start a new run",
                          state=runs[0].state)
        return run

    @contextlib.asynccontextmanager
    async def _new_run_admitted(self, namespace: str, client: str | None) -> AsyncIterator[None]:
        """Registrations need no token, and each may carry max_metadata_bytes: 429 past
        ``[runs] registrations_per_minute`` from the namespace or the client, or past
        ``max_live_runs`` runs of the namespace not ended. The new run is written within."""
        keys = [f"registrations namespace {namespace}"] + ([f"registrations client {client}"] if client else [])
        # one registration of a namespace or client at a time here (ratelimit.Counted), its run
        # written before the next is judged: those sent together are not each judged on counts,
        # or live runs, that none of them has written yet
        async with self._registrations.one_at_a_time(keys):
            now = time.time()
            wait = max([(await self._registrations.look(key, now))[1] for key in keys])
            if wait:
                raise too_many(f"more than {self.settings.runs.registrations_per_minute} new runs a minute "
                               "from this namespace or client", wait)
            cap = self.settings.runs.max_live_runs
            if cap and await self.store.runs.live(namespace, cap) >= cap:
                raise Problem("too-many-runs", f"namespace {namespace!r} has {cap} runs not ended, the most "
                              "[runs] max_live_runs allows: complete or fail some first", max_live_runs=cap)
            await self._registrations.add(keys, now)
            yield

    def new_run(self, namespace: str, run_id: str, now: float, *, operator: bool = False) -> Run:
        """A run at epoch 0 with the configured ``[runs]`` defaults; its ``hook`` only for an
        operator or a namespace that hook allows (traffic arms nothing by itself)."""
        run = Run.new(namespace, run_id, self.settings.runs, now)
        if not operator:
            run.hook = self.settings.default_hook(namespace)
        return run
    async def attach(self, namespace: str, run_id: str, epoch: int) -> Run:
        """Count a held connection of attempt ``epoch`` (``POST /runs/{id}/attach``): the run,
        whose ``attachments`` is this connection's number. The same call lets the held
        connections go on purpose (``/detach``): a drop of any of them then marks nothing."""
        run = await self.get(namespace, run_id)
        if epoch > run.epoch:  # the attempt's first word: its epoch is raised as by any request
            await self.store.runs.observe_epoch(namespace, run_id, epoch, run, time.time(),
                                                ended=superseded_ending(by_request=epoch))
        attached = await self.store.runs.attach(namespace, run_id, epoch)
        if attached is None:
            raise _no_such_run(run_id)
        _not_superseded(attached, epoch)
        if attached.state in ENDED:
            raise Problem("run-ended", f"run {run_id} has ended ({attached.state})", state=attached.state)
        if attached.lost:
            raise Problem("attempt-lost", f"attempt {epoch} of run {run_id} was found lost; the "
                          "supervisor starts a new one", epoch=epoch)
        return attached

    async def lose_attachment(self, namespace: str, run_id: str, epoch: int, attachment: int,
                              waited_s: float, *, process_exited: bool = False) -> bool:
        """Held connection number ``attachment`` of attempt ``epoch`` stayed gone for ``waited_s``
        (the grace, or until its process on this host exited): mark the attempt lost,
        unless a connection was held after it or the attempt is over."""
        event = {"event": "attachment-lost", "epoch": epoch, "attachment": attachment,
                 "waited_s": round(waited_s, 3), **({"process": "exited"} if process_exited else {})}
        lost = await self.store.runs.lose(namespace, run_id, epoch, time.time(), event, attachment=attachment)
        if lost:
            log.warning("run %s/%s epoch %d: its held connection %s; restarting it", namespace, run_id, epoch,
                        "closed and its process exited" if process_exited else f"stayed gone for {waited_s:g}s")
        return lost


    # -- operators and the supervisor: any run ------------------------------------------------

    async def find(self, run_id: str, namespace: str | None = None) -> Run:
        """The run an operator names; ``namespace`` picks one where the id is in several."""
        runs = await self.store.runs.find(namespace, run_id)
        if not runs:
            raise Problem("not-found", f"no run {run_id!r}")
        if len(runs) > 1:
            names = sorted(r.namespace for r in runs)
            raise Problem("ambiguous-run", f"run {run_id!r} exists in several namespaces "
                          f"({', '.join(names)}); add ?namespace= (CLI: --namespace)", namespaces=names)
        return runs[0]

    async def restart(self, run: Run, *, reason: str = ADMIN_RESTART, expected_epoch: int | None = None,
                      now: float | None = None, window_s: float | None = None,
                      ended: dict | None = None) -> Run | None:
        """Start a new attempt of ``run`` and fire its hook; None if the claim was lost.

        ``expected_epoch`` makes the claim a compare-and-set (the supervisor's case); None
        restarts whatever the current epoch is (an operator's restart). ``window_s`` counts
        the restart towards ``max_restarts`` (the supervisor's restarts do; an operator's do not).
        ``ended``: how the attempt before ended (proxy/runs/endings.py), kept with the restart.
        """
        now = time.time() if now is None else now
        new = await self.store.runs.new_attempt(run.namespace, run.run_id, expected_epoch, now, reason,
                                                restart=True, window_s=window_s, ended=ended)
        if new is None:
            return None
        log.info("run %s/%s restarted (%s): epoch %d, restart %d", new.namespace, new.run_id, reason,
                 new.epoch, new.restarts)
        await self.launcher.fire(new.hook, RESTART, new)
        return new

    async def restart_now(self, run_id: str, namespace: str | None = None, *, by: str) -> Run:
        """An operator's restart: a new attempt at once, its hook fired. A dead run is revived.
        ``by``: the operator, as the attempt's ending and the audit name them."""
        run = await self.find(run_id, namespace)
        if run.state == RunState.DEAD:
            return await self._revive(run, by)
        if run.state in ENDED:
            raise Problem("run-ended", f"run {run.run_id} has ended ({run.state})", state=run.state)
        new = await self.restart(run, ended=await with_log_tail(run, operator_ending(by)))
        if new is None:
            raise Problem("run-ended", f"run {run.run_id} ended meanwhile")
        await self._noted(by, "restart", new, epoch=new.epoch)
        return new

    async def revive(self, run_id: str, namespace: str | None = None, *, by: str) -> Run:
        """An operator's second chance for a dead run: a new attempt with its restarts
        forgotten (``max_restarts`` counts from here), its hook fired."""
        run = await self.find(run_id, namespace)
        if run.state != RunState.DEAD:
            raise Problem("not-dead", f"run {run.run_id} is {run.state}; only a dead run is revived",
                          state=run.state)
        return await self._revive(run, by)

    async def _revive(self, run: Run, by: str) -> Run:
        new = await self.store.runs.revive(run.namespace, run.run_id, time.time())
        if new is None:
            raise Problem("not-dead", f"run {run.run_id} was revived or changed meanwhile")
        log.info("run %s/%s revived by %s: epoch %d, restart %d", new.namespace, new.run_id, by, new.epoch,
                 new.restarts)
        await self._noted(by, "revive", new, epoch=new.epoch)
        await self.launcher.fire(new.hook, RESTART, new)
        return new

    async def _noted(self, by: str, action: str, run: Run | None = None, entry: Entry | None = None,
                     **detail) -> None:
        """Keep an operator's action, once it is done (proxy/runs/operators.py)."""
        namespace, run_id = (run.namespace, run.run_id) if run is not None else \
            (entry.namespace if entry.run is not None else None, entry.run)
        await self.store.audit.note(Action(time.time(), by, action, namespace, run_id,
                                           entry.kid if entry is not None else None, detail),
                                    self.settings.store.retention)

    async def actions(self, run: Run) -> list[Action]:
        """The operator actions on ``run`` and its entries, oldest first."""
        return await self.store.audit.of_run(run.namespace, run.run_id)

    async def refusals(self, run: Run) -> dict[str, Any]:
        """The refusals the run's calls got: ``{"count", "recent"}`` (proxy/runs/refusals.py)."""
        count, recent = await self.store.audit.refusals(run.namespace, run.run_id)
        return {"count": count, "recent": recent}

    async def entry_actions(self, kid: str) -> list[Action]:
        """The operator actions on entry ``kid``, oldest first."""
        return await self.store.audit.of_entry(kid)

    async def listing(self, state: RunState | None, limit: int) -> tuple[list[Run], dict[tuple[str, str], int]]:
        """The newest runs (of ``state``), and how many journal entries each has."""
        runs = await self.store.runs.list(state, limit)
        return runs, await self.store.journal.count_steps([(r.namespace, r.run_id) for r in runs])

    async def delete_journal(self, run: Run, *, by: str) -> int:
        """Delete the run's journal; answer once no process can replay it from memory: the
        delete raised the journal's generation, and every process's memory answers only
        within ``cache_lease`` of a look at it (proxy/freshness.py). The audit keeps who."""
        deleted = await self.store.journal.delete_run(run.namespace, run.run_id)
        await self._noted(by, "delete-journal", run, deleted=deleted)
        await asyncio.sleep(self.settings.store.cache_lease)
        return deleted

    async def purge(self) -> tuple[int, int]:
        """Delete expired journal entries, and the runs neither seen nor ended for a retention;
        (entries, runs) deleted."""
        now = time.time()
        entries = await self.store.journal.purge(now)
        await self.store.audit.purge(now)
        return entries, await self.store.runs.purge(now - self.settings.store.retention)

    async def journal(self, run: Run, *, bodies: bool = False) -> list[Entry]:
        """The run's journal entries, oldest first; with their responses when ``bodies``."""
        entries = await self.store.journal.entries(run.namespace, run.run_id)
        if bodies:
            full = [await self.store.journal.get(e.kid) for e in entries]
            for listed, got in zip(entries, full):
                if got is not None:
                    got.replayed = listed.replayed  # get() leaves the replays by epoch out
            entries = [f if f is not None else e for e, f in zip(entries, full)]
        return entries

    async def kid(self, given: str) -> str:
        """The one kid that starts with ``given`` (at least MIN_KID_PREFIX hex digits): operators
        name an entry by the start of its kid, as tables show it."""
        prefix = given.strip().lower()
        if len(prefix) == KID_LENGTH:
            return prefix
        if len(prefix) < MIN_KID_PREFIX or len(prefix) > KID_LENGTH or not HEX.fullmatch(prefix):
            raise Problem("invalid-request", f"{given!r} is not a kid: {KID_LENGTH} hex digits, or the first "
                          f"{MIN_KID_PREFIX} or more of them")
        found = await self.store.journal.kids(prefix, 2)
        if not found:
            raise Problem("not-found", f"no journal entry's kid starts with {prefix}")
        if len(found) > 1:
            raise Problem("invalid-request", f"several journal entries' kids start with {prefix} "
                          f"({', '.join(found)}, ...): give more of the kid")
        return found[0]

    async def entry(self, kid: str) -> Entry:
        """A journal entry with its response (``journal show``)."""
        entry = await self.store.journal.get(kid)
        if entry is None:
            raise Problem("not-found", f"no journal entry {kid}")
        return entry

    async def entries(self, state: EntryState | None = None, limit: int = 100, *, run: str | None = None,
                      tenant: str | None = None) -> list[Entry]:
        """Journal entries of every run (or of ``run``, or ``tenant``), newest first, without
        bodies (``journal list``, the console's quarantine and journal pages)."""
        return await self.store.journal.search(state=state, run=run, tenant=tenant, limit=limit)

    async def find_key(self, key: str, *, tenant: str | None = None, run: str | None = None,
                       limit: int = 100) -> list[Entry]:
        """Entries the agent recorded under its own ``Idempotency-Key``, newest first.
        ``tenant`` is as entries show it (``t:NAME``, ``k:HASH``, ``anonymous``); a bare
        name is the trusted tenant ``t:NAME``."""
        if tenant is not None and ":" not in tenant and tenant != "anonymous":
            tenant = "t:" + tenant
        return await self.store.journal.search(key=Scope.agent_key(key), tenant=tenant,
                                               run=run, limit=limit)

    async def resolve(self, kid: str, recorded: Recorded | None, *, by: str) -> Entry:
        """Settle an outcome-unknown entry: None retries it (kept as ``retried``, the next call
        goes upstream), else ``recorded`` is replayed. The answer's headers are kept as the
        proxy keeps an upstream's: no hop-by-hop or framing headers, no cookies, none of its
        upstream's ``redact_headers``. The audit keeps who, the status and the body's digest."""
        entry = await self.store.journal.get(kid)
        if entry is None:
            raise Problem("not-found", f"no journal entry {kid}")
        if entry.state == EntryState.UNKNOWN:
            if recorded is not None:
                recorded.headers = self._storable(entry.upstream, recorded.headers)
            if await self.store.journal.resolve(kid, recorded):
                if recorded is None:
                    await self._noted(by, "resolve-retry", entry=entry, why=entry.detail)
                else:
                    await self._noted(by, "resolve-respond", entry=entry, why=entry.detail,
                                      status=recorded.status, body_bytes=len(recorded.body),
                                      body_digest=body_digest(recorded.body))
                return entry
        raise Problem("not-quarantined", f"entry {kid} is {entry.state}, not quarantined", state=entry.state)

    def _storable(self, upstream: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        kept = [(k, v) for k, v in headers if k.lower() not in NOT_FORWARDED]
        settings = self.settings.upstreams.get(upstream)
        if settings is None:  # no longer configured: its redactions are unknown, ours still hold
            return [(k, v) for k, v in kept if k.lower() not in NEVER_STORED]
        return storable_headers(kept, settings)


def _no_such_run(run_id: str) -> Problem:
    return Problem("not-found", f"no run {run_id!r} in this namespace")


def _not_superseded(run: Run, epoch: int | None) -> None:
    """Refuse a caller from an attempt older than the run's (the store changed nothing)."""
    if epoch is not None and run.epoch > epoch:
        raise Problem("stale-epoch", f"run {run.run_id} is at epoch {run.epoch}; this attempt "
                      f"(epoch {epoch}) has been superseded", epoch=run.epoch)
