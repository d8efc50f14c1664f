"""Ollama's model endpoints: `/api/tags` (every known model), `/api/ps` (the loaded ones, with
memory and placement), `/api/pull` (loads a known model; nothing is downloaded), `/api/show`
and `/api/version`; and `keep_alive`, Ollama's duration for how long a model stays loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from thunderpool import __version__
from thunderpool.api import openapi
from thunderpool.api.errors import APIError, bad_request, not_ready
from thunderpool.api.models import Served
from thunderpool.api.ollama_wire import PullRequest, ShowRequest
from thunderpool.api.prompts import serves
from thunderpool.api.wire import parse

# Go's time.ParseDuration units, which Ollama's keep_alive strings use ("5m", "1h30m", "-1s").
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
JSON_OBJECT = {"content": {"application/json": {"schema": {"type": "object"}}}}


def check_model(requested: str, served: str | list[str]) -> str:
    """Ollama names carry a tag; `name` and `name:latest` are the one model (returned)."""
    names = [served] if isinstance(served, str) else served
    name = requested.removesuffix(":latest")
    if name not in names:
        raise APIError(404, f"model '{requested}' not found; {serves(names)}", param="model")
    return name


def keep_alive(value: float | int | str | None) -> float | None:
    """Seconds a model stays loaded once idle: None (unset: the server's default), 0 (unload
    now), math.inf (a negative value: forever). Numbers are seconds, as Ollama takes them."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)  # "300" is seconds too
        except ValueError:
            seconds = _duration(text, value)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise bad_request(f"keep_alive={value!r} is not a duration", "keep_alive")
    return math.inf if seconds < 0 else seconds


def _duration(text: str, value: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    parts = PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise bad_request(
            f"keep_alive={value!r} is not a duration; give seconds (300, -1 for forever, 0 to "
            "unload) or a duration like '5m' or '1h30m'",
            "keep_alive",
        )
    return sign * sum(float(n) * UNITS[u] for n, u in parts)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def details(served: Served, name: str) -> dict[str, Any]:
    family = str(served.client(name).info.cluster.get("model_type") or "")
    return {"format": "safetensors", "family": family, "families": [family] if family else None}


def tag(served: Served, name: str) -> dict[str, Any]:
    when = _iso(served.client(name).info.created)
    return {"name": name, "model": name, "modified_at": when, "size": 0, "digest": ""}


def mount(app: FastAPI, served: Served, ollama_errors, doc) -> None:
    """/api/tags, /api/ps, /api/version here; /api/pull and /api/show by _mount_model."""
    _mount_model(app, served, ollama_errors, doc)

    @app.get("/api/tags", **doc(JSON_OBJECT, errors=()))
    @ollama_errors
    async def tags(request: Request) -> Response:
        return JSONResponse(
            {"models": [{**tag(served, n), "details": details(served, n)} for n in served.names()]}
        )

    @app.get("/api/ps", **doc(JSON_OBJECT, errors=()))
    @ollama_errors
    async def ps(request: Request) -> Response:
        """The loaded (and loading) models: memory their ranks hold, where they run, and
        when they unload if they stay idle (a far future date: never)."""
        out = []
        for e in served.entries():
            if e.state == "unloaded":
                continue
            size = e.memory_bytes or 0
            expires = e.expires_at if e.expires_at is not None else 4102444800.0  # 2100
            out.append(
                {
                    **tag(served, e.name),
                    "size": size,
                    "size_vram": 0,  # no separate device memory: Apple's is unified, CPUs have none
                    "expires_at": _iso(expires),
                    "details": details(served, e.name),
                    "context_length": served.client(e.name).info.max_context,
                    "state": e.state,
                    "progress": round(e.progress, 4),
                    "in_flight": e.in_flight,
                    "placement": e.cluster.get("placement"),
                    "nodes": [n.get("name") for n in e.cluster.get("nodes") or []],
                }
            )
        return JSONResponse({"models": out})

    @app.get("/api/version", **openapi.route(JSON_OBJECT))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})


def _mount_model(app: FastAPI, served: Served, ollama_errors, doc) -> None:
    pulled = {"content": {**JSON_OBJECT["content"], **openapi.ndjson()}}

    @app.post("/api/pull", **doc(pulled, PullRequest, {"model": served.names()[0]}))
    @ollama_errors
    async def pull(request: Request) -> Response:
        """A known model is loaded (nothing is downloaded: the server knows its models at
        start); Ollama's clients read a `success` status when it is ready."""
        req = await parse(request, PullRequest)
        name = check_model(req.model or req.name or "", served.names())
        if req.stream is False:
            await _load(served, name)
            return JSONResponse({"status": "success"})
        return StreamingResponse(_pulling(served, name), media_type="application/x-ndjson")

    @app.post(
        "/api/show", **doc(JSON_OBJECT, ShowRequest, {"model": served.names()[0]}, (400, 404))
    )
    @ollama_errors
    async def show(request: Request) -> Response:
        req = await parse(request, ShowRequest)
        name = check_model(req.model, served.names())
        engine = served.client(name)
        tok = engine.tokenizer
        capabilities = ["completion"] + (
            ["tools"] if getattr(tok, "has_tool_calling", False) else []
        )
        info = {
            "general.architecture": details(served, name)["family"],
            "context_length": engine.info.max_context,
        }
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": str(getattr(tok, "chat_template", "") or ""),
                "details": details(served, name),
                "model_info": info,
                "capabilities": capabilities,
            }
        )


async def _load(served: Served, name: str) -> None:
    """Loaded and ready, or the 503 that says why not."""
    s = (await served.acquire(name)).status()
    if s.state != "ready":
        raise not_ready(s.state, s.detail)


async def _pulling(served: Served, name: str) -> AsyncGenerator[bytes, None]:
    yield (json.dumps({"status": f"loading {name}"}) + "\n").encode()
    try:
        await _load(served, name)
        yield (json.dumps({"status": "success"}) + "\n").encode()
    except APIError as e:
        yield (json.dumps({"error": e.message}) + "\n").encode()
