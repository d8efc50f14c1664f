"""From an OpenAI request's sampling surface to SamplingParams fields: penalties, logit bias,
logprobs, and the JSON schema the output must match (response_format, or a forced tool call).

`tool_choice: "required"` or a named function is enforced by the same grammar as
`json_schema`: the output is one `{"name": ..., "arguments": {...}}` object of the given tools,
which the answer returns as `tool_calls`. Whatever cannot be enforced is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from thunderpool.api.errors import bad_request
from thunderpool.api.schemas import ChatRequest, CompletionRequest
from thunderpool.api.tools import call_schema
from thunderpool.engine.constraint import ANY_OBJECT, SchemaError, check_schema

MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions limit


def sampling_extras(req: ChatRequest | CompletionRequest, vocab: int | None = None) -> dict:
    """SamplingParams keyword arguments for the penalties, bias, logprobs and constraint."""
    out: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
        if (v := getattr(req, name)) is not None:
            out[name] = float(v)
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias, vocab)
    if req.min_tokens is not None:
        out["min_tokens"] = req.min_tokens
    if req.ignore_eos:
        out["ignore_eos"] = True
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if req.logprobs:
            out["logprobs"] = True
            out["top_logprobs"] = req.top_logprobs or 0
    elif isinstance(req, CompletionRequest) and req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(
                f"logprobs={req.logprobs} must be in [0, {MAX_COMPLETION_LOGPROBS}]",
                param="logprobs",
            )
        out["logprobs"], out["top_logprobs"] = True, req.logprobs
    if (schema := output_schema(req)) is not None:
        out["json_schema"] = schema
    return out


def _logit_bias(bias: dict[str, float], vocab: int | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or (vocab is not None and int(key) >= vocab):
            limit = f" below {vocab}" if vocab is not None else ""
            raise bad_request(
                f"logit_bias key {key!r} is not a token id; use integers{limit}",
                param="logit_bias",
            )
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def check_n(req: ChatRequest | CompletionRequest) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n={n} must be in [1, {MAX_N}]", param="n")
    return n


def output_schema(req: ChatRequest | CompletionRequest) -> str | None:
    """The JSON-schema text the output must match, or None for free text."""
    forced = forced_tools(req) if isinstance(req, ChatRequest) else None
    fmt = req.response_format
    if forced is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_request(
                "response_format cannot be combined with a forced tool_choice; use one",
                param="response_format",
            )
        return _checked(closed(call_schema(forced)), "tools")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request(
            "response_format json_schema needs json_schema.schema", param="response_format"
        )
    schema = fmt.json_schema.schema_
    return _checked(closed(schema) if fmt.json_schema.strict else schema, "response_format")


def closed(schema: Any) -> Any:
    """OpenAI's strict mode: objects that do not say otherwise take no extra properties
    (a small model otherwise invents keys until max_tokens)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _checked(schema: Any, param: str) -> str:
    try:
        return check_schema(schema)
    except SchemaError as e:
        raise bad_request(str(e), param=param) from None


def forced_tools(req: ChatRequest) -> list[dict] | None:
    """The functions one of which must be called (tool_choice "required" or named), or None
    when the model may answer in text. Other tool uses are refused here."""
    choice, tools = req.tool_choice, req.tools
    if choice is None or choice in ("none", "auto"):
        return None  # "auto": the family's tool parser reads the calls (openai_chat.py)
    functions = [_function(t, i) for i, t in enumerate(tools or [])]
    if not functions:
        raise bad_request(f"tool_choice={choice!r} needs a non-empty 'tools'", param="tools")
    if choice == "required":
        return functions
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        named = [f for f in functions if f["name"] == name]
        if not named:
            known = ", ".join(repr(f["name"]) for f in functions)
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools ({known})",
                param="tool_choice",
            )
        return named
    raise bad_request(
        f"tool_choice={choice!r} is not supported; use 'none', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _function(tool: Any, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(
            'each tool must be {"type": "function", "function": {...}}', param=f"tools.{i}"
        )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("a function needs a non-empty 'name'", param=f"tools.{i}.function.name")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(
            "function parameters must be a JSON schema object",
            param=f"tools.{i}.function.parameters",
        )
    return {"name": fn["name"], "parameters": params}
