"""The YAML config, in four parts, each importing only those before it:

* :mod:`~fenceproxy.config.schema`: the file's schema as small immutable models,
  validated once at start-up, and the values its sections share;
* :mod:`~fenceproxy.config.material`: what the config names but does not hold, read
  at start and on each reload: signing keys, credentials, TLS contexts and the
  certificates the proxy presents;
* :mod:`~fenceproxy.config.loading`: reading a file, and every error as one
  :class:`~fenceproxy.errors.ConfigError` naming the file and the key;
* :mod:`~fenceproxy.config.reload`: what only a restart changes, kept on a reload.

The names below are the ones the rest of fenceproxy, and its users, import from here.
"""

from .loading import load_config, parse_config
from .material import (
    Presented,
    TlsContexts,
    admin_credentials,
    lease_credentials,
    presented,
    signing_keys,
    tls_contexts,
    tracing_headers,
)
from .reload import Reader, restart_only, setting
from .schema import (
    Config,
    FenceSpec,
    IdempotencySpec,
    LeaseClientSpec,
    LeasesSpec,
    LimitsSpec,
    RouteSpec,
    SigningKeySpec,
    SigningSpec,
    TracingSpec,
    is_loopback,
    parse_listen,
)

__all__ = [
    "Config",
    "FenceSpec",
    "IdempotencySpec",
    "LeaseClientSpec",
    "LeasesSpec",
    "LimitsSpec",
    "Presented",
    "Reader",
    "RouteSpec",
    "SigningKeySpec",
    "SigningSpec",
    "TlsContexts",
    "TracingSpec",
    "admin_credentials",
    "is_loopback",
    "lease_credentials",
    "load_config",
    "parse_config",
    "parse_listen",
    "presented",
    "restart_only",
    "setting",
    "signing_keys",
    "tls_contexts",
    "tracing_headers",
]
