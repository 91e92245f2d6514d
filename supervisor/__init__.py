"""The supervisor: runs API, admin API, and the loop that restarts silent runs."""

from .api import routes
from .loop import supervisor_task

__all__ = ["routes", "supervisor_task"]
