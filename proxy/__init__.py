"""idemproxy: a reverse proxy that journals AI agents' side-effecting calls.

A restarted run replays its recorded calls from the journal instead of paying for
them twice, and goes live again where it died. See README.md and docs/.
"""

__version__ = "0.2.0"
