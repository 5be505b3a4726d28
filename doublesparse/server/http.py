"""HTTP helpers shared by the routes: bounded body reading, server-sent events, ids."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from doublesparse.server.protocol import APIError


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes; refuse early on Content-Length and while streaming."""
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
