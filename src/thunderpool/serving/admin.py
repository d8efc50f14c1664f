"""Operator endpoints of `serve`: what changes the cluster or the engine.

They take a credential even on localhost, where /v1 may take none: `--api-key`, or the admin
token `serve` writes at start to a file only its user can read (`admin-<port>.token` in the
state directory). A browser page cannot read that file, nor send the header without a CORS
preflight that `serve` does not grant. They are not in /openapi.json.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from thunderpool.api.errors import APIError
from thunderpool.api.prompts import check_model
from thunderpool.api.wire import Strict, parse
from thunderpool.config import state_dir


def admin_token_file(port: int) -> Path:
    return state_dir() / f"admin-{port}.token"


def write_admin_token(port: int) -> tuple[str, Path]:
    """A new admin token for the server on `port`, in a file of mode 0600."""
    token = secrets.token_urlsafe(24)
    path = admin_token_file(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # created afresh, so no other user's file is reused
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def admin_guard(token: str, api_key: str | None):
    accepted = [f"Bearer {k}".encode() for k in (token, api_key) if k]

    def require(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(given, k) for k in accepted):
            raise APIError(
                401,
                "admin endpoints need 'Authorization: Bearer <token>': the --api-key, or the "
                "admin token serve wrote at start (admin-<port>.token in ~/.thunderpool)",
                code="invalid_api_key",
            )

    return require


class ModelBody(Strict):
    model: str


def mount_admin(app: FastAPI, supervisor, token: str, api_key: str | None, models=None) -> None:
    """`supervisor`: what a replan drives; `models` (serving.models.Models): what load and
    unload drive (not mounted without it)."""
    guard = [Depends(admin_guard(token, api_key))]
    if models is not None:
        _mount_models(app, models, guard)

    @app.post("/v1/admin/replan", dependencies=guard, include_in_schema=False)
    async def replan(request: Request) -> JSONResponse:
        """Plan again on the nodes that answer now (e.g. one rejoined) and move to that plan
        once the running requests have finished; new requests get 503 meanwhile. A replan
        asked for while one is pending is the same replan. With several models, a body
        `{"model": M}` names whose instance (default: the first model's)."""
        target = supervisor
        if models is not None and await request.body():
            name = check_model((await parse(request, ModelBody)).model, models.names())
            target = models.replanner(name)
        pending = target.request_replan()
        body = {"replanning": True, "instance": target.generation, "pending": pending}
        return JSONResponse(body, 202)


def _mount_models(app: FastAPI, models, guard: list) -> None:
    async def named(request: Request) -> str:
        return check_model((await parse(request, ModelBody)).model, models.names())

    @app.post("/v1/admin/load", dependencies=guard, include_in_schema=False)
    async def load(request: Request) -> JSONResponse:
        """Start loading a known model (unloading the least recently used idle one past
        --max-loaded); /api/ps and /health show its progress."""
        name = await named(request)
        await asyncio.to_thread(models.load, name)
        return JSONResponse({"model": name, "loading": True}, 202)

    @app.post("/v1/admin/unload", dependencies=guard, include_in_schema=False)
    async def unload(request: Request) -> JSONResponse:
        """Unload a model now (its ranks stopped, their memory freed); 409 while it serves."""
        name = await named(request)
        was = await asyncio.to_thread(models.unload, name)
        return JSONResponse({"model": name, "unloaded": was})
