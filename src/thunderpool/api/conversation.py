"""The one internal request behind every API (OpenAI chat, Anthropic Messages, Ollama,
Responses), and the one stream of events every API's answer is rendered from.

Each API translates its body into a Conversation (refusing what it cannot honour), then
`admit` turns it into prompt ids and SamplingParams, and `turn` into Text, Call and Finish.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread

from thunderpool.api import prompts
from thunderpool.api.errors import APIError, bad_request, not_ready
from thunderpool.api.generation import NO_FINISH, Job, engine_error
from thunderpool.api.schemas import SamplingFields
from thunderpool.api.sse import close_quietly
from thunderpool.api.tools import Call, Text, ToolSplitter, check_choice, check_tools
from thunderpool.engine.service import Delta, EngineClient

log = logging.getLogger("thunderpool.api")


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat turn to generate: messages as chat templates take them (role, content, and
    OpenAI-form `tool_calls` / `tool_call_id`), OpenAI function tools, the sampling knobs."""

    messages: tuple[dict[str, Any], ...]
    sampling: SamplingFields
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    stream: bool = False
    raw: str | None = None  # a prompt sent as is, without the chat template (Ollama's raw)
    context: int | None = None  # a client's lower context limit (Ollama's num_ctx)
    prompt_field: str = "messages"  # named in a too-long-prompt 400


@dataclass(frozen=True, slots=True)
class Finish:
    """How a turn ended: "stop" | "length" | "tool_calls"; `stop_sequence` when one matched."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefix cache


@dataclass(frozen=True, slots=True)
class Turn:
    text: str
    calls: tuple[Call, ...]
    finish: Finish


@dataclass(slots=True)
class Admitted:
    job: Job
    splitter: ToolSplitter | None
    stops: tuple[str, ...] = field(default_factory=tuple)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def template_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict]) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    except Exception as e:  # templates are data that raise on input they reject
        raise bad_request(
            f"the model's chat template rejected the messages: {e}", "messages"
        ) from e
    if isinstance(ids, Mapping):  # a Hugging Face BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


async def render(engine: EngineClient, conv: Conversation) -> list[int]:
    """The prompt's token ids, after the checks that do not depend on sampling."""
    tools = _offered(conv)
    if tools:  # tool_choice "none" needs no tool format: the tools stay out of the prompt
        family = str(engine.info.cluster.get("model_type") or "")
        check_tools(engine.tokenizer, engine.info.model, family)
    check_choice(conv.tool_choice)  # "required" or a name, with tools or without
    if not conv.messages and conv.raw is None:
        raise bad_request("at least one message is required", param=conv.prompt_field)
    s = engine.status()
    if s.state != "ready":
        raise not_ready(s.state, s.detail)
    if conv.raw is not None:
        return await to_thread.run_sync(prompts.completion_prompt, engine.tokenizer, conv.raw)
    msgs = [dict(m) for m in conv.messages]
    return await to_thread.run_sync(template_prompt, engine.tokenizer, msgs, tools)


def _offered(conv: Conversation) -> list[dict[str, Any]]:
    return [dict(t) for t in conv.tools] if conv.tool_choice != "none" else []


async def admit(engine: EngineClient, conv: Conversation, prefix: str) -> Admitted:
    """Checks, renders the prompt and builds the Job; the engine is not called yet."""
    ids = await render(engine, conv)
    limit = engine.info.max_context
    if conv.context is not None:
        limit = min(limit, conv.context)
    req = conv.sampling
    params = prompts.sampling_params(req, req.max_tokens, len(ids), limit, conv.prompt_field)
    job = Job(new_id(prefix), int(time.time()), engine.info.model, ids, params)
    tools = _offered(conv)
    splitter = ToolSplitter.of(engine.tokenizer, tools) if tools else None
    return Admitted(job, splitter, params.stop)


def _stop_sequence(tokenizer: Any, tokens: list[int], shown: str, stops: tuple[str, ...]) -> str:
    """Which stop string ended the text (the engine reports only "stop"): the earliest one in
    what was generated past the text shown; "" when the model's end token stopped it."""
    if not stops:
        return ""
    try:
        tail = tokenizer.decode(tokens)[len(shown) :]
    except Exception:  # a tokenizer that cannot decode its own ids: say nothing rather than fail
        return ""
    found = [(i, s) for s in stops if (i := tail.find(s)) >= 0]
    return min(found)[1] if found else ""


async def turn(
    engine: EngineClient, admitted: Admitted, *, replayable: bool = False
) -> AsyncIterator[Text | Call | Finish]:
    """The engine's deltas as Text and Call events, then one Finish; an engine failure raises
    APIError(500). The engine's iterator is closed however this ends."""
    job, splitter = admitted.job, admitted.splitter
    deltas = engine.generate(job.prompt, job.params, replayable=replayable)
    shown, tokens, calls = [], [], 0
    try:
        async for d in deltas:
            if d.finish_reason == "error":
                raise engine_error(d.error)
            tokens.extend(d.tokens)
            shown.append(d.text)
            pieces = splitter.feed(d.text) if splitter else [Text(d.text)] if d.text else []
            if d.finish_reason is not None and splitter:
                pieces += splitter.finish()
            for p in pieces:
                calls += isinstance(p, Call)
                yield p
            if d.finish_reason is not None:
                yield _finish(engine, admitted, d, tokens, "".join(shown), calls)
                return
    except APIError:
        raise
    except Exception as e:
        log.exception("generation %s failed", job.id)
        raise engine_error(str(e)) from e
    finally:
        await close_quietly(deltas)
    raise engine_error(NO_FINISH)


def _finish(
    engine: EngineClient, a: Admitted, last: Delta, tokens: list[int], shown: str, calls: int
) -> Finish:
    usage = a.job.usage(last)
    reason, stop = last.finish_reason or "stop", None
    if reason == "stop" and calls:
        reason = "tool_calls"
    elif reason == "stop":
        stop = _stop_sequence(engine.tokenizer, tokens, shown, a.stops) or None
    return Finish(reason, usage.prompt_tokens, usage.completion_tokens, stop, last.cached_tokens)


async def collect_turn(engine: EngineClient, admitted: Admitted) -> Turn:
    text, calls = [], []
    async for ev in turn(engine, admitted, replayable=True):
        match ev:
            case Text():
                text.append(ev.text)
            case Call():
                calls.append(ev)
            case Finish():
                return Turn("".join(text), tuple(calls), ev)
    raise engine_error(NO_FINISH)  # turn() always ends with Finish or raises
