"""OpenAI Responses (`POST /v1/responses`): text and function tools, collected or streamed as
`response.*` events, over the shared Conversation. Nothing is stored, so `store: true` and
`previous_response_id` are refused; send the whole conversation as `input` instead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from thunderpool.api import openapi, prompts
from thunderpool.api.conversation import Admitted, Conversation, Finish, Turn, admit, new_id
from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.models import Served
from thunderpool.api.schemas import ErrorDetail, SamplingFields
from thunderpool.api.sse import EventStream, until_disconnect
from thunderpool.api.tools import Call, Text, function_tool
from thunderpool.api.turns import collect_turn, turn
from thunderpool.api.wire import Strict, parse
from thunderpool.engine.service import EngineClient

CLIENT_CLOSED = 499
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponsesItem(Strict):
    """A message (`type` "message" or absent), an earlier `function_call`, or its output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None


class ResponsesTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesTextFormat(Strict):
    type: Literal["text"]


class ResponsesText(Strict):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[ResponsesItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # nothing is kept: true is refused, absent reads as false
    text: ResponsesText | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's, as benchmark clients send them (guidellm: stop null, ignore_eos true).
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: ErrorDetail | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {"format": {"type": "text"}}


def _text(content: str | list[InputPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text for p in content)


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        match item.type:
            case "message":
                if item.role is None:
                    raise bad_request(f"{where}: a message needs a 'role'", param=where)
                out.append({"role": ROLES[item.role], "content": _text(item.content)})
            case "function_call":
                if not (item.call_id and item.name and item.arguments is not None):
                    raise bad_request(
                        f"{where}: a function_call needs call_id, name, arguments", where
                    )
                try:
                    args = json.loads(item.arguments)
                except json.JSONDecodeError as e:
                    raise bad_request(f"{where}.arguments is not valid JSON: {e}", where) from e
                call = {"id": item.call_id, "type": "function"}
                call["function"] = {"name": item.name, "arguments": args}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            case "function_call_output":
                if item.call_id is None or item.output is None:
                    raise bad_request(
                        f"{where}: a function_call_output needs call_id, output", where
                    )
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice={choice!r} is not auto, none or required", "tool_choice"
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return choice["name"]
    raise bad_request('a named tool_choice is {"type": "function", "name": ...}', "tool_choice")


def to_conversation(req: ResponsesRequest) -> Conversation:
    if req.store:
        raise bad_request(
            "store=true is not supported: responses are not kept; send store=false and the "
            "whole conversation as 'input'",
            param="store",
        )
    if isinstance(req.input, list) and not req.input:
        raise bad_request("'input' must not be empty", param="input")
    if (isinstance(req.stop, list) and any(not s for s in req.stop)) or req.stop == "":
        raise bad_request("stop strings must not be empty", param="stop")
    sampling = SamplingFields(
        model=req.model,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=req.stop,
    )
    tools = tuple(
        function_tool(t.name, t.description, t.parameters, f"tools.{i}")
        for i, t in enumerate(req.tools or [])
    )
    return Conversation(
        tuple(_messages(req)),
        sampling,
        tools,
        _tool_choice(req.tool_choice),
        stream=bool(req.stream),
        prompt_field="input",
    )


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _call_item(c: Call, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + c.id.removeprefix("call_"),
        "call_id": c.id,
        "name": c.name,
        "arguments": c.arguments,
        "status": status,
    }


def _usage(f: Finish) -> dict[str, Any]:
    return {
        "input_tokens": f.prompt_tokens,
        "input_tokens_details": {"cached_tokens": f.cached_tokens},
        "output_tokens": f.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    }


def _response(
    a: Admitted, req: ResponsesRequest, output: list[dict[str, Any]], finish: Finish | None
) -> ResponseObject:
    incomplete = finish is not None and finish.reason == "length"
    status = "in_progress" if finish is None else "incomplete" if incomplete else "completed"
    return ResponseObject(
        id=a.job.id,
        created_at=a.job.created,
        status=status,
        model=a.job.model,
        output=output,
        usage=_usage(finish) if finish else None,
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
    )


def body(a: Admitted, req: ResponsesRequest, t: Turn) -> ResponseObject:
    output = [_message_item(new_id("msg_"), t.text)] if t.text or not t.calls else []
    output += [_call_item(c) for c in t.calls]
    return _response(a, req, output, t.finish)


async def events(
    engine: EngineClient, a: Admitted, req: ResponsesRequest
) -> AsyncGenerator[bytes, None]:
    """response.created / in_progress, per output item: added, deltas, done; then completed."""
    seq = 0
    output: list[dict[str, Any]] = []

    def send(kind: str, **payload: Any) -> bytes:
        nonlocal seq
        seq += 1
        data = json.dumps({"type": kind, "sequence_number": seq - 1, **payload})
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def state(finish: Finish | None = None) -> dict[str, Any]:
        return _response(a, req, output, finish).model_dump(mode="json")

    yield send("response.created", response=state())
    yield send("response.in_progress", response=state())
    text_item: dict[str, Any] | None = None
    text = ""

    def close_text() -> list[bytes]:
        nonlocal text_item, text
        if text_item is None:
            return []
        idx, done = len(output), _message_item(text_item["id"], text)
        ids = {"item_id": text_item["id"], "output_index": idx, "content_index": 0}
        part = done["content"][0]
        out = [
            send("response.output_text.done", **ids, text=text, logprobs=[]),
            send("response.content_part.done", **ids, part=part),
            send("response.output_item.done", output_index=idx, item=done),
        ]
        output.append(done)
        text_item, text = None, ""
        return out

    try:
        async for ev in turn(engine, a):
            match ev:
                case Text() if ev.text:
                    idx = len(output)
                    if text_item is None:
                        text_item = _message_item(new_id("msg_"), "", "in_progress")
                        text_item["content"] = []
                        yield send("response.output_item.added", output_index=idx, item=text_item)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        ids = {"item_id": text_item["id"], "output_index": idx, "content_index": 0}
                        yield send("response.content_part.added", **ids, part=part)
                    text += ev.text
                    ids = {"item_id": text_item["id"], "output_index": idx, "content_index": 0}
                    yield send("response.output_text.delta", **ids, delta=ev.text, logprobs=[])
                case Call():
                    for b in close_text():
                        yield b
                    idx, item = len(output), _call_item(ev)
                    yield send(
                        "response.output_item.added",
                        output_index=idx,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                    ids = {"item_id": item["id"], "output_index": idx}
                    yield send("response.function_call_arguments.delta", **ids, delta=ev.arguments)
                    yield send(
                        "response.function_call_arguments.done", **ids, arguments=ev.arguments
                    )
                    yield send("response.output_item.done", output_index=idx, item=item)
                    output.append(item)
                case Finish():
                    for b in close_text():
                        yield b
                    kind = "response.incomplete" if ev.reason == "length" else "response.completed"
                    yield send(kind, response=state(ev))
                    return
    except APIError as e:
        failed = state()
        failed["status"], failed["error"] = "failed", {"code": "server_error", "message": e.message}
        yield send("response.failed", response=failed)


def mount(app: FastAPI, served: Served, guard: list[Any], keyed: bool) -> None:
    example = {"model": served.names()[0], "input": "Hello", "max_output_tokens": 16}
    ok = {"model": ResponseObject, "content": openapi.named_events()}
    doc = openapi.route(ok, (400, 404, 429, 503), ResponsesRequest, example, guarded=keyed)

    @app.post("/v1/responses", dependencies=guard, **doc)
    async def responses(request: Request) -> Response:
        req = await parse(request, ResponsesRequest)
        engine = await served.acquire(prompts.check_model(req.model, served.names()))
        admitted = await admit(engine, to_conversation(req), "resp_")
        if req.stream:
            return EventStream(events(engine, admitted, req))
        t = await until_disconnect(request.receive, lambda: collect_turn(engine, admitted))
        if t is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body(admitted, req, t).model_dump(mode="json"))
