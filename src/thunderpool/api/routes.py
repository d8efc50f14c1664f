"""The OpenAI-compatible HTTP API over one EngineClient: completions, models, health, metrics.

Request bodies are parsed here rather than by FastAPI, so malformed JSON and wrong types are
OpenAI-style 400s (not FastAPI's 422) and auth is checked before the body is read.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from anyio import to_thread
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError

from thunderpool.api import openapi, prompts, structured
from thunderpool.api.body import API_LIMIT, BodyError, read_body
from thunderpool.api.errors import RETRY_AFTER_S, APIError, from_validation, install_error_handlers
from thunderpool.api.errors import not_ready as not_ready_error
from thunderpool.api.generation import (
    ChatFrames,
    CompletionFrames,
    Job,
    Outcome,
    chat_body,
    collect_all,
    completion_body,
    stream,
)
from thunderpool.api.metrics import CONTENT_TYPE, HTTPCounter, render
from thunderpool.api.schemas import ChatRequest, CompletionRequest, ModelCard, ModelList
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import EngineClient

R = TypeVar("R", bound=BaseModel)
log = logging.getLogger("thunderpool.api")

# nginx's "client closed request": counted in /metrics, never seen by the client.
CLIENT_CLOSED = 499


def api_key_guard(api_key: str | None) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode()

    def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return require_key


async def _parse(request: Request, model: type[R]) -> R:
    try:
        body = await read_body(request, API_LIMIT, log)
    except BodyError as e:
        raise APIError(e.status, e.message) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation(e) from e


def create_app(engine: EngineClient, api_key: str | None = None) -> FastAPI:
    """The API app. `api_key` guards /v1/* and /metrics; /health (and `/`) stay open."""
    app = FastAPI(title="thunderpool", docs_url=None, redoc_url=None)
    guarded = [Depends(api_key_guard(api_key))]
    doc = partial(openapi.route, guarded=api_key is not None)
    generating = (400, 404, 503)  # what a completion answers besides 200 (and 401)
    hello = {"model": engine.info.model, "max_tokens": 16}  # the documented examples' start
    http_counts: Counter[tuple[str, int]] = Counter()

    def ready() -> None:
        s = engine.status()
        if s.state != "ready":
            raise not_ready_error(s.state, s.detail)

    def new_job(
        prefix: str, req: ChatRequest | CompletionRequest, prompt: list[int], params: SamplingParams
    ) -> Job:
        include = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        tokenizer = engine.tokenizer
        return Job(
            id=f"{prefix}-{uuid.uuid4().hex[:24]}",
            created=int(time.time()),
            model=engine.info.model,
            prompt=prompt,
            params=params,
            include_usage=include,
            n=structured.check_n(req),
            tool_call=isinstance(req, ChatRequest) and structured.forced_tools(req) is not None,
            token_text=lambda t: tokenizer.decode([t]),
        )

    async def answer(
        request: Request,
        job: Job,
        frames: ChatFrames | CompletionFrames | None,
        body: Callable[[Job, list[Outcome]], BaseModel],
    ) -> Response:
        # Streams watch for the disconnect inside EventStream; a collected answer does it here.
        # n choices are n requests on the same prompt (a prefix cache makes them share it).
        streams = [
            engine.generate(job.prompt, job.choice_params(i), replayable=frames is None)
            for i in range(job.n)
        ]
        if frames is not None:
            return EventStream(stream(streams, job, frames))
        out = await until_disconnect(request.receive, lambda: collect_all(streams, job))
        if out is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body(job, out).model_dump(mode="json"))

    @app.post(
        "/v1/chat/completions",
        dependencies=guarded,
        **doc(
            openapi.CHAT,
            generating,
            ChatRequest,
            {**hello, "messages": [{"role": "user", "content": "Hello"}]},
        ),
    )
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatRequest)
        prompts.check_model(req.model, engine.info.model)
        prompts.check_supported(req)
        messages = prompts.chat_messages(req.messages)
        ready()
        ids = await to_thread.run_sync(prompts.chat_prompt, engine.tokenizer, messages)
        limit = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        params = prompts.sampling_params(req, limit, len(ids), engine.info.max_context, "messages")
        job = new_job("chatcmpl", req, ids, params)
        return await answer(request, job, ChatFrames(job) if req.stream else None, chat_body)

    @app.post(
        "/v1/completions",
        dependencies=guarded,
        **doc(openapi.COMPLETION, generating, CompletionRequest, {**hello, "prompt": "Hello"}),
    )
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        prompts.check_model(req.model, engine.info.model)
        prompts.check_supported(req)
        ready()
        ids = await to_thread.run_sync(prompts.completion_prompt, engine.tokenizer, req.prompt)
        n = len(ids)
        params = prompts.sampling_params(req, req.max_tokens, n, engine.info.max_context, "prompt")
        job = new_job("cmpl", req, ids, params)
        frames = CompletionFrames(job) if req.stream else None
        return await answer(request, job, frames, completion_body)

    def card() -> ModelCard:
        return ModelCard(id=engine.info.model, created=engine.info.created)

    @app.get("/v1/models", dependencies=guarded, **doc({"model": ModelList}))
    async def models() -> dict:
        return ModelList(data=[card()]).model_dump(mode="json")

    @app.get("/v1/models/{model:path}", dependencies=guarded, **doc({"model": ModelCard}, (404,)))
    async def model(model: str) -> dict:
        prompts.check_model(model, engine.info.model)
        return card().model_dump(mode="json")

    @app.get("/v1/cluster", dependencies=guarded, **doc(openapi.CLUSTER))
    async def cluster() -> JSONResponse:
        return JSONResponse(engine.info.cluster)

    @app.get("/health", **openapi.HEALTH)
    async def health() -> JSONResponse:
        s = engine.status()
        if s.state == "ready":
            return JSONResponse({"status": "ok"})
        body = {"status": s.state, "progress": round(s.progress, 4), "detail": s.detail}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse, **doc({}))
    async def metrics() -> PlainTextResponse:
        text = render(engine.metrics(), http_counts)
        return PlainTextResponse(text, headers={"Content-Type": CONTENT_TYPE})

    openapi.install(app, api_key is not None)
    install_error_handlers(app)
    # "/" is the dashboard's, mounted by the caller after this returns.
    known = frozenset(r.path for r in app.routes if "{" not in getattr(r, "path", "{")) | {"/"}
    app.add_middleware(HTTPCounter, known=known, counts=http_counts)
    return app
