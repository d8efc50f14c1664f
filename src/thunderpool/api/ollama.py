"""Ollama's API (`/api/chat`, `/api/generate`; the model endpoints are ollama_models.py's) over
the shared Conversation, streamed as NDJSON (Ollama's default) or collected. `keep_alive` sets
how long the model stays loaded once idle (ollama_models.keep_alive).

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9); `options` it does not
honour (mirostat, num_gpu, ...) are 400s naming them. Errors are `{"error": "..."}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from thunderpool.api import ollama_models, openapi
from thunderpool.api.conversation import Admitted, Conversation, Finish, admit
from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.models import Served
from thunderpool.api.ollama_models import check_model, keep_alive
from thunderpool.api.ollama_wire import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaError,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaOptions,
    _Generating,
)
from thunderpool.api.schemas import SamplingFields
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.api.tools import Call, Text, function_tool
from thunderpool.api.turns import collect_turn, turn
from thunderpool.api.wire import parse
from thunderpool.engine.service import EngineClient

CLIENT_CLOSED = 499
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's own


def error_response(e: APIError) -> JSONResponse:
    body = OllamaError(error=e.message).model_dump(mode="json")
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def _refuse(req: _Generating, **unsupported: Any) -> None:
    for name, value in {"format": req.format, "think": req.think, **unsupported}.items():
        # Unset: null, false, "" or [] (schema_limits.FALSY says the same); 0 or {} is a value.
        if not (value is None or value is False or value == "" or value == []):
            raise bad_request(f"'{name}' is not supported by this server; remove it", name)


def _sampling(req: _Generating) -> tuple[SamplingFields, int | None]:
    o = req.options or OllamaOptions()
    predict = o.num_predict
    fields = SamplingFields(
        model=req.model,
        max_tokens=predict if predict is not None and predict > 0 else None,
        temperature=DEFAULTS["temperature"] if o.temperature is None else o.temperature,
        top_p=DEFAULTS["top_p"] if o.top_p is None else o.top_p,
        top_k=DEFAULTS["top_k"] if o.top_k is None else o.top_k,
        seed=o.seed,
        stop=o.stop,
    )
    # Checked here, not only when sampling starts: a preload (no prompt) answers too.
    for bad, why in (
        (fields.temperature < 0, f"temperature={fields.temperature} must be >= 0"),
        (not 0 < fields.top_p <= 1, f"top_p={fields.top_p} must be in (0, 1]"),
        (fields.top_k < 0, f"top_k={fields.top_k} must be >= 0"),
    ):
        if bad:
            raise bad_request(f"options.{why}", "options." + why.split("=")[0])
    if (isinstance(o.stop, list) and not all(o.stop)) or o.stop == "":
        raise bad_request("options.stop strings must not be empty", "options.stop")
    if o.num_ctx is not None and o.num_ctx < 1:
        raise bad_request(
            f"options.num_ctx={o.num_ctx} must be a positive integer", "options.num_ctx"
        )
    return fields, o.num_ctx


def _tools(raw: list[Any] | None) -> tuple[dict[str, Any], ...]:
    out = []
    for i, t in enumerate(raw or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function":
            raise bad_request(f"tools.{i}: only function tools are supported", f"tools.{i}")
        out.append(
            function_tool(f.get("name"), f.get("description"), f.get("parameters"), f"tools.{i}")
        )
    return tuple(out)


def chat_conversation(req: OllamaChatRequest) -> Conversation:
    _refuse(req)
    messages = []
    for i, m in enumerate(req.messages or []):
        if m.images:
            raise bad_request(
                f"'messages.{i}.images': images are not supported", f"messages.{i}.images"
            )
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": c.function.model_dump(exclude={"index"}),
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.tool_name is not None:
            msg["name"] = m.tool_name
        messages.append(msg)
    fields, ctx = _sampling(req)
    return Conversation(
        tuple(messages), fields, _tools(req.tools), stream=req.stream is not False, context=ctx
    )


def generate_conversation(req: OllamaGenerateRequest) -> Conversation:
    _refuse(req, suffix=req.suffix, template=req.template, context=req.context, images=req.images)
    fields, ctx = _sampling(req)
    stream = req.stream is not False
    if req.raw:
        return Conversation(
            (), fields, raw=req.prompt or "", stream=stream, context=ctx, prompt_field="prompt"
        )
    messages = [{"role": "system", "content": req.system}] if req.system else []
    messages.append({"role": "user", "content": req.prompt or ""})
    return Conversation(tuple(messages), fields, stream=stream, context=ctx, prompt_field="prompt")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _calls(calls: list[Call] | tuple[Call, ...]) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.input}} for c in calls]


class Clock:
    """Ollama's nanosecond timings: total, loading the model (a request that loaded it on
    demand), prompt evaluation (to the first event), generation."""

    def __init__(self, start: int | None = None):
        self.start = self.loaded = start or time.monotonic_ns()
        self.first: int | None = None

    def load_done(self) -> None:
        self.loaded = time.monotonic_ns()

    def tick(self) -> None:
        self.first = self.first or time.monotonic_ns()

    def stats(self, f: Finish) -> dict[str, Any]:
        now = time.monotonic_ns()
        first = self.first or now
        return {
            "done_reason": "length" if f.reason == "length" else "stop",
            "total_duration": now - self.start,
            "load_duration": self.loaded - self.start,
            "prompt_eval_count": f.prompt_tokens,
            "prompt_eval_duration": first - self.loaded,
            "eval_count": f.completion_tokens,
            "eval_duration": now - first,
        }


class NDJSONStream(EventStream):
    media_type = "application/x-ndjson"


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def lines(
    engine: EngineClient, a: Admitted, chat: bool, clock: Clock | None = None
) -> AsyncGenerator[bytes, None]:
    clock, head = clock or Clock(), {"model": a.job.model}

    def piece(text: str, calls: list[Call] | None = None) -> dict[str, Any]:
        if not chat:
            return {**head, "created_at": _now(), "response": text}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = _calls(calls)
        return {**head, "created_at": _now(), "message": message}

    try:
        async for ev in turn(engine, a):
            clock.tick()
            match ev:
                case Text() if ev.text:
                    yield _line({**piece(ev.text), "done": False})
                case Call():
                    yield _line({**piece("", [ev]), "done": False})
                case Finish():
                    yield _line({**piece(""), "done": True, **clock.stats(ev)})
    except APIError as e:
        yield _line({"error": e.message})


def mount(
    app: FastAPI, served: Served, require_key: Callable[[Request], None], keyed: bool
) -> None:

    def ollama_errors(handler: Callable[[Request], Awaitable[Response]]):
        async def wrapped(request: Request) -> Response:
            try:
                require_key(request)
                return await handler(request)
            except APIError as e:
                return error_response(e)

        return wrapped

    def doc(
        ok: dict[str, Any],
        body: type[BaseModel] | None = None,
        example: Any = None,
        errors=(400, 404, 503),
    ):
        return openapi.route(ok, errors, body, example, guarded=keyed, error="OllamaError")

    _mount_generation(app, served, ollama_errors, doc)
    ollama_models.mount(app, served, ollama_errors, doc)


def _mount_generation(app: FastAPI, served: Served, ollama_errors, doc) -> None:
    """/api/chat and /api/generate: NDJSON lines, or one body."""
    default = served.names()[0]

    async def answer(request: Request, req: _Generating, conv: Conversation, chat: bool):
        name = check_model(req.model, served.names())
        clock = Clock()
        engine = await served.acquire(name, keep_alive(req.keep_alive))
        clock.load_done()  # waited for a load only when the model was not loaded
        admitted = await admit(engine, conv, "ollama-")
        if conv.stream:
            return NDJSONStream(lines(engine, admitted, chat, clock))
        t = await until_disconnect(request.receive, lambda: collect_turn(engine, admitted))
        if t is None:
            return Response(status_code=CLIENT_CLOSED)
        clock.tick()
        body: dict[str, Any] = {"model": name, "created_at": _now()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": t.text}
            if t.calls:
                message["tool_calls"] = _calls(t.calls)
            body["message"] = message
        else:
            body["response"] = t.text
        return JSONResponse({**body, "done": True, **clock.stats(t.finish)})

    chat_example = {
        "model": default,
        "stream": False,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    chat_example["options"] = {"num_predict": 16}

    @app.post(
        "/api/chat",
        **doc(
            {"model": OllamaChatResponse, "content": openapi.ndjson()},
            OllamaChatRequest,
            chat_example,
            errors=(400, 404, 429, 503),
        ),
    )
    @ollama_errors
    async def chat(request: Request) -> Response:
        req = await parse(request, OllamaChatRequest)
        check_model(req.model, served.names())
        return await answer(request, req, chat_conversation(req), chat=True)

    gen_example = {
        "model": default,
        "prompt": "Hello",
        "stream": False,
        "options": {"num_predict": 16},
    }

    @app.post(
        "/api/generate",
        **doc(
            {"model": OllamaGenerateResponse, "content": openapi.ndjson()},
            OllamaGenerateRequest,
            gen_example,
            errors=(400, 404, 429, 503),
        ),
    )
    @ollama_errors
    async def generate(request: Request) -> Response:
        req = await parse(request, OllamaGenerateRequest)
        name = check_model(req.model, served.names())
        conv = generate_conversation(req)  # what it cannot honour is refused, preload or not
        if not req.prompt:  # Ollama's way to load a model (keep_alive 0: to unload it)
            keep = keep_alive(req.keep_alive)
            if keep == 0:
                served.keep(name, 0)
            else:
                await served.acquire(name, keep)
            body = {"model": name, "created_at": _now(), "response": ""}
            reason = "unload" if keep == 0 else "load"
            return JSONResponse({**body, "done": True, "done_reason": reason})
        return await answer(request, req, conv, chat=False)
