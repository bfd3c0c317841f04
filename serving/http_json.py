"""JSON request bodies and errors for the serving HTTP apps (4xx for every bad body, never 500)."""
from __future__ import annotations

import json

from aiohttp import web

from lib.http_input import BadInput, read_json

MAX_BODY = 1024 * 1024


def bad_request(message: str, status: int = 400) -> web.HTTPException:
    text = json.dumps({"error": message})
    if status == 413:
        return web.HTTPRequestEntityTooLarge(MAX_BODY, MAX_BODY + 1, text=text, content_type="application/json")
    return web.HTTPBadRequest(text=text, content_type="application/json")


async def json_object(request: web.Request) -> dict:
    try:
        b = await read_json(request, MAX_BODY)
    except BadInput as e:
        raise bad_request(str(e), e.status) from None
    if not isinstance(b, dict):
        raise bad_request("body must be a JSON object")
    return b
