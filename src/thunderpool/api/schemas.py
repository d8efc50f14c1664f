"""OpenAI wire schemas: the requests we accept and the responses and chunks we send.

Requests refuse unknown fields (a 400 names the field: nothing is accepted and ignored) and are
validated strictly, so a string where a number belongs is a 400 rather than a silent coercion.
Fields that change nothing in an answer (`user`, `metadata`, `store: false`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)


def _not_stored(store: bool) -> bool:
    if store:
        raise ValueError("this server keeps no completions to list later; leave 'store' out")
    return store


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class ContentPart(_Request):
    # Other part types (image_url, input_audio) carry their own fields; they get a clear 400
    # from openai_chat.messages() naming the type, not a union error here.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ToolFunction(_Request):
    name: str
    arguments: str  # a JSON object as text


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class Message(_Request):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    # `schema` shadows a BaseModel attribute; the wire name stays "schema".
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(_Request):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI, but vLLM and llama.cpp accept it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # not OpenAI; vLLM's
    min_p: float | None = None  # not OpenAI; vLLM's and llama.cpp's
    # vLLM's, which benchmark clients send to fix output lengths (engine/sampling.py).
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Annotations for the caller's own records: they change nothing in the answer.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: Annotated[bool, AfterValidator(_not_stored)] | None = None


class ChatRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str


class CalledTool(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class CalledToolDelta(CalledTool):
    index: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobContent(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[LogprobContent] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[CalledTool] | None = None

    # `tool_calls` only when the model called a tool, as OpenAI answers.
    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[CalledToolDelta] | None = None

    # OpenAI sends only the keys a delta carries: `{"content": "Hi"}`, and `{}` at the end.
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "thunderpool"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
