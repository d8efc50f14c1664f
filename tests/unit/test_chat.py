"""`thunderpool chat` against a local fake server that streams SSE like the real API."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from thunderpool.cli.chat import ChatSession, add_chat_parser, repl


class FakeServer:
    """Answers `echo: <last user message>` one word per SSE event, and records each request."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.cancelled = threading.Event()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/chat/completions")(self.complete)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    async def complete(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        last = body["messages"][-1]["content"]
        if last == "overload":
            error = {"message": "cluster is loading", "type": "server_error", "code": 503}
            return JSONResponse({"error": error}, status_code=503)
        words = ["echo:", *last.split()]
        if last == "long":
            words = [f"w{i}" for i in range(200)]
        return StreamingResponse(self.events(words), media_type="text/event-stream")

    async def events(self, words: list[str]):
        try:
            for i, word in enumerate(words):
                piece = word if i == 0 else " " + word
                chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {}}]}
                chunk["choices"][0]["delta"] = {"role": "assistant", "content": piece}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.02)
            yield 'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\n'
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
def server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake.app, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_conversation_streams_and_keeps_history(server):
    fake, url = server
    session = ChatSession(url=url, api_key="k1", system="be brief", max_tokens=16, temperature=0)
    stdin = io.StringIO("hello there\n\nsecond turn\n/reset\nfresh\n")
    out, err = io.StringIO(), io.StringIO()

    assert repl(session, stdin=stdin, out=out, err=err) == 0

    assert out.getvalue() == (
        "> echo: hello there\n> > echo: second turn\n> (conversation cleared)\n> echo: fresh\n> \n"
    )
    assert err.getvalue() == ""
    assert len(fake.bodies) == 3
    first, second, third = fake.bodies
    assert first == {
        "model": "tiny-model",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there"},
        ],
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
    }
    assert second["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "echo: hello there"},
        {"role": "user", "content": "second turn"},
    ]
    assert third["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "fresh"},
    ]
    assert all(h["authorization"] == "Bearer k1" for h in fake.headers)


def test_exit_command_stops_before_more_input(server):
    fake, url = server
    out = io.StringIO()
    assert repl(ChatSession(url=url), stdin=io.StringIO("hi\n/exit\nnever sent\n"), out=out) == 0
    assert out.getvalue() == "> echo: hi\n> "
    assert [b["messages"][-1]["content"] for b in fake.bodies] == ["hi"]


def test_server_error_is_one_line_and_the_repl_goes_on(server):
    fake, url = server
    out = io.StringIO()
    assert repl(ChatSession(url=url), stdin=io.StringIO("overload\nok\n"), out=out) == 0
    assert out.getvalue() == ("> error: server answered 503: cluster is loading\n> echo: ok\n> \n")
    # The failed turn is not part of the history.
    assert fake.bodies[1]["messages"] == [{"role": "user", "content": "ok"}]


class InterruptAfter(io.StringIO):
    """An output whose Nth token write raises KeyboardInterrupt, as Ctrl-C would."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def write(self, s: str) -> int:
        if s.startswith(" w") or s == "w0":
            self.left -= 1
            if self.left < 0:
                self.left = 10**9  # interrupt once
                raise KeyboardInterrupt
        return super().write(s)


def test_ctrl_c_stops_the_answer_closes_the_stream_and_returns_to_the_prompt(server):
    fake, url = server
    out = InterruptAfter(3)
    assert repl(ChatSession(url=url), stdin=io.StringIO("long\nafter\n"), out=out) == 0

    assert out.getvalue() == "> w0 w1 w2 [stopped]\n> echo: after\n> \n"
    assert fake.cancelled.wait(5), "the server kept generating after the client stopped"
    # The partial answer the user saw stays in the history.
    assert fake.bodies[1]["messages"] == [
        {"role": "user", "content": "long"},
        {"role": "assistant", "content": "w0 w1 w2"},
        {"role": "user", "content": "after"},
    ]


def test_unreachable_server_prints_one_line_and_exits_2():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens on this port now
    out, err = io.StringIO(), io.StringIO()
    assert repl(ChatSession(url=url), stdin=io.StringIO("hi\n"), out=out, err=err) == 2
    assert err.getvalue() == f"error: cannot reach {url}: is `thunderpool serve` running?\n"
    assert out.getvalue() == ""


def test_chat_subcommand_options():
    parser = argparse.ArgumentParser(prog="thunderpool")
    add_chat_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["chat", "--url", "http://127.0.0.1:9", "--api-key", "K", "--system", "S"]
        + ["--max-tokens", "5", "--temperature", "0.5"]
    )
    assert (args.command, args.url, args.api_key, args.system) == (
        "chat",
        "http://127.0.0.1:9",
        "K",
        "S",
    )
    assert (args.max_tokens, args.temperature, args.model) == (5, 0.5, None)
    defaults = parser.parse_args(["chat"])
    assert (defaults.url, defaults.api_key, defaults.max_tokens) == (
        "http://127.0.0.1:8000",
        None,
        None,
    )
