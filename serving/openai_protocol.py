"""The OpenAI API's completions and chat completions, as data: requests checked into one shape,
answers and stream chunks built from token ids and text. No I/O here; the router and the model server
speak HTTP around it.

Model names: a client asks for ``<model>`` (traffic split by the rollout's weights) or pins a version
with ``<model>@<version>`` (or the ``X-Weightcast-Version`` header); answers name the model the
client asked for and carry the version that answered in ``X-Model-Version``.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}\Z")
MAX_TOKENS = 1024
MAX_PROMPT_TOKENS = 8192
MAX_PROMPT_CHARS = 256 * 1024
MAX_MESSAGES = 256
ROLES = ("system", "user", "assistant", "tool", "developer")


class BadRequest(ValueError):
    """The client's request is malformed: a 400 with this message (OpenAI's error shape)."""


@dataclass
class Request:
    kind: str                                   # "completion" | "chat"
    model: str                                  # as the client named it (without a pinned version)
    version: str | None                         # pinned, or None: split by the weights
    prompt: str | None = None                   # completions: text ...
    prompt_ids: list[int] | None = None         # ... or token ids
    messages: list[dict] = field(default_factory=list)     # chat
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False                 # stream_options.include_usage: a last chunk with the counts

    def for_host(self, version: str) -> dict:
        """The body a model server gets: the same request, the version resolved."""
        out = {"model": self.model, "model_version": version, "max_tokens": self.max_tokens,
               "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
               "stream_options": {"include_usage": self.include_usage}}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.kind == "chat":
            out["messages"] = self.messages
        elif self.prompt_ids is not None:
            out["prompt"] = self.prompt_ids
        else:
            out["prompt"] = self.prompt
        return out


def _number(b: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = b.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (low < v if low_open else low <= v) or v > high:
        raise BadRequest(f"{key} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}")
    return float(v)


def split_model(name, pinned_header: str | None = None) -> tuple[str, str | None]:
    """``m`` or ``m@v`` (or the header) → (model, pinned version or None)."""
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required: the name of a model this router serves (GET /v1/models)")
    model, _, version = name.partition("@")
    version = version or pinned_header or None
    for what, v in (("model", model), ("version", version)):
        if v is not None and not NAME.match(v):
            raise BadRequest(f"{what} {v!r} must be 1-128 letters, digits, '.', '_' or '-'")
    return model, version


def parse(kind: str, b, pinned_header: str | None = None) -> Request:
    """A completions (``kind="completion"``) or chat completions body, checked; raises BadRequest."""
    if not isinstance(b, dict):
        raise BadRequest("the body must be a JSON object")
    model, version = split_model(b.get("model"), pinned_header)
    n = b.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n must be 1 (one choice per request)")
    max_tokens = b.get("max_completion_tokens", b.get("max_tokens", 16))
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS:
        raise BadRequest(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {max_tokens!r}")
    seed = b.get("seed")
    if seed is not None and type(seed) is not int:
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    stream = b.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    opts = b.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object")
    req = Request(kind, model, version, max_tokens=max_tokens, seed=seed, stream=stream,
                  temperature=_number(b, "temperature", 1.0, 0, 2), top_p=_number(b, "top_p", 1.0, 0, 1, True),
                  include_usage=bool(opts.get("include_usage", False)))
    if kind == "chat":
        msgs = b.get("messages")
        if not isinstance(msgs, list) or not 1 <= len(msgs) <= MAX_MESSAGES:
            raise BadRequest(f"messages must be a list of 1-{MAX_MESSAGES} {{role, content}} objects")
        total = 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] must be {{role: one of {', '.join(ROLES)}, content: text}}")
            total += len(m["content"])
        if total > MAX_PROMPT_CHARS:
            raise BadRequest(f"the messages hold {total} characters, over {MAX_PROMPT_CHARS}")
        req.messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        return req
    prompt = b.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str) and 0 < len(prompt) <= MAX_PROMPT_CHARS:
        req.prompt = prompt
    elif (isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPT_TOKENS
          and all(type(t) is int and t >= 0 for t in prompt)):
        req.prompt_ids = prompt
    else:
        raise BadRequest(f"prompt must be text (1-{MAX_PROMPT_CHARS} characters) or a list of 1-{MAX_PROMPT_TOKENS} "
                         "token ids (one prompt per request)")
    return req


# ---------------------------------------------------------------- answers

def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def answer(req: Request, rid: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole (non-streamed) answer."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(req: Request, rid: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    """One stream chunk: a piece of text, or (``finish``) the end of the choice."""
    if req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [choice]}


def usage_chunk(req: Request, rid: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: dict | None) -> bytes:
    """One server-sent event: a JSON object, or (None) the end of the stream."""
    return b"data: [DONE]\n\n" if obj is None else b"data: " + json.dumps(obj).encode() + b"\n\n"


def error(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
