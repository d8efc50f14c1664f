"""Ollama's wire bodies (/api/chat, /api/generate, /api/show and their answers), as its clients send
and read them: anything else in a request is refused by name (Strict)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, WithJsonSchema

from thunderpool.api.wire import Strict

# keep_alive as a string: seconds, or a Go duration like Ollama's ("5m", "1h30m", "-1s").
DURATION = r"^[+-]?(\d+(\.\d*)?|((\d+(\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h))+)$"
KEEP_ALIVE = {"type": "string", "pattern": DURATION}


class OllamaFunction(Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class OllamaToolCall(Strict):
    function: OllamaFunction


class OllamaMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    images: list[Any] | None = None
    thinking: str | None = None


class OllamaOptions(Strict):
    """The options this server honours (Ollama's names); any other is a 400 naming it."""

    num_predict: int | None = None  # <= 0: until the context ends, as Ollama
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_ctx: int | None = None


class _Generating(Strict):
    model: str
    stream: bool | None = None
    options: OllamaOptions | None = None
    format: Any = None
    # How long the model stays loaded once idle; a string that is no duration is refused by
    # ollama_models.keep_alive, with the forms it takes (the schema shows the pattern).
    keep_alive: float | int | Annotated[str, WithJsonSchema(KEEP_ALIVE)] | None = None
    think: bool | str | None = None


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] | None = None
    tools: list[Any] | None = None


class OllamaGenerateRequest(_Generating):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None


class ShowRequest(Strict):
    model: str
    verbose: bool | None = None


class PullRequest(Strict):
    """Nothing is downloaded (the server knows its models at start): `insecure` has no
    connection to change, so it is taken as said."""

    model: str | None = None
    name: str | None = None  # Ollama's older spelling of `model`
    stream: bool | None = None
    insecure: bool | None = None


class OllamaError(BaseModel):
    error: str


class OllamaMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    tool_calls: list[dict[str, Any]] | None = None


class OllamaChatResponse(BaseModel):
    model: str
    created_at: str
    message: OllamaMessageOut
    done: bool
    done_reason: str | None = None


class OllamaGenerateResponse(BaseModel):
    model: str
    created_at: str
    response: str
    done: bool
    done_reason: str | None = None
