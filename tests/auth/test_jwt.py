"""JWT bearer tokens: HS256 with a secret, RS256 with a PEM key, ES256 from a JWKS file."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from pydantic import ValidationError

from stargrpc.auth.jwt import JwtVerifier, roles_from
from stargrpc.errors import AuthConfigError, CredentialsRejected
from stargrpc.principal import MAX_PRINCIPAL_CHARS
from stargrpc.settings import Settings
from tests.auth.helpers import whoami
from tests.auth_tools import auth_registry

SECRET = "a-test-secret-that-is-long-enough-for-hs256"
ISSUER, AUDIENCE = "https://idp.example", "stargrpc"


def claims(**changes: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"sub": "user-1", "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 300,
            "roles": ["ops", "reader"]}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def hs256(**changes: Any) -> str:
    return jwt.encode(claims(**changes), SECRET, algorithm="HS256")


async def test_hs256_tokens_are_checked_for_signature_issuer_audience_and_time(
        make_auth_server) -> None:
    auth = await make_auth_server(auth_registry(), jwt_secret=SECRET, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE, jwt_leeway_seconds=5)
    now = int(time.time())
    refused = {
        "expired": hs256(exp=now - 60),
        "not yet valid": hs256(nbf=now + 600),
        "wrong issuer": hs256(iss="https://evil.example"),
        "wrong audience": hs256(aud="another-service"),
        "no expiry": hs256(exp=None),
        "no subject": hs256(sub=None),
        "wrong secret": jwt.encode(claims(), "another-secret-that-is-long-enough-too!",
                                   algorithm="HS256"),
        "unsigned": jwt.encode(claims(), None, algorithm="none"),
    }

    assert await whoami(auth.target, hs256()) == "user-1 jwt ops,reader"
    assert await whoami(auth.target, auth.key) == "tester api_key admin"  # keys still work
    for name, token in refused.items():
        assert await whoami(auth.target, token) == "UNAUTHENTICATED", name


def pem(public_key: Any) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


async def test_rs256_with_a_public_key_file(make_auth_server, tmp_path: Path) -> None:
    key, other = (rsa.generate_private_key(public_exponent=65537, key_size=2048)
                  for _ in range(2))
    key_file = tmp_path / "idp.pem"
    key_file.write_bytes(pem(key.public_key()))
    auth = await make_auth_server(auth_registry(), jwt_public_key_file=key_file,
                                  jwt_issuer=ISSUER, jwt_audience=AUDIENCE)

    assert await whoami(auth.target, jwt.encode(claims(), key, algorithm="RS256")) == \
        "user-1 jwt ops,reader"
    assert await whoami(auth.target, jwt.encode(claims(), other, algorithm="RS256")) == \
        "UNAUTHENTICATED"
    assert await whoami(auth.target, hmac_forgery(pem(key.public_key()))) == "UNAUTHENTICATED"


def hmac_forgery(public_pem: bytes) -> str:
    """The classic algorithm-confusion forgery: HS256 with the public key as the secret
    (made by hand, since PyJWT refuses to make it)."""
    def part(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = (part(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "."
                     + part(json.dumps(claims()).encode()))
    signature = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + part(signature)


def jwks(*keys: tuple[str, ec.EllipticCurvePrivateKey]) -> str:
    entries = []
    for kid, private in keys:
        entry = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private.public_key()))
        entries.append({**entry, "kid": kid, "alg": "ES256", "use": "sig"})
    return json.dumps({"keys": entries})


async def test_es256_from_a_jwks_file_that_rotates(make_auth_server, tmp_path: Path) -> None:
    first, second = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks(("k1", first)))
    auth = await make_auth_server(auth_registry(), jwt_jwks_file=jwks_file, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE, jwt_roles_claim="scope")
    scoped = claims(roles=None, scope="tools:read tools:run")

    def token(kid: str, key: ec.EllipticCurvePrivateKey) -> str:
        return jwt.encode(scoped, key, algorithm="ES256", headers={"kid": kid})

    assert await whoami(auth.target, token("k1", first)) == "user-1 jwt tools:read,tools:run"
    assert await whoami(auth.target, token("k2", second)) == "UNAUTHENTICATED"

    jwks_file.write_text(jwks(("k2", second)) + "\n")  # rotated: k1 retired, k2 in use

    assert await whoami(auth.target, token("k2", second)) == "user-1 jwt tools:read,tools:run"
    assert await whoami(auth.target, token("k1", first)) == "UNAUTHENTICATED"


def verifier(**settings: Any) -> JwtVerifier:
    return JwtVerifier(Settings(jwt_secret=SECRET, jwt_issuer=ISSUER, jwt_audience=AUDIENCE,
                                jwt_leeway_seconds=0, **settings))


@pytest.mark.parametrize(("token", "cause"), [
    (hs256(exp=1), "token_expired"),
    (hs256(nbf=int(time.time()) + 600), "token_not_yet_valid"),
    (hs256(iss="other"), "token_wrong_issuer"),
    (hs256(aud="other"), "token_wrong_audience"),
    (hs256(exp=None), "token_missing_claim"),
    (hs256(sub="u" * 257), "token_subject_too_long"),
    ("not-a-jwt", "token_invalid"),
])
def test_each_refusal_has_a_cause_for_the_log(token: str, cause: str) -> None:
    with pytest.raises(CredentialsRejected) as caught:
        verifier().verify(token)
    assert caught.value.cause == cause


async def test_a_subject_longer_than_a_principal_may_be_is_refused_not_cut(
        make_auth_server) -> None:
    # Cut, two subjects that differ only past the cut would be one caller (and one audit
    # principal); a subject of exactly the limit is a caller like any other.
    auth = await make_auth_server(auth_registry(), jwt_secret=SECRET, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE)
    longest = "u" * MAX_PRINCIPAL_CHARS

    assert await whoami(auth.target, hs256(sub=longest + "a")) == "UNAUTHENTICATED"
    assert await whoami(auth.target, hs256(sub=longest)) == f"{longest} jwt ops,reader"


def test_roles_come_from_a_configurable_claim() -> None:
    token = hs256(roles=None, realm_access={"roles": ["a", "b"]}, email="u@example")

    principal = verifier(jwt_roles_claim="realm_access.roles",
                         jwt_principal_claim="email").verify(token)

    assert (principal.id, sorted(principal.roles)) == ("u@example", ["a", "b"])
    assert roles_from({"scope": "x y"}, "scope") == ["x", "y"]
    assert roles_from({"roles": ["r"]}, "missing") == []


def test_jwt_settings_are_checked_at_start() -> None:
    with pytest.raises(ValidationError, match="jwt_issuer and jwt_audience"):
        Settings(jwt_secret=SECRET)
    with pytest.raises(AuthConfigError, match="at least 32"):
        JwtVerifier(Settings(jwt_secret="short", jwt_issuer=ISSUER, jwt_audience=AUDIENCE))


def test_a_token_verified_is_taken_again_without_a_signature_check_until_it_expires(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The MCP endpoint's door and the gRPC call it makes present the same token: its
    # signature is checked once. Never past the token's own exp, though.
    checked = []
    real_decode = jwt.decode

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        checked.append(1)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(jwt, "decode", counting_decode)
    check = verifier()
    token = hs256()
    assert [check.verify(token).id for _ in range(3)] == ["user-1"] * 3
    assert len(checked) == 1
    expiry = int(time.time()) + 1
    soon = hs256(exp=expiry)
    check.verify(soon)
    # Real time, not a timing assertion: wait until the token is past its exp.
    time.sleep(max(0.0, expiry - time.time()) + 0.05)
    with pytest.raises(CredentialsRejected) as refused:
        check.verify(soon)
    assert refused.value.cause == "token_expired"
    # A forged token is never taken from the cache: another string, checked, refused.
    with pytest.raises(CredentialsRejected):
        check.verify(token[:-2] + ("AA" if not token.endswith("AA") else "BB"))


def test_a_key_retired_from_the_jwks_file_refuses_its_tokens_at_once(tmp_path: Path) -> None:
    # The same token, verified (and remembered) before the rotation, is refused at the
    # first call after it.
    first, second = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks(("k1", first)))
    check = JwtVerifier(Settings(jwt_jwks_file=jwks_file, jwt_issuer=ISSUER,
                                 jwt_audience=AUDIENCE))
    token = jwt.encode(claims(), first, algorithm="ES256", headers={"kid": "k1"})
    assert check.verify(token).id == "user-1"
    jwks_file.write_text(jwks(("k2", second)) + "\n")
    with pytest.raises(CredentialsRejected) as refused:
        check.verify(token)
    assert refused.value.cause == "token_unknown_kid"


async def test_a_half_written_jwks_file_keeps_the_keys_read_before(make_auth_server,
                                                                    tmp_path: Path) -> None:
    first, second = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks(("k1", first)))
    auth = await make_auth_server(auth_registry(), jwt_jwks_file=jwks_file, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE)

    def token(kid: str, key: ec.EllipticCurvePrivateKey, subject: str) -> str:
        return jwt.encode(claims(sub=subject), key, algorithm="ES256", headers={"kid": kid})

    assert await whoami(auth.target, token("k1", first, "a")) == "a jwt ops,reader"

    # Whatever rotates the file writes it in place: a reader sees it empty, then half written.
    jwks_file.write_text("")
    assert await whoami(auth.target, token("k1", first, "b")) == "b jwt ops,reader"
    jwks_file.write_text(jwks(("k2", second))[:40])
    assert await whoami(auth.target, token("k1", first, "c")) == "c jwt ops,reader"
    assert await whoami(auth.target, token("k2", second, "c")) == "UNAUTHENTICATED"

    jwks_file.write_text(jwks(("k2", second)) + "\n")  # written in full: k2 now, k1 retired

    assert await whoami(auth.target, token("k2", second, "d")) == "d jwt ops,reader"
    assert await whoami(auth.target, token("k1", first, "a")) == "UNAUTHENTICATED"

    jwks_file.write_text(json.dumps({"keys": []}))  # a whole set of no key: no key is taken
    assert await whoami(auth.target, token("k2", second, "e")) == "UNAUTHENTICATED"


def test_a_jwks_file_that_is_not_json_stops_start_up(tmp_path: Path) -> None:
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text('{"keys": [')
    with pytest.raises(AuthConfigError):
        JwtVerifier(Settings(jwt_jwks_file=jwks_file, jwt_issuer=ISSUER, jwt_audience=AUDIENCE))


async def test_a_jwks_file_others_may_write_is_refused(make_auth_server, tmp_path: Path) -> None:
    idp, intruder = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(jwks(("k1", idp)))
    auth = await make_auth_server(auth_registry(), jwt_jwks_file=jwks_file, jwt_issuer=ISSUER,
                                  jwt_audience=AUDIENCE)

    def token(kid: str, key: ec.EllipticCurvePrivateKey, subject: str) -> str:
        return jwt.encode(claims(sub=subject, roles=["admin"]), key, algorithm="ES256",
                          headers={"kid": kid})

    assert await whoami(auth.target, token("k1", idp, "a")) == "a jwt admin"

    # Another user of the machine may write the file: they add a key of their own, in place.
    jwks_file.chmod(0o666)
    with jwks_file.open("w") as out:
        out.write(jwks(("k1", idp), ("k9", intruder)))

    assert await whoami(auth.target, token("k9", intruder, "b")) == "UNAUTHENTICATED"
    assert await whoami(auth.target, token("k1", idp, "c")) == "c jwt admin"  # kept as read


def test_a_jwt_key_file_others_may_write_stops_start_up(tmp_path: Path) -> None:
    jwks_file, pem_file = tmp_path / "jwks.json", tmp_path / "idp.pem"
    jwks_file.write_text(jwks(("k1", ec.generate_private_key(ec.SECP256R1()))))
    pem_file.write_bytes(pem(ec.generate_private_key(ec.SECP256R1()).public_key()))
    for path in (jwks_file, pem_file):
        path.chmod(0o666)

    with pytest.raises(AuthConfigError, match="writable by every user"):
        JwtVerifier(Settings(jwt_jwks_file=jwks_file, jwt_issuer=ISSUER, jwt_audience=AUDIENCE))
    with pytest.raises(AuthConfigError, match="writable by every user"):
        JwtVerifier(Settings(jwt_public_key_file=pem_file, jwt_issuer=ISSUER,
                             jwt_audience=AUDIENCE))
