"""HTTP helpers shared by the routes: bounded body reading, server-sent events, ids."""

from __future__ import annotations

import email.message
import json
import re
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from doublesparse.server.protocol import APIError


# "[05:46:02] /project/cpp/json_schema_converter.cc:5082: " before every line of xgrammar's errors
_CPP_PREFIX = re.compile(r"(\[\d{2}:\d{2}:\d{2}\] )?(\S*/)?[\w.-]+\.(cc|cpp|cxx|h|hpp):\d+: ")


def client_message(e: BaseException) -> str:
    """An exception's text for a client: without the time and C++ source path that native
    libraries (xgrammar) put in front of their messages."""
    return _CPP_PREFIX.sub("", str(e)).strip()


def check_json_body(request: Request) -> None:
    """Bodies are JSON: refuse another declared media type with 415 rather than guess. Only
    ``application/json`` and ``application/*+json`` are read as JSON, as FastAPI (which vLLM and
    SGLang serve through) reads them; ``text/plain`` (what a web page can post without a CORS
    preflight) is not. A body without the header is read as JSON, as FastAPI does with
    ``strict_content_type=False`` (its newest versions refuse it by default): clients that post a
    JSON string without one, ``requests.post(url, data=json.dumps(body))``, keep working."""
    declared = request.headers.get("content-type")
    if not declared:
        return
    m = email.message.Message()
    m["content-type"] = declared
    sub = m.get_content_subtype()
    if m.get_content_maintype() != "application" or not (sub == "json" or sub.endswith("+json")):
        raise APIError(f"Content-Type '{declared}' is not supported: send the body as JSON with "
                       "'Content-Type: application/json'", status=415,
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes of a JSON body; refuse early on Content-Length and while
    streaming, and a body declared as something else than JSON (415)."""
    check_json_body(request)
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise APIError("invalid Content-Length header") from None
    too_big = APIError(f"request body exceeds the {limit}-byte limit", status=413,
                       code="request_too_large")
    if declared > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stream_response(gen) -> StreamingResponse:
    # X-Accel-Buffering: proxies must not hold back tokens.
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
