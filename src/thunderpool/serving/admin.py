"""Operator endpoints of `serve`, behind the same API key as /v1."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from thunderpool.api.routes import api_key_guard


def mount_admin(app: FastAPI, supervisor, api_key: str | None) -> None:
    @app.post("/v1/admin/replan", dependencies=[Depends(api_key_guard(api_key))])
    async def replan() -> JSONResponse:
        """Plan again on the nodes that answer now (e.g. one rejoined) and move to that plan
        once the running requests have finished; new requests get 503 meanwhile."""
        supervisor.request_replan()
        return JSONResponse({"replanning": True, "instance": supervisor.generation}, 202)
