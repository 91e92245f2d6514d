"""The supervisor: the loop that restarts silent runs and the hooks that start them. It works
through the runs service (proxy/runs) and the store, never through the proxy's app or request
path; its commands (``supervise``, ``runs``, ``journal``) are in the CLI (proxy/cli/)."""

from .hooks import HookCall, Hooks
from .loop import Supervisor

__all__ = ["HookCall", "Hooks", "Supervisor"]
