"""Credentials end to end: the SDK's API key and JWT against the server's real
authentication (keys file, HS256 JWT), and over TLS with a certificate made in the test."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc
import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stargrpc.auth.keys import KeyStore
from stargrpc.client import NO_RETRY, AsyncClient, CallError

JWT_SECRET = "a-test-secret-that-is-long-enough-for-hs256"


async def test_api_key_and_jwt_are_accepted_and_bad_credentials_refused(
        make_server, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.json"
    _, key = KeyStore(keys_file).create("agent", ["admin"])
    server = await make_server(keys_file=keys_file, jwt_secret=JWT_SECRET, jwt_issuer="idp",
                               jwt_audience="stargrpc")
    now = dt.datetime.now(dt.UTC)
    token = jwt.encode({"sub": "svc", "roles": ["admin"], "iss": "idp", "aud": "stargrpc",
                        "exp": now + dt.timedelta(minutes=5)}, JWT_SECRET, algorithm="HS256")

    target = f"127.0.0.1:{server.port}"
    async with AsyncClient.connect(target, api_key=key) as with_key:
        assert (await with_key.call("echo", {"text": "key"})).output == "key"
    async with AsyncClient.connect(target, token=token) as with_token:
        assert (await with_token.call("echo", {"text": "jwt"})).output == "jwt"
    for bad in ({}, {"api_key": key[:-4] + "AAAA"}):
        async with AsyncClient.connect(target, **bad) as client:
            with pytest.raises(CallError) as raised:
                await client.list_tools()
            assert raised.value.code is grpc.StatusCode.UNAUTHENTICATED


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "server.pem", tmp_path / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


async def test_tls_with_a_ca_file(make_server, tmp_path: Path) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    server = await make_server(tls_cert_file=cert_file, tls_key_file=key_file,
                               insecure_no_auth=True)

    async with AsyncClient.connect(f"localhost:{server.port}", ca_file=cert_file) as client:
        assert (await client.call("echo", {"text": "over tls"})).output == "over tls"
    async with AsyncClient.connect(f"localhost:{server.port}", retry=NO_RETRY) as plaintext:
        with pytest.raises(CallError) as raised:
            await plaintext.list_tools(timeout=5)
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
