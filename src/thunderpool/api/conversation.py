"""The one internal request behind every API (OpenAI chat and completions, Anthropic
Messages, Ollama, Responses).

Each API translates its body into a Conversation (refusing what it cannot honour); `admit`
turns it into prompt ids and SamplingParams, and turns.py into each choice's stream of Text,
Call and Finish events, which the API renders.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from anyio import to_thread

from thunderpool.api import prompts
from thunderpool.api.errors import APIError, bad_request, not_ready
from thunderpool.api.limits import check_running
from thunderpool.api.schemas import SamplingFields
from thunderpool.api.tools import Call, ToolSplitter, check_choice, check_tools
from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import EngineClient


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat turn to generate: messages as chat templates take them (role, content, and
    OpenAI-form `tool_calls` / `tool_call_id`), OpenAI function tools, the sampling knobs."""

    messages: tuple[dict[str, Any], ...]
    sampling: SamplingFields
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"
    stream: bool = False
    raw: str | list[str] | None = None  # a prompt sent as is, without the chat template
    context: int | None = None  # a client's lower context limit (Ollama's num_ctx)
    prompt_field: str = "messages"  # named in a too-long-prompt 400
    n: int = 1  # choices, each its own engine request on the same prompt
    # tool_choice "required" or a name (OpenAI chat): the sampling's JSON schema holds the
    # output to one call of the tools (structured.py), which the turn returns as a Call.
    forced: bool = False


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
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Job:
    """One admitted request: what the engine gets and how the answer is labelled."""

    id: str
    created: int
    model: str
    prompt: list[int]
    params: SamplingParams
    n: int = 1
    token_text: Callable[[int], str] | None = None  # a token's text, for logprobs

    def choice_params(self, i: int) -> SamplingParams:
        """Choice i's parameters: a seeded request gives each choice its own seed."""
        p = self.params
        return p if i == 0 or p.seed is None else replace(p, seed=p.seed + i)


@dataclass(slots=True)
class Admitted:
    job: Job
    splitter: ToolSplitter | None
    stops: tuple[str, ...] = field(default_factory=tuple)
    forced: bool = False  # the output is one constrained tool call (Conversation.forced)


def engine_error(message: str | None) -> APIError:
    return APIError(500, f"generation failed: {message or 'unknown engine error'}", "server_error")


NO_FINISH = "the engine ended the request without a finish reason"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


async def render(engine: EngineClient, conv: Conversation) -> list[int]:
    """The prompt's token ids, after the checks that do not depend on sampling."""
    tools = _offered(conv)
    if tools and not conv.forced:  # "none" needs no tool format: the tools stay out
        family = str(engine.info.cluster.get("model_type") or "")
        check_tools(engine.tokenizer, engine.info.model, family)
    if not conv.forced:  # "required" or a name, with tools or without, is the grammar's
        check_choice(conv.tool_choice)
    if not conv.messages and conv.raw is None:
        raise bad_request("at least one message is required", param=conv.prompt_field)
    s = engine.status()
    if s.state != "ready":
        raise not_ready(s.state, s.detail)
    if conv.raw is not None:
        return await to_thread.run_sync(prompts.completion_prompt, engine.tokenizer, conv.raw)
    msgs = [dict(m) for m in conv.messages]
    return await to_thread.run_sync(prompts.chat_prompt, engine.tokenizer, msgs, tools)


def _offered(conv: Conversation) -> list[dict[str, Any]]:
    return [dict(t) for t in conv.tools] if conv.tool_choice != "none" else []


async def admit(engine: EngineClient, conv: Conversation, prefix: str) -> Admitted:
    """Checks, renders the prompt and builds the Job; the engine is not called yet."""
    check_running()  # the client's concurrent-request limit (api/limits.py)
    ids = await render(engine, conv)
    limit = engine.info.max_context
    if conv.context is not None:
        limit = min(limit, conv.context)
    req = conv.sampling
    params = prompts.sampling_params(req, req.max_tokens, len(ids), limit, conv.prompt_field)
    tokenizer = engine.tokenizer
    job = Job(
        new_id(prefix),
        int(time.time()),
        engine.info.model,
        ids,
        params,
        conv.n,
        token_text=lambda t: tokenizer.decode([t]),
    )
    tools = _offered(conv) if not conv.forced else []
    splitter = ToolSplitter.of(tokenizer, tools) if tools else None
    return Admitted(job, splitter, params.stop, conv.forced)
