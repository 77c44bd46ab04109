"""The secure embedded default: a server with no credentials configured gets one admin key
on its first start, shown once, with only its hash stored."""

from __future__ import annotations

from stargrpc.auth.authenticator import keys_path
from stargrpc.auth.keys import ApiKey, KeyStore
from stargrpc.settings import Settings

#: The name (principal id) of the key made on first start.
BOOTSTRAP_KEY_NAME = "admin"


def bootstrap_admin_key(settings: Settings) -> tuple[ApiKey, str] | None:
    """Creates the first admin key when the server would otherwise admit nobody.

    Nothing is created when authentication is off, bootstrapping is turned off, JWT or
    client certificates are configured (the operator brought an identity source), or the
    keys file already holds any key, revoked ones included (revoking every key must not
    conjure a new one on the next start).

    Returns:
        The stored record and the key, which must be shown to the operator now: it is
        stored nowhere.

    Raises:
        KeysFileError: The keys file cannot be read or written.
    """
    if settings.insecure_no_auth or not settings.auth_bootstrap_key:
        return None
    if any(source is not None for source in (settings.jwt_secret, settings.jwt_public_key_file,
                                             settings.jwt_jwks_file,
                                             settings.tls_client_ca_file)):
        return None
    return KeyStore(keys_path(settings)).create_first(
        BOOTSTRAP_KEY_NAME, [settings.admin_role, settings.privileged_role])
