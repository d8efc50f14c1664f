"""Tool calling at the API edge: which models can, the JSON schema of a call, and finding calls
in generated text with mlx-lm's tool parsers (the way mlx_lm/server.py uses them).

The tokenizer (mlx-lm's TokenizerWrapper) names its family's parser, inferred from the chat
template: `tool_call_start`, `tool_call_end` and `tool_parser(text, tools) -> dict | list`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from thunderpool.api.errors import bad_request

log = logging.getLogger("thunderpool.api")

# What a client may ask for today; "required" and named functions need constrained decoding.
SERVED_CHOICES = ("auto", "none")


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    logprobs: tuple = ()  # the engine's TokenLogprobs of the tokens behind it, if asked
    tokens: int = 0  # the choice's completion tokens so far (vLLM's continuous usage)


@dataclass(frozen=True, slots=True)
class Call:
    """One parsed call; `arguments` is a JSON object as text (OpenAI's wire form)."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {"value": value}


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A tool as chat templates take it (OpenAI's form), from any API's spelling of one."""
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}: a tool needs a non-empty string 'name'", param=where)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(
            f"{where}: the parameters of '{name}' must be a JSON schema object", where
        )
    function: dict[str, Any] = {"name": name}  # OpenAI's key order, as templates print it
    if description is not None:
        function["description"] = str(description)
    function["parameters"] = parameters or {"type": "object"}
    return {"type": "function", "function": function}


def check_tools(tokenizer: Any, model: str, family: str = "", param: str = "tools") -> None:
    """Refuse tools for a model whose chat template mlx-lm has no tool parser for."""
    if not getattr(tokenizer, "has_tool_calling", False):
        kind = f" (family '{family}')" if family else ""
        raise bad_request(
            f"'{param}' is not supported by the served model '{model}'{kind}: its chat template "
            "has no "
            "tool-call format that mlx-lm's tool parsers know (for example Qwen, Llama 3.1+, "
            "Mistral, GLM, Kimi, Gemma); serve such a model to use tools",
            param=param,
        )


def check_choice(choice: str, param: str = "tool_choice") -> None:
    if choice not in SERVED_CHOICES:
        raise bad_request(
            f"{param}={choice!r} is not supported yet (it needs constrained decoding); use "
            "'auto' or 'none'",
            param=param,
        )


def call_schema(functions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of one of `functions` ({"name", "parameters"}, checked by
    structured.forced_tools): {"name": <const>, "arguments": <its parameters>}, for
    constrained decoding."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def forced_call(text: str) -> Call | None:
    """The call in a constrained generation's text (a JSON object matching `call_schema`), or
    None if it was cut short: forced calls carry no family markers, so they are read here
    rather than by the splitter."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = json.dumps(value.get("arguments", {}), ensure_ascii=False)
    return Call(new_call_id(), value["name"], arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolSplitter:
    """Splits streamed text into Text and Call events at the family's tool-call markers.

    Text that might begin a start marker is held back until the next piece settles it, so no
    marker fragment ever reaches a client as text.
    """

    def __init__(
        self,
        start: str,
        end: str,
        parse: Callable[[str, Any], Any],
        tools: Sequence[dict[str, Any]],
    ):
        self.start, self.end, self.parse, self.tools = start, end, parse, list(tools)
        self.buf = ""
        self.in_call = False
        self.calls = 0

    @classmethod
    def of(cls, tokenizer: Any, tools: Sequence[dict[str, Any]]) -> ToolSplitter:
        return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)

    def feed(self, text: str) -> list[Text | Call]:
        self.buf += text
        out: list[Text | Call] = []
        while True:
            if not self.in_call:
                i = self.buf.find(self.start)
                if i < 0:
                    keep = _prefix_held(self.buf, self.start)
                    cut = len(self.buf) - keep
                    if cut > 0:
                        out.append(Text(self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    return out
                if i > 0:
                    out.append(Text(self.buf[:i]))
                self.buf = self.buf[i + len(self.start) :]
                self.in_call = True
            j = self.buf.find(self.end) if self.end else -1
            if j < 0:
                return out
            out.extend(self._parsed(self.buf[:j]))
            self.buf = self.buf[j + len(self.end) :]
            self.in_call = False

    def finish(self) -> list[Text | Call]:
        """What is left when generation ends: a call without its end marker (some families
        have none) is parsed; one that does not parse comes back as the text it was."""
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return [Text(rest)] if rest else []
        self.in_call = False
        return self._parsed(rest, closed=False)

    def _parsed(self, body: str, closed: bool = True) -> list[Text | Call]:
        try:
            parsed = self.parse(body, self.tools)
        except Exception as e:  # a truncated or malformed call; mlx-lm's server drops it too
            log.warning("tool call did not parse (%s: %s); returned as text", type(e).__name__, e)
            return [Text(self.start + body + (self.end if closed else ""))]
        out: list[Text | Call] = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            args = call.get("arguments", {})
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out.append(Call(call.get("id") or new_call_id(), str(call.get("name", "")), text))
        self.calls += len(out)
        return out


def _prefix_held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
