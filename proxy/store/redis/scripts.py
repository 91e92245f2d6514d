"""The Lua scripts of the Redis store: each change to the journal or a run, atomically.

Key layout and conventions: see the package docstring. Scripts get their shard's prefix as
an argument where they reach keys they learn from the data (a run's indexes, its history):
every key a script touches is of one shard (:mod:`.shards`), so on Redis Cluster they are all
in the slot of the key the script names. Absent hash fields stand
for None. Times are UNIX seconds as decimal strings; expiries are milliseconds. Constants
shared with the other stores (run states, the history's length) are written into the
script text from :mod:`..model` and :mod:`..rules`, so they are defined once.

The scripts themselves: the journal's in :mod:`.journal_scripts`, the runs' in
:mod:`.run_scripts`; this module names them all.
"""

from .journal_scripts import JOURNAL_SCRIPTS
from .run_scripts import RUN_SCRIPTS

READ_ONLY = frozenset({"read", "recorded", "read_partial"})  # the scripts that write nothing


def sharded(source: str) -> str:
    """A script for Redis Cluster: its notifications on the sharded channel, in its own slot."""
    return source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")


SCRIPTS = {**JOURNAL_SCRIPTS, **RUN_SCRIPTS}
