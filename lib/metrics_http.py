"""The ``GET /metrics`` endpoint every server exposes (peerd, the model server, the router)."""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def metrics_handler(registry: CollectorRegistry):
    """The ``GET /metrics`` handler for one registry (peerd, model server and router all serve one)."""
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
    return metrics
