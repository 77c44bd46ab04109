"""JWT bearer tokens, verified with PyJWT.

One key source is configured: an HS256 shared secret, a PEM public key (RS256 or ES256, by
the key's type) or a JWKS file (the key picked by the token's ``kid``; the file is re-read
when it changes, so keys rotate without a restart). The accepted algorithms follow from the
key, never from the token, so a token cannot pick a weaker check. Issuer, audience and
expiry are required and checked, not-before when present, with a small leeway for clock skew.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jwt
import structlog
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from stargrpc.errors import AuthConfigError, CredentialsRejected
from stargrpc.file_trust import others_may_write
from stargrpc.principal import MAX_PRINCIPAL_CHARS, Principal
from stargrpc.settings import Settings

log = structlog.get_logger("stargrpc.auth")

#: How long a verified token is taken without verifying it again (never past its ``exp``;
#: a change of the JWKS file forgets every token verified before it).
VERIFIED_SECONDS = 10.0
#: Tokens remembered as verified at most (the oldest forgotten first).
MAX_VERIFIED = 10_000

# Which PyJWT errors mean what, for the server log and the auth-failure metric.
_CAUSES: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "token_expired"),
    (jwt.ImmatureSignatureError, "token_not_yet_valid"),
    (jwt.InvalidIssuerError, "token_wrong_issuer"),
    (jwt.InvalidAudienceError, "token_wrong_audience"),
    (jwt.MissingRequiredClaimError, "token_missing_claim"),
    (jwt.InvalidSignatureError, "token_bad_signature"),
)


def _algorithms_for(key: Any) -> list[str]:
    if isinstance(key, rsa.RSAPublicKey):
        return ["RS256"]
    if isinstance(key, ec.EllipticCurvePublicKey):
        return ["ES256"]
    raise ValueError(f"unsupported JWT public key type {type(key).__name__}; "
                     "give an RSA or EC P-256 key")


class _JwksFile:
    """A JWKS file, re-read when its modification time changes.

    A file that changes into something that is not a JWK set (half written by whatever
    rotates it), or that another user may have written, leaves the keys read before it in
    use: it is logged, not read again until it changes once more, and locks no caller out.
    A whole set without a usable key (``{"keys": []}``) is taken as it is: no key.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._unusable: tuple[int, int] | None = None
        self._keys: dict[str, jwt.PyJWK] = {}

    def refresh(self) -> None:
        """Re-reads the file if it changed.

        Raises:
            OSError: The file cannot be read.
            jwt.PyJWKSetError: It holds no usable key, and no keys were read before.
        """
        info = self.path.stat()
        stamp = (info.st_mtime_ns, info.st_size)
        if stamp in (self._stamp, self._unusable):
            return
        with self.path.open(encoding="utf-8") as file:
            others = others_may_write(os.fstat(file.fileno()))
            text = file.read()
        try:
            if others is not None:  # anyone could have added a key of their own to it
                raise ValueError(f"the file {others}: refused (make it the server's user's, "
                                 "mode 600 or 644)")
            listed = json.loads(text)
            if not isinstance(listed, dict) or not isinstance(listed.get("keys"), list):
                raise ValueError('not a JWK set: no "keys" list')
        except (ValueError, RecursionError) as exc:  # half written, or not to be trusted
            if self._stamp is None:  # never read: start-up says so
                raise jwt.PyJWKSetError(str(exc)) from exc
            self._unusable = stamp
            log.warning("jwks_file_unusable", path=str(self.path), error=str(exc),
                        keeping=sorted(self._keys))
            return
        try:
            keys = jwt.PyJWKSet(listed["keys"]).keys
        except jwt.PyJWKSetError:
            if self._stamp is None:
                raise
            # A whole set of no usable key (emptied on purpose, say): none is taken now.
            keys = []
        self._keys = {k.key_id or "": k for k in keys}
        self._stamp, self._unusable = stamp, None

    def changed(self) -> bool:
        """Whether the file changed since it was last read (or cannot be looked at); an
        unusable version of it, once looked at, is no change."""
        try:
            info = self.path.stat()
        except OSError:
            return True
        return (info.st_mtime_ns, info.st_size) not in (self._stamp, self._unusable)

    def key(self, kid: str | None) -> jwt.PyJWK:
        """The key with id ``kid`` (or the only key, for a token without one)."""
        self.refresh()
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        found = self._keys.get(kid or "")
        if found is None:
            raise CredentialsRejected("token_unknown_kid")
        return found


class JwtVerifier:
    """Turns a bearer JWT into a :class:`Principal` (method "jwt")."""

    def __init__(self, settings: Settings) -> None:
        """Reads the configured key.

        Raises:
            AuthConfigError: No JWT key is configured, or the key is unusable.
            OSError: The key file cannot be read.
        """
        self._issuer = settings.jwt_issuer
        self._audience = settings.jwt_audience
        self._leeway = settings.jwt_leeway_seconds
        self._principal_claim = settings.jwt_principal_claim
        self._roles_claim = settings.jwt_roles_claim
        self._jwks: _JwksFile | None = None
        # Token -> (monotonic time it must be verified again, its principal).
        self._verified: dict[str, tuple[float, Principal]] = {}
        self._key: Any = None
        self._algorithms: list[str] = []
        if settings.jwt_secret is not None:
            secret = settings.jwt_secret.get_secret_value()
            if len(secret) < 32:
                # RFC 7518 §3.2: an HS256 key must be at least as long as the hash.
                raise AuthConfigError("jwt_secret must be at least 32 characters")
            self._key, self._algorithms = secret, ["HS256"]
        elif settings.jwt_public_key_file is not None:
            try:
                with settings.jwt_public_key_file.open("rb") as file:
                    others = others_may_write(os.fstat(file.fileno()))
                    if others is not None:
                        raise ValueError(f"the file {others}, who could have put a key of "
                                         "their own in it: refused (make it the server's "
                                         "user's, mode 600 or 644)")
                    self._key = load_pem_public_key(file.read())
                self._algorithms = _algorithms_for(self._key)
            except ValueError as exc:
                raise AuthConfigError(f"{settings.jwt_public_key_file}: {exc}") from exc
        elif settings.jwt_jwks_file is not None:
            self._jwks = _JwksFile(settings.jwt_jwks_file)
            try:
                self._jwks.refresh()  # a broken file stops start-up rather than every call
            except jwt.PyJWKSetError as exc:
                raise AuthConfigError(f"{settings.jwt_jwks_file}: {exc}") from exc
        else:
            raise AuthConfigError("no JWT key configured")

    def verify(self, token: str) -> Principal:
        """The principal ``token`` names. A token verified in the last
        :data:`VERIFIED_SECONDS` (and not expired since) is not verified again: the MCP
        endpoint's door and the gRPC call it makes, or an agent's calls in a row, present
        the same token, and a signature check costs 80 to 200 µs.

        Raises:
            CredentialsRejected: Bad signature, wrong issuer/audience, expired, not yet valid,
                missing claims, or an unknown key id.
        """
        now = time.monotonic()
        kept = self._verified
        if self._jwks is not None and self._jwks.changed():
            kept.clear()  # a key retired from the JWKS file counts from the next call on
        verified = kept.get(token)
        if verified is not None and verified[0] > now:
            return verified[1]
        principal, expires_in = self._verify(token)
        while kept and (len(kept) >= MAX_VERIFIED or next(iter(kept.values()))[0] <= now):
            del kept[next(iter(kept))]
        kept[token] = (now + min(VERIFIED_SECONDS, expires_in), principal)
        return principal

    def _verify(self, token: str) -> tuple[Principal, float]:
        """The principal ``token`` names and the seconds until it expires (checked)."""
        try:
            key, algorithms = self._key, self._algorithms
            if self._jwks is not None:
                jwk = self._jwks.key(jwt.get_unverified_header(token).get("kid"))
                key = jwk.key
                algorithms = [jwk.algorithm_name] if jwk.algorithm_name in ("RS256", "ES256") \
                    else _algorithms_for(key)
            claims = jwt.decode(
                token, key, algorithms=algorithms, audience=self._audience,
                issuer=self._issuer, leeway=self._leeway,
                options={"require": ["exp", "iss", "aud", self._principal_claim]})
        except CredentialsRejected:
            raise
        except (jwt.PyJWTError, OSError, ValueError) as exc:
            cause = next((c for cls, c in _CAUSES if isinstance(exc, cls)), "token_invalid")
            raise CredentialsRejected(cause) from exc
        subject = claims[self._principal_claim]
        if not isinstance(subject, str) or not subject:
            raise CredentialsRejected("token_missing_claim")
        if len(subject) > MAX_PRINCIPAL_CHARS:
            raise CredentialsRejected("token_subject_too_long")
        principal = Principal(id=subject, roles=frozenset(roles_from(claims, self._roles_claim)),
                              method="jwt")
        return principal, float(claims["exp"]) - time.time()


def roles_from(claims: Mapping[str, Any], claim: str) -> list[str]:
    """The roles in ``claims[claim]``: a list of strings or a space-separated string (the
    OAuth ``scope`` style). Dots reach nested claims (``realm_access.roles``)."""
    value: Any = claims
    for part in claim.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str) and item]
    return []
