"""``stargrpc health``: ask a server's gRPC health service (for container health checks)."""

from __future__ import annotations

import sys

import click
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@click.command()
@click.option("--target", envvar="STARGRPC_TARGET", default="localhost:50051",
              show_default=True, help="Server address [env STARGRPC_TARGET].")
@click.option("--service", default="", help="Service name; empty asks about the server.")
@click.option("--timeout", type=float, default=3.0, show_default=True)
def health(target: str, service: str, timeout: float) -> None:
    """Exit 0 when the server reports SERVING, 1 otherwise."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNAVAILABLE"
            click.echo(f"unhealthy: {code}", err=True)
            sys.exit(1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    click.echo(status)
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
