"""From a validated OpenAI request to what the engine takes: prompt token ids and SamplingParams.

Every refusal here is a 400 that names the field and, for context overflows, the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from thunderpool.api.errors import APIError, bad_request
from thunderpool.api.schemas import ChatRequest, CompletionRequest, Message, SamplingFields
from thunderpool.api.structured import sampling_extras
from thunderpool.engine.sampling import SamplingParams

# OpenAI's defaults; the engine's own default (greedy) applies only to in-process callers.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


def serves(names: str | Sequence[str]) -> str:
    """`this server serves 'A'` (or `'A', 'B'`): the end of every unknown-model error."""
    names = [names] if isinstance(names, str) else list(names)
    return "this server serves " + ", ".join(f"'{n}'" for n in names)


def check_model(requested: str | None, served: str | Sequence[str]) -> str:
    """OpenAI requires `model`; we require it too, and it must be a model served (returned)."""
    names = [served] if isinstance(served, str) else list(served)
    if requested is None:
        raise bad_request(f"'model' is required; {serves(names)}", param="model")
    if requested not in names:
        raise APIError(
            404,
            f"the model '{requested}' does not exist; {serves(names)}",
            param="model",
            code="model_not_found",
        )
    return requested


def check_supported(req: ChatRequest | CompletionRequest) -> None:
    """Refuse what would change the response's shape rather than silently ignore it
    (n, logprobs, tools and response_format are checked by structured.py)."""
    if isinstance(req, ChatRequest):
        if not req.messages:
            raise bad_request("'messages' must contain at least one message", param="messages")
    else:
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if req.best_of is not None and req.best_of != 1:
            raise bad_request(f"best_of={req.best_of} is not supported; only 1", param="best_of")
    if (isinstance(req.stop, list) and any(not s for s in req.stop)) or req.stop == "":
        raise bad_request("stop strings must not be empty", param="stop")


def chat_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Messages as chat templates expect them: string content, text parts joined by newlines."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only 'text' content parts are supported, got '{part.type}'",
                        param=f"messages.{i}.content.{j}",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def chat_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat template's prompt ids; `tools` are rendered where the template has a place
    for them (a forced call's grammar holds whether it does or not)."""
    extra = {"tools": tools} if tools else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as e:  # templates are data that raise on input they reject
        raise bad_request(
            f"the model's chat template rejected the messages: {e}", "messages"
        ) from e
    # Hugging Face tokenizers may return a BatchEncoding; mlx-lm's wrapper returns the ids.
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def completion_prompt(tokenizer: Any, prompt: str | list[str]) -> list[int]:
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request(
                f"'prompt' must be a string or a list of one string, got {len(prompt)} strings",
                param="prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise bad_request("'prompt' is empty", param="prompt")
    return [int(t) for t in tokenizer.encode(prompt)]


def sampling_params(
    req: SamplingFields, max_tokens: int | None, n_prompt: int, max_context: int, prompt_field: str
) -> SamplingParams:
    """Checks the context budget, then builds SamplingParams (whose own checks become 400s)."""
    if n_prompt >= max_context:
        raise bad_request(
            f"this model's maximum context length is {max_context} tokens, however your prompt "
            f"is {n_prompt} tokens, which leaves no room for the completion; shorten the prompt",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if max_tokens is not None and n_prompt + max_tokens > max_context:
        raise bad_request(
            f"this model's maximum context length is {max_context} tokens, however you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
            f"completion); shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    extras = sampling_extras(req)  # type: ignore[arg-type]
    try:
        return SamplingParams(
            max_tokens=max_context - n_prompt if max_tokens is None else max_tokens,
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_p=DEFAULT_TOP_P if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=stop,
            **extras,
        )
    except ValueError as e:
        # SamplingParams names the field first: "top_p=1.5 must be in (0, 1]".
        param = str(e).split("=", 1)[0]
        raise bad_request(str(e), param=param if param.isidentifier() else None) from e
