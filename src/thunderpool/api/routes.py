"""The OpenAI-compatible HTTP API over the served models (one EngineClient, or a registry of
several: api/models.py): completions, models, health, metrics.

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

from thunderpool.api import (
    anthropic,
    ollama,
    ollama_wire,
    openai_chat,
    openai_text,
    openapi,
    prompts,
    responses,
)
from thunderpool.api.conversation import Conversation, admit
from thunderpool.api.errors import APIError, install_error_handlers
from thunderpool.api.history import EVERY_S, History
from thunderpool.api.limits import DEFAULT_PER_KEY, PerKeyLimit
from thunderpool.api.metrics import CONTENT_TYPE, HTTPCounter, render
from thunderpool.api.models import RETRY_HEADERS, One, Served, health, instance
from thunderpool.api.observe import AccessLog, Latencies
from thunderpool.api.origin import HostGuard
from thunderpool.api.schemas import ChatRequest, CompletionRequest, ModelCard, ModelList
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.api.turns import collect_turns
from thunderpool.api.wire import parse
from thunderpool.engine.service import EngineClient, ModelRegistry

log = logging.getLogger("thunderpool.api")
# The other APIs' bodies and errors, for /openapi.json.
WIRE_MODELS = (
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    anthropic.AnthropicError,
    ollama_wire.OllamaChatRequest,
    ollama_wire.OllamaGenerateRequest,
    ollama_wire.ShowRequest,
    ollama_wire.PullRequest,
    ollama_wire.OllamaError,
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
    engine: EngineClient | ModelRegistry,
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
    registry = engine if hasattr(engine, "acquire") else One(engine)  # type: ignore[arg-type]
    served = Served(registry, latencies, log_prompts)  # type: ignore[arg-type]
    history = History(served.metrics, latencies)

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

    _mount_openai(app, served, guarded, doc)
    _mount_status(app, served, guarded, doc, history, latencies, http_counts)
    anthropic.mount(app, served, require_key, api_key is not None)
    ollama.mount(app, served, require_key, api_key is not None)
    responses.mount(app, served, guarded, api_key is not None)
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


def _mount_openai(app: FastAPI, served: Served, guarded: list, doc) -> None:
    """/v1/chat/completions and /v1/completions: each request a Conversation, rendered by
    openai_chat.py or openai_text.py."""
    generating = (400, 404, 429, 503)  # what a completion answers besides 200 (and 401)
    hello = {"model": served.names()[0], "max_tokens": 16}  # the documented examples' start

    async def answer(request: Request, name: str, conv: Conversation, prefix: str, api):
        """An OpenAI answer (chat or text, `api`'s renderers) of the conversation's choices:
        streamed, or collected while watching for the client's disconnect."""
        engine = await served.acquire(name)
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
        name = prompts.check_model(req.model, served.names())
        prompts.check_supported(req)
        conv = openai_chat.to_conversation(req)
        return await answer(request, name, conv, "chatcmpl-", openai_chat)

    @app.post(
        "/v1/completions",
        dependencies=guarded,
        **doc(openapi.COMPLETION, generating, CompletionRequest, {**hello, "prompt": "Hello"}),
    )
    async def completions(request: Request) -> Response:
        req = await parse(request, CompletionRequest)
        name = prompts.check_model(req.model, served.names())
        prompts.check_supported(req)
        return await answer(request, name, openai_text.to_conversation(req), "cmpl-", openai_text)


def _mount_status(
    app: FastAPI,
    served: Served,
    guarded: list,
    doc,
    history: History,
    latencies: Latencies,
    http_counts: Counter,
) -> None:
    """The model list, the cluster, health, /metrics and the dashboard's history."""

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=served.client(name).info.created)

    @app.get("/v1/models", dependencies=guarded, **doc({"model": ModelList}))
    async def models() -> dict:
        return ModelList(data=[card(n) for n in served.names()]).model_dump(mode="json")

    @app.get("/v1/models/{model:path}", dependencies=guarded, **doc({"model": ModelCard}, (404,)))
    async def model(model: str) -> dict:
        return card(prompts.check_model(model, served.names())).model_dump(mode="json")

    @app.get("/v1/cluster", dependencies=guarded, **doc(openapi.CLUSTER))
    async def cluster() -> JSONResponse:
        """The (first) model's cluster as ever; with several models, each one's instance."""
        entries = served.entries()
        if len(entries) == 1:
            return JSONResponse(served.default.info.cluster)
        lines = [instance(e, served.registry.client(e.name).metrics()) for e in entries]
        return JSONResponse({**served.default.info.cluster, "instances": lines})

    @app.get("/health", **openapi.HEALTH)
    async def health_check() -> JSONResponse:
        body, status = health(served)
        return JSONResponse(body, status, headers=None if status == 200 else RETRY_HEADERS)

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse, **doc({}))
    async def metrics() -> PlainTextResponse:
        text = render(served.metrics(), http_counts, latencies.all())
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
