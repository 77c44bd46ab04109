"""Who is calling: credentials (never the request body) to a :class:`Principal`.

Order: a bearer credential in the ``authorization`` metadata wins — an API key
(``sgk_…``) or, when JWT is configured, a JWT; without one, the verified client
certificate of an mTLS connection; without either, the call is refused. With
``insecure_no_auth`` every caller is :data:`LOCAL`, which holds every role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stargrpc.auth.jwt import JwtVerifier
from stargrpc.auth.keys import KEY_PREFIX, ApiKey, KeyStore
from stargrpc.auth.mtls import CertificateIdentity
from stargrpc.errors import CredentialsRejected
from stargrpc.principal import Principal
from stargrpc.settings import Settings


@dataclass(frozen=True)
class LocalPrincipal(Principal):
    """The caller of a server running with authentication off: it holds every role, so
    local experiments can run every tool, privileged ones included."""

    def has_role(self, role: str) -> bool:
        return True


#: The caller when authentication is off (``--insecure-no-auth``).
LOCAL = LocalPrincipal(id="local", roles=frozenset({"*"}), method="none")


def keys_path(settings: Settings) -> Path:
    """Where the API keys file is: ``keys_file``, or ``<state_dir>/keys.json``."""
    return settings.keys_file if settings.keys_file is not None \
        else settings.state_dir / "keys.json"


def bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The token of the ``authorization: Bearer …`` metadata entry, if there is one.

    Raises:
        CredentialsRejected: The header is there but is not a single bearer token.
    """
    values = [value for key, value in metadata if key == "authorization"]
    if not values:
        return None
    if len(values) > 1 or not isinstance(values[0], str):
        raise CredentialsRejected("malformed_header")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise CredentialsRejected("malformed_header")
    return token


class Authenticator:
    """Establishes the principal of a call from its metadata and TLS peer."""

    insecure: bool
    keys: KeyStore
    jwt: JwtVerifier | None
    certificates: CertificateIdentity | None

    def __init__(self, settings: Settings, *, keys: KeyStore | None = None) -> None:
        """Builds the configured credential checks.

        Raises:
            AuthConfigError: A JWT key is unusable.
            OSError: A JWT key file cannot be read.
        """
        self.insecure = settings.insecure_no_auth
        self.keys = keys if keys is not None else KeyStore(keys_path(settings))
        configured_jwt = (settings.jwt_secret, settings.jwt_public_key_file,
                          settings.jwt_jwks_file)
        self.jwt = (JwtVerifier(settings) if any(k is not None for k in configured_jwt)
                    else None)
        self.certificates = (CertificateIdentity(settings.mtls_roles)
                             if settings.tls_client_ca_file is not None else None)
        # The principal of each API key, made once per reading of the keys file.
        self._key_principals: dict[str, tuple[ApiKey, Principal]] = {}

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]],
                     auth_context: Mapping[str, Sequence[bytes]]) -> Principal:
        """The principal of a call.

        Args:
            metadata: The call's invocation metadata as (key, value) pairs.
            auth_context: The call's gRPC auth context (TLS peer properties).

        Raises:
            CredentialsRejected: No usable credentials; ``cause`` says why.
        """
        if self.insecure:
            return LOCAL
        token = bearer_token(metadata)
        if token is not None:
            if token.startswith(KEY_PREFIX):
                key = self.keys.verify(token)
                cached = self._key_principals.get(key.id)
                if cached is not None and cached[0] is key:  # the same record: unchanged
                    return cached[1]
                made = Principal(id=key.name, roles=frozenset(key.roles), method="api_key")
                self._key_principals[key.id] = (key, made)
                return made
            if self.jwt is not None:
                return self.jwt.verify(token)
            raise CredentialsRejected("unknown_token_kind")
        if self.certificates is not None:
            principal = self.certificates.principal(auth_context)
            if principal is not None:
                return principal
        raise CredentialsRejected("missing")
