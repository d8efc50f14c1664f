"""The OpenAI-compatible HTTP API over one EngineClient: completions, models, health, metrics.

Request bodies are parsed here rather than by FastAPI, so malformed JSON and wrong types are
OpenAI-style 400s (not FastAPI's 422) and auth is checked before the body is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial

from fastapi import Depends, FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from thunderpool.api import anthropic, ollama, openai_chat, openai_text, openapi, prompts, responses
from thunderpool.api.conversation import Conversation, admit
from thunderpool.api.errors import RETRY_AFTER_S, APIError, install_error_handlers
from thunderpool.api.history import EVERY_S, History
from thunderpool.api.limits import DEFAULT_PER_KEY, PerKeyLimit
from thunderpool.api.metrics import CONTENT_TYPE, HTTPCounter, render
from thunderpool.api.observe import AccessLog, Latencies, RecordingEngine
from thunderpool.api.origin import HostGuard
from thunderpool.api.schemas import ChatRequest, CompletionRequest, ModelCard, ModelList
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.api.turns import collect_turns
from thunderpool.api.wire import parse
from thunderpool.engine.service import EngineClient

log = logging.getLogger("thunderpool.api")
# The other APIs' bodies and errors, for /openapi.json.
WIRE_MODELS = (
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    anthropic.AnthropicError,
    ollama.OllamaChatRequest,
    ollama.OllamaGenerateRequest,
    ollama.ShowRequest,
    ollama.OllamaError,
    responses.ResponsesRequest,
)

# nginx's "client closed request": counted in /metrics, never seen by the client.
CLIENT_CLOSED = 499


def api_key_guard(api_key: str | None) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode()

    def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        # Anthropic's clients send the key as `x-api-key`.
        other = f"Bearer {request.headers.get('x-api-key', '')}".encode()
        if not (hmac.compare_digest(given, expected) or hmac.compare_digest(other, expected)):
            raise APIError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return require_key


def create_app(
    engine: EngineClient,
    api_key: str | None = None,
    *,
    log_prompts: bool = False,
    cors_origins: Sequence[str] = (),
    bind_host: str | None = None,
    allowed_hosts: Sequence[str] = (),
    max_concurrent_per_key: int = DEFAULT_PER_KEY,
) -> FastAPI:
    """The API app. `api_key` guards /v1/*, /api/* and /metrics; /health (and `/`) stay open.
    `log_prompts` adds each prompt's text to its access-log line; `cors_origins`: browser
    origins allowed to call it (none by default). With `bind_host` (the address it listens
    on), foreign Host names and other sites' POSTs are refused (api/origin.py), but for
    `allowed_hosts`. A client may have `max_concurrent_per_key` generations running (429s
    past it; api/limits.py)."""
    latencies = Latencies()
    engine = RecordingEngine(engine, latencies, log_prompts)  # type: ignore[assignment]
    history = History(engine.metrics, latencies)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        sampler = asyncio.get_running_loop().create_task(history.run())
        yield
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler

    app = FastAPI(title="thunderpool", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.history = history
    require_key = api_key_guard(api_key)
    guarded = [Depends(require_key)]
    doc = partial(openapi.route, guarded=api_key is not None)
    http_counts: Counter[tuple[str, int]] = Counter()

    _mount_openai(app, engine, guarded, doc)
    _mount_status(app, engine, guarded, doc, history, latencies, http_counts)
    anthropic.mount(app, engine, require_key, api_key is not None)
    ollama.mount(app, engine, require_key, api_key is not None)
    responses.mount(app, engine, guarded, api_key is not None)
    openapi.install(app, api_key is not None, WIRE_MODELS)
    install_error_handlers(app)
    # "/" is the dashboard's, mounted by the caller after this returns.
    known = frozenset(r.path for r in app.routes if "{" not in getattr(r, "path", "{")) | {"/"}
    app.add_middleware(PerKeyLimit, per_key=max_concurrent_per_key)
    app.add_middleware(HTTPCounter, known=known, counts=http_counts)
    app.add_middleware(AccessLog)
    if cors_origins:
        # Outermost, so a preflight is answered before the key or the route is looked at.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
        )
    if bind_host is not None:  # outermost: nothing else sees a request it refuses
        app.add_middleware(
            HostGuard, bind=bind_host, allowed=allowed_hosts, cors_origins=cors_origins
        )
    return app


def _mount_openai(app: FastAPI, engine: EngineClient, guarded: list, doc) -> None:
    """/v1/chat/completions and /v1/completions: each request a Conversation, rendered by
    openai_chat.py or openai_text.py."""
    generating = (400, 404, 429, 503)  # what a completion answers besides 200 (and 401)
    hello = {"model": engine.info.model, "max_tokens": 16}  # the documented examples' start

    async def answer(request: Request, conv: Conversation, prefix: str, api) -> Response:
        """An OpenAI answer (chat or text, `api`'s renderers) of the conversation's choices:
        streamed, or collected while watching for the client's disconnect."""
        admitted = await admit(engine, conv, prefix)
        if conv.stream:
            options = conv.sampling.stream_options
            include = bool(options and options.include_usage)
            continuous = include and options.continuous_usage_stats  # as vLLM: both asked
            return EventStream(api.chunks(engine, admitted, include, continuous))
        turns = await until_disconnect(request.receive, lambda: collect_turns(engine, admitted))
        if turns is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(api.body(admitted, turns).model_dump(mode="json"))

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
        req = await parse(request, ChatRequest)
        prompts.check_model(req.model, engine.info.model)
        prompts.check_supported(req)
        return await answer(request, openai_chat.to_conversation(req), "chatcmpl-", openai_chat)

    @app.post(
        "/v1/completions",
        dependencies=guarded,
        **doc(openapi.COMPLETION, generating, CompletionRequest, {**hello, "prompt": "Hello"}),
    )
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        prompts.check_model(req.model, engine.info.model)
        prompts.check_supported(req)
        return await answer(request, openai_text.to_conversation(req), "cmpl-", openai_text)


def _mount_status(
    app: FastAPI,
    engine: EngineClient,
    guarded: list,
    doc,
    history: History,
    latencies: Latencies,
    http_counts: Counter,
) -> None:
    """The model list, the cluster, health, /metrics and the dashboard's history."""

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
        if s.fetch:  # weights moving over the fabric: each node's bytes, rate and ETA
            body["fetch"] = list(s.fetch)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse, **doc({}))
    async def metrics() -> PlainTextResponse:
        text = render(engine.metrics(), http_counts, latencies.all())
        return PlainTextResponse(text, headers={"Content-Type": CONTENT_TYPE})

    @app.get("/v1/stats/history", dependencies=guarded, **doc(openapi.HISTORY, (400,)))
    async def stats_history(request: Request) -> JSONResponse:
        since = request.query_params.get("since")
        try:
            t = None if since is None else float(since)
        except ValueError:
            t = math.nan
        if t is not None and not math.isfinite(t):
            raise APIError(400, f"since={since!r} is not a time; give unix seconds", param="since")
        if not history.points or time.time() - history.points[-1]["t"] >= EVERY_S:
            history.sample()  # no sampler runs without a lifespan (tests), or it lags
        return JSONResponse({"every_s": EVERY_S, "points": history.since(t)})
