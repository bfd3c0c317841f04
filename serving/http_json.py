"""JSON request bodies and errors for the serving HTTP apps."""
from __future__ import annotations

import json

from aiohttp import web


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


async def json_object(request: web.Request) -> dict:
    try:
        b = await request.json()
    except ValueError:
        raise bad_request("body is not valid JSON") from None
    if not isinstance(b, dict):
        raise bad_request("body must be a JSON object")
    return b
