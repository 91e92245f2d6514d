"""The supervisor: the loop that restarts silent runs, the hooks that start them, and the
``supervise``, ``runs`` and ``journal`` commands. It works through the runs service
(proxy/runs) and the store, never through the proxy's app or request path."""

from . import commands
from .hooks import HookCall, Hooks
from .loop import Supervisor

__all__ = ["HookCall", "Hooks", "Supervisor", "commands"]
