"""The API's OpenAPI document, for routes that parse their own request bodies.

The completion routes read `Request` themselves (so bad JSON is an OpenAI-style 400, not a
422), which leaves FastAPI nothing to describe; these declarations put the bodies we accept and
the answers we send into /openapi.json, where clients and fuzzers (schemathesis) can see them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from thunderpool.api import schema_limits
from thunderpool.api.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
)

REF = "#/components/schemas/{model}"
SCHEME = "bearer"

ERRORS = {
    400: "the body is not valid JSON, or a field is wrong (named in `error.param`); also what "
    "no schema states: a prompt that leaves `max_tokens` no room in the context "
    "(`context_length_exceeded`), `min_tokens` above `max_tokens`, `tools` for a model whose "
    "chat template has no tool format, a conversation the model's chat template refuses, a "
    "tool_choice naming a function not in `tools` (or with no `tools`), a JSON schema "
    "(`response_format`, a tool's `parameters`) the output grammar cannot compile, tool-call "
    "`arguments` that are not JSON text",
    401: "missing or incorrect API key",
    404: "no such model",
    413: "the body is larger than the server reads (16 MiB)",
    429: "this client (its API key, or its address) has --max-concurrent-per-key requests "
    "running; retry after `Retry-After` seconds",
    503: "the model is not ready; retry after `Retry-After` seconds",
}

RETRY_AFTER = {"Retry-After": {"required": True, "schema": {"type": "string"}}}
CLUSTER = {
    "description": "the model; each rank's host, parameters, RSS and peak RSS (`nodes`); each "
    "measured link once (`links`); which layers and heads each rank holds (`placement`); with "
    "several models, each one's state, placement, memory, throughput and queue (`instances`)",
    "content": {"application/json": {"schema": {"type": "object"}}},
}

HISTORY = {
    "description": "the dashboard's history, oldest first (`points`, one every `every_s`); "
    "`?since=T` (unix seconds) keeps the points after T",
    "content": {"application/json": {"schema": {"type": "object"}}},
}


class NodeFetchProgress(BaseModel):
    """One node's weight fetch while `serve --cluster` loads."""

    node: str
    bytes_done: int
    bytes_total: int
    rate_Bps: float  # bytes per second received so far
    eta_s: float | None = None


class Health(BaseModel):
    status: str
    progress: float | None = None
    detail: str | None = None
    fetch: list[NodeFetchProgress] | None = None
    # With several models: each one's {model, state, progress, detail}; 200 while one serves.
    models: list[dict[str, Any]] | None = None


HEALTH = {
    "responses": {
        200: {
            "description": "ready",
            "content": {"application/json": {"schema": {"$ref": REF.format(model="Health")}}},
        },
        503: {
            "description": "loading or recovering; `progress` is 0..1",
            "content": {"application/json": {"schema": {"$ref": REF.format(model="Health")}}},
            "headers": RETRY_AFTER,
        },
    }
}


def events(chunk: type[BaseModel]) -> dict[str, Any]:
    """The `stream: true` body: `data: <chunk JSON>` events, then `data: [DONE]`.

    One event is described by OpenAPI 3.2's `itemSchema`, which schemathesis checks.
    """
    chunk_json = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": REF.format(model=chunk.__name__)},
    }
    data = {"anyOf": [{"const": "[DONE]"}, chunk_json]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"itemSchema": event}}


def named_events() -> dict[str, Any]:
    """A stream of named SSE events (`event: <type>` then `data: <JSON object>`)."""
    data = {"type": "string", "contentMediaType": "application/json"}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"itemSchema": event}}


def ndjson() -> dict[str, Any]:
    """A stream of JSON objects, one a line (Ollama's streaming)."""
    return {"application/x-ndjson": {"schema": {"type": "string"}}}


def route(
    ok: dict[str, Any],
    errors: tuple[int, ...] = (),
    body: type[BaseModel] | None = None,
    example: dict[str, Any] | None = None,
    guarded: bool = False,
    error: str = "ErrorBody",
) -> dict[str, Any]:
    """Keyword arguments for `app.get`/`app.post`: the body it reads and what it answers.

    `ok` is FastAPI's form of a response: `{"model": M}` and/or `{"content": {...}}`. A body's
    `example` is documented as is and streamed (fuzzers replay examples before inventing).
    """
    responses: dict[int | str, Any] = {200: {"description": "OK", **ok}}
    statuses = set(errors) | ({401} if guarded else set()) | ({413} if body else set())
    for status in sorted(statuses):
        # Spelled out, not {"model": ErrorBody}: FastAPI would give it the route's media type.
        shape = {"application/json": {"schema": {"$ref": REF.format(model=error)}}}
        responses[status] = {"description": ERRORS[status], "content": shape}
        if status in (429, 503):
            responses[status]["headers"] = RETRY_AFTER
    extra: dict[str, Any] = {}
    if body is not None:
        schema = {"$ref": REF.format(model=body.__name__)}
        content: dict[str, Any] = {"application/json": {"schema": schema}}
        if example is not None:
            streamed = {**example, "stream": True}
            examples = {"whole": {"value": example}, "streamed": {"value": streamed}}
            content["application/json"]["examples"] = examples
        extra["requestBody"] = {"required": True, "content": content}
    if guarded:
        extra["security"] = [{SCHEME: []}]
    # response_model=None: `responses` alone describes the 200, not the handler's `-> dict`.
    return {"responses": responses, "openapi_extra": extra or None, "response_model": None}


CHAT = {"model": ChatCompletion, "content": events(ChatCompletionChunk)}
COMPLETION = {"model": Completion, "content": events(Completion)}
HOISTED = (ChatRequest, CompletionRequest, ChatCompletionChunk, Health, ErrorBody)


def install(app: FastAPI, keyed: bool, extra: tuple[type[BaseModel], ...] = ()) -> None:
    """Complete `app`'s document: the schemas FastAPI does not see (request bodies, stream
    chunks), the bearer scheme when a key is set, and no 422s (bad input is a 400 here)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)  # caches itself in app.openapi_schema
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in HOISTED + extra:
                schema = model.model_json_schema(ref_template=REF)
                for name, part in schema.pop("$defs", {}).items():
                    schemas.setdefault(name, part)  # FastAPI's own (e.g. Usage) stay
                schemas[model.__name__] = schema
            for body in (ChatRequest, CompletionRequest):
                # The field may be null only so that its absence gets our own 400 message.
                schemas[body.__name__]["properties"]["model"] = {"type": "string"}
                schemas[body.__name__]["required"].insert(0, "model")
            schema_limits.apply(schemas)
            for operation in (op for path in doc["paths"].values() for op in path.values()):
                operation["responses"].pop("422", None)
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            if keyed:
                bearer = {"type": "http", "scheme": "bearer"}
                doc["components"]["securitySchemes"] = {SCHEME: bearer}
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
