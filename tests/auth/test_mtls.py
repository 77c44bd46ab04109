"""TLS serving and mTLS principals, with certificates made in the test."""

from __future__ import annotations

import asyncio
import base64
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from stargrpc.auth.mtls import CertificateIdentity
from stargrpc.errors import AuthConfigError, CredentialsRejected
from stargrpc.principal import MAX_PRINCIPAL_CHARS
from stargrpc.v1 import events_pb2, tool_service_pb2_grpc
from tests.auth.certs import TestCA
from tests.auth_tools import auth_registry
from tests.helpers import key_channel, run_tool


async def whoami(channel: grpc.aio.Channel) -> str:
    events = await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})
    assert events[-1].result.outcome == events_pb2.OUTCOME_OK
    return events[-1].result.output


def client_credentials(ca: TestCA, cert: bytes | None = None, key: bytes | None = None
                       ) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=ca.cert, private_key=key,
                                        certificate_chain=cert)


async def test_a_client_certificate_names_the_principal(make_auth_server, tmp_path) -> None:
    ca = TestCA()
    auth = await make_auth_server(auth_registry(), **ca.server_files(tmp_path),
                                  mtls_roles={"agent-1": ["ops"], "*": ["reader"]})
    agent = ca.client("agent-1")
    nameless = ca.client(None, organization="Example Org")

    async with grpc.aio.secure_channel(
            auth.target, client_credentials(ca, agent.cert, agent.key)) as channel:
        by_certificate = await whoami(channel)
    async with grpc.aio.secure_channel(
            auth.target, client_credentials(ca, nameless.cert, nameless.key)) as channel:
        by_subject = await whoami(channel)
    async with key_channel(auth.target, auth.key,
                           client_credentials(ca, agent.cert, agent.key)) as channel:
        by_key = await whoami(channel)

    assert by_certificate == "agent-1 mtls ops,reader"
    assert by_subject == "O=Example Org mtls reader"
    assert by_key == "tester api_key admin"  # a bearer credential wins over the certificate


async def test_mtls_refuses_clients_without_a_certificate_from_the_ca(
        make_auth_server, tmp_path) -> None:
    ca, stranger_ca = TestCA(), TestCA("someone else's CA")
    auth = await make_auth_server(auth_registry(), **ca.server_files(tmp_path))
    stranger = stranger_ca.client("agent-1")

    for credentials in (client_credentials(ca),
                        client_credentials(ca, stranger.cert, stranger.key)):
        async with key_channel(auth.target, auth.key, credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await run_tool(tool_service_pb2_grpc.ToolServiceStub(channel), "whoami", {})
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_tls_without_client_certificates_serves_api_keys(
        make_auth_server, tmp_path) -> None:
    ca = TestCA()
    files = ca.server_files(tmp_path)
    del files["tls_client_ca_file"]
    auth = await make_auth_server(auth_registry(), **files)

    async with key_channel(auth.target, auth.key, client_credentials(ca)) as channel:
        assert await whoami(channel) == "tester api_key admin"
    async with key_channel(auth.target, auth.key) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run_tool(tool_service_pb2_grpc.ToolServiceStub(plaintext), "whoami", {})
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_stargrpc_health_speaks_mtls(make_auth_server, tmp_path) -> None:
    ca = TestCA()
    auth = await make_auth_server(auth_registry(), **ca.server_files(tmp_path))
    agent = ca.client("probe")
    (tmp_path / "ca.pem").write_bytes(ca.cert)
    (tmp_path / "probe.pem").write_bytes(agent.cert)
    (tmp_path / "probe.key").write_bytes(agent.key)

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stargrpc.cli", "health", "--target", auth.target,
        "--ca-file", str(tmp_path / "ca.pem"), "--cert-file", str(tmp_path / "probe.pem"),
        "--key-file", str(tmp_path / "probe.key"), stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)

    assert (proc.returncode, out.decode().strip()) == (0, "SERVING")


async def test_a_certificate_with_two_common_names_names_nobody(
        make_auth_server, tmp_path) -> None:
    ca = TestCA()
    auth = await make_auth_server(auth_registry(), **ca.server_files(tmp_path),
                                  mtls_roles={"admin": ["admin"], "*": ["reader"]})
    # A CA that checks the last common name (as Go's crypto/x509 reads one) let this through.
    both = ca.issue(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "admin"),
                               x509.NameAttribute(NameOID.COMMON_NAME, "agent-1")]),
                    server=False)

    async with grpc.aio.secure_channel(
            auth.target, client_credentials(ca, both.cert, both.key)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await whoami(channel)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == "missing or invalid credentials"

    agent = ca.client("agent-1")
    async with grpc.aio.secure_channel(
            auth.target, client_credentials(ca, agent.cert, agent.key)) as channel:
        assert await whoami(channel) == "agent-1 mtls reader"  # and the server keeps serving


async def test_a_client_ca_file_others_may_write_stops_start_up(make_auth_server,
                                                                 tmp_path) -> None:
    files = TestCA().server_files(tmp_path)
    files["tls_client_ca_file"].chmod(0o666)  # anyone could add a CA of their own to it

    with pytest.raises(AuthConfigError, match="writable by every user"):
        await make_auth_server(auth_registry(), **files)


def _der_length(size: int) -> bytes:
    if size < 0x80:
        return bytes([size])
    octets = size.to_bytes((size.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(octets)]) + octets


def _unreadable_cn_cert(ca: TestCA, issued_pem: bytes, readable: bytes) -> bytes:
    """``issued_pem`` with the bytes ``readable`` of its common name made invalid UTF-8,
    signed again by ``ca``: TLS verifies it, a parser of its subject refuses it."""
    original = x509.load_pem_x509_certificate(issued_pem)
    der = original.public_bytes(serialization.Encoding.DER)
    tbs = original.tbs_certificate_bytes
    after_tbs = der.index(tbs) + len(tbs)
    algorithm = der[after_tbs:after_tbs + 2 + der[after_tbs + 1]]  # a short SEQUENCE
    tbs = tbs.replace(readable, b"\xff\xfe" * (len(readable) // 2), 1)
    signature = ca._key.sign(tbs, ec.ECDSA(hashes.SHA256()))
    bits = b"\x03" + _der_length(len(signature) + 1) + b"\x00" + signature
    body = tbs + algorithm + bits
    der = b"\x30" + _der_length(len(body)) + body
    return (b"-----BEGIN CERTIFICATE-----\n" + base64.encodebytes(der)
            + b"-----END CERTIFICATE-----\n")


def test_a_certificate_subject_longer_than_a_principal_may_be_names_nobody() -> None:
    """No common name and many long attributes: the subject's RFC 4514 string would be
    the principal; past MAX_PRINCIPAL_CHARS it is refused rather than cut (cut, two
    subjects alike up to the cut would be one caller)."""
    ca = TestCA()
    units = [x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"{k:02d}" + "u" * 60)
             for k in range(4)]  # "OU=…" 65 characters each, joined by commas
    too_long, fits = x509.Name(units), x509.Name(units[:3])
    assert len(fits.rfc4514_string()) <= MAX_PRINCIPAL_CHARS < len(too_long.rfc4514_string())
    identity = CertificateIdentity({"*": ["reader"]})

    with pytest.raises(CredentialsRejected) as refused:
        identity.principal({"x509_pem_cert": [ca.issue(too_long, server=False).cert]})

    assert refused.value.cause == "certificate_subject_too_long"
    principal = identity.principal({"x509_pem_cert": [ca.issue(fits, server=False).cert]})
    assert principal is not None and principal.id == fits.rfc4514_string()


def test_a_certificate_whose_subject_does_not_read_names_nobody() -> None:
    """A certificate the CA signed whose common name is not UTF-8: grpc's own TLS client
    will not even present it (so this is the identity's reading alone), but whatever peer
    does present one is refused as any unknown credentials are, never with a traceback."""
    ca = TestCA()
    issued = ca.client("QQQQQQQQ")
    unreadable = _unreadable_cn_cert(ca, issued.cert, b"QQQQQQQQ")
    identity = CertificateIdentity({"*": ["reader"]})

    with pytest.raises(CredentialsRejected) as refused:
        identity.principal({"x509_pem_cert": [unreadable]})

    assert refused.value.cause == "certificate_unreadable"
    principal = identity.principal({"x509_pem_cert": [issued.cert]})
    assert principal is not None and principal.id == "QQQQQQQQ"
