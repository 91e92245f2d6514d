"""Runs: the service every caller goes through, and its two HTTP faces.

- :mod:`.service` — register, beat, end, new attempts, restarts, resolutions (plain
  Python; refusals are :class:`~..problems.Problem`);
- :mod:`.options` — what a request body may ask for, checked;
- :mod:`.views` — a run and its journal as JSON (the APIs and the CLI show the same);
- :mod:`.api` (agents) and :mod:`.admin` (operators) — thin aiohttp handlers over the service.
"""

from .service import Launcher, RunsService

__all__ = ["Launcher", "RunsService"]
