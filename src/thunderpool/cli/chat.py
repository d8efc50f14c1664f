"""`thunderpool chat`: a terminal client that streams answers from the OpenAI-compatible API.

It keeps the conversation in memory and resends it with each turn, as the chat API is stateless.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import httpx

PROMPT = "> "
HELP = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops an answer"


class Unreachable(Exception):
    """The server cannot be reached at all: the REPL ends with exit status 2."""


@dataclass(slots=True)
class ChatSession:
    """One conversation against one server; `messages` excludes the system prompt."""

    url: str
    api_key: str | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()

    def request_body(self, user_text: str) -> dict:
        history = [{"role": "system", "content": self.system}] if self.system else []
        body: dict = {
            "messages": [*history, *self.messages, {"role": "user", "content": user_text}],
            "stream": True,
        }
        if self.model:
            body["model"] = self.model
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _error_text(response: httpx.Response) -> str:
    """The message of an OpenAI error body, or the status line when the body is not one."""
    response.read()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:200] or response.reason_phrase
    return f"server answered {response.status_code}: {message}"


def _sse_deltas(response: httpx.Response) -> Iterator[str]:
    """Text pieces from an SSE stream of chat.completion.chunk events, up to `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments and `event:` lines carry no text
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            raise RuntimeError(event["error"].get("message", "stream failed"))
        for choice in event.get("choices") or []:
            if text := (choice.get("delta") or {}).get("content"):
                yield text


def discover_model(client: httpx.Client, session: ChatSession) -> None:
    """Fail fast when the server is down, and pick its first model when none was given."""
    try:
        response = client.get(f"{session.url}/v1/models", headers=session.headers())
    except httpx.TransportError as e:
        raise Unreachable from e
    if session.model is None and response.status_code == 200:
        try:
            session.model = response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            pass  # the server picks its own default model


def answer(client: httpx.Client, session: ChatSession, user_text: str, out: TextIO) -> None:
    """Stream one answer to `out`; on success or Ctrl-C the exchange joins the history."""
    body = session.request_body(user_text)
    url = f"{session.url}/v1/chat/completions"
    parts: list[str] = []
    try:
        with client.stream("POST", url, json=body, headers=session.headers()) as response:
            if response.status_code != 200:
                out.write(f"error: {_error_text(response)}\n")
                return
            for text in _sse_deltas(response):
                out.write(text)
                out.flush()
                parts.append(text)
    except KeyboardInterrupt:
        # Leaving the `with` closed the stream, which cancels the generation on the server.
        out.write(" [stopped]")
    except httpx.TransportError as e:
        if not parts:
            raise Unreachable from e
        out.write(f"\nerror: the stream broke: {e}\n")
        return
    except (RuntimeError, json.JSONDecodeError) as e:
        out.write(f"\nerror: {e}\n")
        return
    out.write("\n")
    out.flush()
    # Keep what the user saw, so the next turn refers to the same conversation.
    session.messages += [
        {"role": "user", "content": user_text},
        {"role": "assistant", "content": "".join(parts)},
    ]


def _read_line(stdin: TextIO | None, out: TextIO) -> str | None:
    """One line of input, or None at EOF; `input()` on a terminal gives line editing."""
    if stdin is None:
        try:
            return input(PROMPT)
        except EOFError:
            return None
    out.write(PROMPT)
    out.flush()
    line = stdin.readline()
    return line.rstrip("\n") if line else None


def repl(
    session: ChatSession,
    stdin: TextIO | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    client: httpx.Client | None = None,
    banner: bool = False,
) -> int:
    """Run the conversation until /exit or EOF; 2 when the server cannot be reached."""
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(600.0, connect=5.0))
    try:
        discover_model(client, session)
        if banner:
            out.write(f"thunderpool chat · {session.url} · {session.model or 'default model'}\n")
            out.write(HELP + "\n")
        while True:
            try:
                line = _read_line(stdin, out)
            except KeyboardInterrupt:
                out.write("\n(use /exit or Ctrl-D to quit)\n")
                continue
            if line is None:
                out.write("\n")
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.reset()
                out.write("(conversation cleared)\n")
                continue
            if text.startswith("/") and text.split()[0] in ("/help", "/?"):
                out.write(HELP + "\n")
                continue
            answer(client, session, text, out)
    except Unreachable:
        err.write(f"error: cannot reach {session.url}: is `thunderpool serve` running?\n")
        return 2
    finally:
        if own:
            client.close()


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `thunderpool chat` and its options."""
    p = subparsers.add_parser("chat", help="interactive chat with a running `thunderpool serve`")
    p.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (default http://127.0.0.1:8000)",
    )
    p.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--model", help="model id (default: the server's first model)")
    p.add_argument("--system", help="system prompt for the whole conversation")
    p.add_argument("--max-tokens", type=int, help="limit on each answer's tokens")
    p.add_argument("--temperature", type=float, help="0 = greedy; default: the server's")
    p.set_defaults(func=chat_main)


def chat_main(args: argparse.Namespace) -> int:
    session = ChatSession(
        url=args.url.rstrip("/"),
        api_key=args.api_key,
        system=args.system,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        model=getattr(args, "model", None),
    )
    interactive = sys.stdin.isatty()
    return repl(session, stdin=None if interactive else sys.stdin, banner=interactive)
