"""Server-sent events that stop when the client goes away, and always close their source.

Starlette's StreamingResponse neither watches for a disconnect under every ASGI spec version
nor closes its iterator when cancelled; a generation left open keeps its seat in the batch.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def event(payload: str) -> bytes:
    """One SSE event; JSON payloads never contain raw newlines, so one `data:` line suffices."""
    return f"data: {payload}\n\n".encode()


async def close_quietly(it: AsyncIterator) -> None:
    """Close an async iterator even from inside a cancelled scope (closing is what cancels)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then returns None).

    `work`'s own exception is re-raised as is, not wrapped in the task group's ExceptionGroup.
    """
    result: T | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await _wait_disconnect(receive)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await work()
        except Exception as e:
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class EventStream(Response):
    """Sends `events` as `text/event-stream`; a disconnect or send failure stops and closes it."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def pump() -> None:
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client went away mid-send (ASGI 2.4 servers report it this way)

        try:
            await until_disconnect(receive, pump)
        finally:
            await close_quietly(self.events)
