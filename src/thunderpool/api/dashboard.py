"""The web dashboard: static HTML/JS/CSS (no build step) that polls the API's JSON and metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def mount_dashboard(app: FastAPI) -> None:
    """Serve `/` (the page) and `/static/*` (its script and style) from the package's files."""

    # no-cache: a browser left open across an upgrade revalidates instead of running stale JS.
    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
