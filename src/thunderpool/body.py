"""Reading a request body with a size limit, for the API and the node agent.

A body larger than the limit is refused before it is read (413); a client that hangs up
halfway is one warning line, not a traceback. Nothing buffers more than the limit.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request

API_LIMIT = 16 << 20  # a 128k-token prompt is well under 1 MB of JSON
AGENT_LIMIT = 4 << 20  # control messages are a few KB


class BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Request, limit: int, log: logging.Logger) -> bytes:
    """The whole body, or BodyError(413) past `limit`, or BodyError(400) if the client left."""
    client = request.client.host if request.client else "?"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        log.warning("refused a %s-byte body from %s (limit %d)", declared, client, limit)
        raise BodyError(413, f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                log.warning("refused a body over %d bytes from %s", limit, client)
                raise BodyError(413, f"request body is over the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        log.warning("%s hung up after %d bytes of its request body", client, size)
        raise BodyError(400, "the client closed the connection mid-body") from None
    return b"".join(chunks)
