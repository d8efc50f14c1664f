"""OpenAI-compatible HTTP API over an engine client (see engine.service)."""

from thunderpool.api.routes import create_app

__all__ = ["create_app"]
