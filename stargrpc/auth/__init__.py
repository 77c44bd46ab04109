"""Authentication: API keys (hashed, in a keys file), JWTs and mTLS client certificates.

- :mod:`stargrpc.auth.keys` — the keys file and key verification.
- :mod:`stargrpc.auth.jwt` — JWT verification (HS256, RS256/ES256, JWKS).
- :mod:`stargrpc.auth.mtls` — TLS server credentials and certificate principals.
- :mod:`stargrpc.auth.authenticator` — credentials of a call to a principal.
- :mod:`stargrpc.auth.bootstrap` — the admin key made on first start.

The gRPC side is :mod:`stargrpc.server.interceptors.auth`; who may run which tool is
:mod:`stargrpc.runs.permissions`.
"""

from __future__ import annotations

from stargrpc.auth.authenticator import LOCAL, Authenticator, LocalPrincipal, keys_path
from stargrpc.auth.bootstrap import bootstrap_admin_key
from stargrpc.auth.keys import ApiKey, KeyStore
from stargrpc.auth.mtls import server_credentials

__all__ = [
    "LOCAL",
    "ApiKey",
    "Authenticator",
    "KeyStore",
    "LocalPrincipal",
    "bootstrap_admin_key",
    "keys_path",
    "server_credentials",
]
