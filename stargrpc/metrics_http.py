"""The Prometheus scrape endpoint: ``GET /metrics`` on ``serve --metrics-port``.

It serves :data:`stargrpc.metrics.REGISTRY` (under ``--workers``, the sum over the worker
processes: :func:`stargrpc.metrics.scrape_registry`) in the text format, or in OpenMetrics when the
scraper asks for it. It is a port of its own (not the gateway's) so that operators can keep
it off the public network.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stargrpc.metrics import scrape_registry


def metrics_app(registry: CollectorRegistry | None = None) -> Starlette:
    """An ASGI app serving ``registry`` (default :func:`~stargrpc.metrics.scrape_registry`)
    at ``/metrics`` (everything else is 404)."""
    if registry is None:
        registry = scrape_registry()

    async def scrape(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type,
                        headers={"Cache-Control": "no-store"})

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])])
