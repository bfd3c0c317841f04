"""Client input at the HTTP boundary, shared by peerd, the model server and the router: whole JSON
bodies under a size limit, and bearer tokens compared in constant time. Every failure is a 4xx."""
from __future__ import annotations

import hmac
import json
import math

from aiohttp import web

READ_PIECE = 1024 * 1024


class BadInput(ValueError):
    """The client sent something unusable; ``status`` is the 4xx to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, however it arrives in pieces; the limit applies to the total."""
    if request.content_length is not None and request.content_length > limit:
        raise BadInput(f"body of {request.content_length} bytes is over the {limit}-byte limit", 413)
    parts, total = [], 0
    while piece := await request.content.read(READ_PIECE):
        total += len(piece)
        if total > limit:
            raise BadInput(f"body is over the {limit}-byte limit", 413)
        parts.append(piece)
    return b"".join(parts)


MAX_INT_DIGITS = 64         # sizes, counts and offsets fit in 20; Python refuses past 4,300 with a bare ValueError


def parse_json(raw: bytes | str):
    """Strict JSON: UTF-8 only (a UTF-16 or UTF-32 body, with or without a BOM, is refused), numbers
    that are finite and of sane length (no NaN/Infinity, no 1e999, no 5,000-digit integers: none can
    be sent back or used as a size), bounded nesting. Every refusal is a BadInput (a 400)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except RecursionError:
        raise BadInput("body is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"body is not valid JSON: {e}") from None


async def read_json(request: web.Request, limit: int):
    return parse_json(await read_body(request, limit))


def _no_constant(name: str):
    raise BadInput(f"{name} is not a number JSON allows")


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BadInput(f"an integer of {len(digits.lstrip('-'))} digits is over the {MAX_INT_DIGITS}-digit limit")
    return int(digits)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadInput(f"{text[:40]} is out of range for a number")
    return value


def bearer_ok(request: web.Request, token: str) -> bool:
    """True when the request carries ``Authorization: Bearer <token>``. Bytes are compared as sent
    (headers that are not valid UTF-8 are compared, not crashed on)."""
    got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def bearer_headers(token: str) -> dict:
    """The header a client sends with ``token`` (none when the token is empty: auth disabled)."""
    return {"Authorization": f"Bearer {token}"} if token else {}
