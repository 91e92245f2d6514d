"""Settings: frozen values per concern, loaded once.

Loading order: the TOML file (``config/default.toml`` when none is named), then
``IDEMPROXY_*`` environment variables, then CLI overrides. Every option is declared once,
as a dataclass field (settings.py); the environment name is derived from it
(``[server] port`` -> ``IDEMPROXY_SERVER_PORT``, ``[upstreams.openai] url`` ->
``IDEMPROXY_UPSTREAMS_OPENAI_URL``). loading.py reads them, validation.py checks them,
masking.py keeps secrets out of reprs and logs.
"""

from .loading import load_settings, parse_duration, unknown_variables
from .masking import Secret, mask_url
from .settings import (ANONYMOUS_CHOICES, ENV_PREFIX, MAX_STANDBY, MODEL_PROVIDERS, NAMED_SECTIONS,
                       RESERVED_NAMES, RUNS_PER_CREDENTIAL, RUNS_SHARED, SECTIONS, AdminSettings,
                       ConfigError, HookSettings, IgnoreFields, IgnoreOrder, Policy, Rule, RunSettings,
                       ServerSettings, Settings, StoreSettings, SupervisorSettings, TenantSettings, UpstreamSettings,
                       ambiguous_policy, keepalive_timeout, shares_anonymous, upstream_kind)

__all__ = ["ANONYMOUS_CHOICES", "ENV_PREFIX", "MAX_STANDBY", "MODEL_PROVIDERS", "NAMED_SECTIONS",
           "RESERVED_NAMES", "RUNS_PER_CREDENTIAL", "RUNS_SHARED", "SECTIONS", "AdminSettings", "ConfigError",
           "HookSettings", "IgnoreFields", "IgnoreOrder", "Policy", "Rule", "RunSettings", "Secret", "ServerSettings",
           "Settings", "StoreSettings", "SupervisorSettings", "TenantSettings", "UpstreamSettings",
           "ambiguous_policy", "keepalive_timeout", "load_settings", "mask_url", "parse_duration", "shares_anonymous",
           "unknown_variables", "upstream_kind"]
