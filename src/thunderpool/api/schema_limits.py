"""What the server refuses, said in /openapi.json: the bounds and forms each API checks in
code (prompts.py, structured.py, sampling.py, the API modules), added to the schemas pydantic
writes. A request the document calls valid is one the server takes, but for what no schema
can say (a prompt longer than the context, `min_tokens` above `max_tokens`, a chat template
that refuses an order of roles): those 400s are described on each operation's 400 answer.
"""

from __future__ import annotations

from typing import Any

from thunderpool.api.structured import MAX_COMPLETION_LOGPROBS, MAX_N
from thunderpool.engine.sampling import MAX_TOP_LOGPROBS

NOT_TRUE = {"not": {"const": True}}  # a flag the server takes only as false (or absent)
NON_EMPTY = {"type": "string", "minLength": 1}
NAMED = {"type": "object", "required": ["name"], "properties": {"name": NON_EMPTY}}
FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"type": {"const": "function"}, "function": NAMED},
}
# Keywords at a property's top level apply to the matching type of its anyOf only (minimum
# to numbers, minLength to strings, items to arrays), so they bound nullable fields as well.
SAMPLING: dict[str, dict[str, Any]] = {
    "max_tokens": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": 0},
    "stop": {"minLength": 1, "items": NON_EMPTY},
    "n": {"minimum": 1, "maximum": MAX_N},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "min_p": {"minimum": 0, "maximum": 1},
    "min_tokens": {"minimum": 0},
    "logit_bias": {
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    },
    "store": NOT_TRUE,
}
FALSY = {"enum": [None, False, "", []]}  # Ollama's fields the server takes only unset
OLLAMA: dict[str, dict[str, Any]] = {
    "format": FALSY,
    "think": FALSY,
}
CHOICE = {"enum": ["auto", "none", "required"]}
LIMITS: dict[str, dict[str, dict[str, Any]]] = {
    "ChatRequest": {
        "": {  # top_logprobs needs logprobs
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        },
        **SAMPLING,
        "tool_choice": {
            "anyOf": [
                CHOICE,
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {"type": {"const": "function"}, "function": NAMED},
                },
                {"type": "null"},
            ]
        },
        "messages": {"minItems": 1},
        "max_completion_tokens": {"minimum": 1},
        "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "tools": {"items": FUNCTION_TOOL},
    },
    "CompletionRequest": {
        **SAMPLING,
        "prompt": {"minLength": 1, "minItems": 1, "maxItems": 1, "items": NON_EMPTY},
        "logprobs": {"minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS},
        "echo": NOT_TRUE,
        "best_of": {"minimum": 1, "maximum": 1},
    },
    "MessagesRequest": {
        "messages": {"minItems": 1},
        "max_tokens": {"minimum": 1},
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"minimum": 0},
        "stop_sequences": {"items": NON_EMPTY},
    },
    "CountTokensRequest": {"messages": {"minItems": 1}},
    "Message": {
        "": {  # a tool message answers a call; only the assistant's carry calls
            "allOf": [
                {
                    "if": {"properties": {"role": {"const": "tool"}}},
                    "then": {
                        "required": ["tool_call_id"],
                        "properties": {"tool_call_id": {"type": "string"}},
                    },
                },
                {
                    "if": {
                        "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                        "required": ["tool_calls"],
                    },
                    "then": {"properties": {"role": {"const": "assistant"}}},
                },
            ]
        }
    },
    "AnthropicTool": {"name": {"minLength": 1}},
    "ResponsesTool": {"name": {"minLength": 1}},
    "ResponsesItem": {
        "": {  # what each kind of item needs (the type is "message" when absent)
            "allOf": [
                {
                    "if": {
                        "anyOf": [
                            {"not": {"required": ["type"]}},
                            {"properties": {"type": {"const": "message"}}},
                        ]
                    },
                    "then": {"required": ["role"], "properties": {"role": {"type": "string"}}},
                },
                {
                    "if": {
                        "properties": {"type": {"const": "function_call"}},
                        "required": ["type"],
                    },
                    "then": {
                        "required": ["call_id", "name", "arguments"],
                        "properties": {
                            "call_id": NON_EMPTY,
                            "name": NON_EMPTY,
                            "arguments": {"type": "string"},
                        },
                    },
                },
                {
                    "if": {
                        "properties": {"type": {"const": "function_call_output"}},
                        "required": ["type"],
                    },
                    "then": {
                        "required": ["call_id", "output"],
                        "properties": {"call_id": {"type": "string"}, "output": {"type": "string"}},
                    },
                },
            ]
        }
    },
    # "" is the object itself: a json_schema format must carry its schema.
    "ResponseFormat": {
        "": {
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                },
            },
        }
    },
    "AnthropicToolChoice": {"type": {"enum": ["auto", "none"]}},  # forced calls: not here yet
    "OllamaChatRequest": {
        "": {"required": ["messages"]},
        "messages": {"type": "array", "minItems": 1},
        "tools": {"items": FUNCTION_TOOL},
        **OLLAMA,
    },
    "OllamaGenerateRequest": {
        "images": {"maxItems": 0},
        "context": {"maxItems": 0},
        "suffix": FALSY,
        "template": FALSY,
        **OLLAMA,
    },
    "OllamaMessage": {"images": {"maxItems": 0}},
    "OllamaOptions": {
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"minimum": 0},
        "stop": {"minLength": 1, "items": NON_EMPTY},
        "num_ctx": {"minimum": 1},
    },
    "ResponsesRequest": {
        "input": {"minItems": 1},
        "max_output_tokens": {"minimum": 1},
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "store": NOT_TRUE,
        "min_tokens": {"minimum": 0},
        "stop": {"minLength": 1, "items": NON_EMPTY},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none"]}, {"type": "null"}]},  # no forcing
    },
}


def apply(schemas: dict[str, Any]) -> None:
    """Add LIMITS to the document's component schemas, in place."""
    for name, fields in LIMITS.items():
        schema = schemas.get(name, {})
        props = schema.get("properties", {})
        for field, extra in fields.items():
            if field == "":
                required = schema.get("required", []) + extra.get("required", [])
                schema.update(extra)
                if required:
                    schema["required"] = list(dict.fromkeys(required))
            elif field in props:
                props[field].update(extra)
