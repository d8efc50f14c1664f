"""OpenAI-style error bodies, and the handlers that make every failure one of them.

Nothing reaches the client as a traceback: unexpected exceptions are logged here and answered
with a plain 500 body.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from thunderpool.api.schemas import ErrorBody, ErrorDetail

log = logging.getLogger("thunderpool.api")

RETRY_AFTER_S = 5


class APIError(Exception):
    """An error the client caused or can wait out; rendered as OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def detail(self) -> ErrorDetail:
        return ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        body = ErrorBody(error=self.detail()).model_dump(mode="json")
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_ready(state: str, detail: str) -> APIError:
    why = f": {detail}" if detail else ""
    return APIError(
        503,
        f"the model is not ready (state {state}{why}); retry in {RETRY_AFTER_S} s",
        type="server_error",
        code="model_not_ready",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def from_validation(err: ValidationError) -> APIError:
    """The first problem, named by its dotted field path; bad JSON is its own message."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON: {first['msg']}", code="json_invalid"
        )
    loc = ".".join(str(p) for p in first["loc"] if p != "body")
    if not loc:
        return bad_request(f"the request body must be a JSON object: {first['msg']}")
    given = json.dumps(first.get("input"), default=str)
    if len(given) > 60:
        given = given[:57] + "..."
    if first["type"] == "extra_forbidden":
        return bad_request(
            f"'{loc}' is not supported by this server; remove it", param=loc, code="unsupported"
        )
    message = f"invalid '{loc}': {first['msg']}"
    if first["type"] != "missing":
        message += f" (got {given})"
    return bad_request(message, param=loc, code="invalid_type")


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = (exc.errors() or [{"loc": (), "msg": "invalid request"}])[0]
    loc = ".".join(str(p) for p in first["loc"] if p not in ("body", "query", "path"))
    return bad_request(f"invalid '{loc}': {first['msg']}", param=loc or None).response()


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    # Keep the handler's headers: a 405 must say which methods are allowed (Allow).
    headers = dict(exc.headers or {})
    return APIError(exc.status_code, str(exc.detail), kind, code=code, headers=headers).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_middleware(CatchAll)


class CatchAll:
    """Answers an unhandled exception with a 500 OpenAI body (no traceback) and logs it.

    Starlette's own Exception handler re-raises after responding; this one does not, so the
    server's log gets one entry from us and the client never sees a stack.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                return  # a stream already began; all we can do is end it
            err = APIError(500, "internal server error; see the server log", "server_error")
            await err.response()(scope, receive, send)
