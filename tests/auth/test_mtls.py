"""TLS serving and mTLS principals, with certificates made in the test."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from stargrpc.errors import AuthConfigError
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
