"""``stargrpc health``: ask a server's gRPC health service (for container health checks)."""

from __future__ import annotations

import sys
from typing import Any

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stargrpc.cli.client_commands import Seconds, connection_options
from stargrpc.client.channel import bearer_metadata, channel_credentials


@click.command()
@connection_options
@click.option("--service", default="", help="Service name; empty asks about the server.")
@click.option("--timeout", type=Seconds(), default=3.0, show_default=True)
def health(client_options: dict[str, Any], service: str, timeout: float) -> None:
    """Exit 0 when the server reports SERVING, 1 otherwise."""
    target = client_options["target"]
    if client_options["tls"] or client_options["ca_file"] or client_options["cert_file"]:
        credentials = channel_credentials(ca_file=client_options["ca_file"],
                                          cert_file=client_options["cert_file"],
                                          key_file=client_options["key_file"])
        channel = grpc.secure_channel(target, credentials)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                metadata=bearer_metadata(client_options["api_key"]))
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNAVAILABLE"
            click.echo(f"unhealthy: {code}", err=True)
            sys.exit(1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    click.echo(status)
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
