"""The typed state an idemproxy app keeps (aiohttp ``web.AppKey``), in one place."""

from aiohttp import web
from aiohttp.typedefs import Handler

from .config import Settings
from .identity import TenantResolver
from .observability.metrics import Metrics
from .ratelimit import AuthGuard, Clients
from .request_path.handler import Proxy
from .runs import RunsService
from .runs.held import Attachments
from .store import Store

SETTINGS = web.AppKey("settings", Settings)
STORE = web.AppKey("store", Store)
PROXY = web.AppKey("proxy", Proxy)
METRICS = web.AppKey("metrics", Metrics)
RUNS = web.AppKey("runs", RunsService)
TENANTS = web.AppKey("tenants", TenantResolver)
ATTACHMENTS = web.AppKey("attachments", Attachments)
CLIENTS = web.AppKey("clients", Clients)  # who a request's client is, for ratelimit.py's counts
AUTH = web.AppKey("auth", AuthGuard)  # wrong admin tokens, per client
# The data plane: the proxy handler under its middleware chain (data_plane.py), once it exists
DATA_PLANE = web.AppKey("data_plane", Handler)
