"""The official `openai`, `anthropic` and `ollama` clients against the API, in-process over a
real socket, with a tool-capable fake engine (tool_engine.py): text and tool calls, streamed
and not, tool results sent back, and the refusals each API's client surfaces."""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest
import uvicorn
from mlx_lm.utils import load_tokenizer
from tool_engine import WEATHER_TOOL, ToolEngine, qwen_tokenizer_dir

from thunderpool.api import create_app

MODEL = "fake-model"
ORIGIN = "http://localhost:3000"
ARGS = {"city": "Paris"}
WEATHER = WEATHER_TOOL["function"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return ToolEngine(load_tokenizer(qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen"))))


@pytest.fixture(scope="module")
def url(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, cors_origins=[ORIGIN])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_openai_chat_tool_calls_streamed_and_not(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS and call.id.startswith("call_")

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="auto", stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert text == "Let me check." and [c.choices[0].finish_reason for c in chunks][-1] == (
        "tool_calls"
    )
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", ARGS)
    ]
    # The result goes back as a `tool` message; the model answers from it.
    history = [*ask, choice.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"


def test_openai_responses_text_and_function_calls(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    r = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.")
    assert r.output_text == "Hello world" and r.status == "completed"
    assert (r.usage.output_tokens, r.usage.total_tokens) == (2, r.usage.input_tokens + 2)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["parameters"]}
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool])
    [msg, call] = r.output
    assert msg.content[0].text == "Let me check."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        ARGS,
    )
    events = list(
        client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Let me check."
    )
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == ARGS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    # The call and its output go back as input items.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    r = client.responses.create(model=MODEL, input=history, tools=[tool])
    assert r.output_text == "It is sunny."
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")


def test_anthropic_messages_text_and_tool_use(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    ask = [{"role": "user", "content": "Hi"}]
    r = client.messages.create(model=MODEL, max_tokens=8, messages=ask, system="Be brief.")
    assert [b.text for b in r.content] == ["Hello world"] and r.stop_reason == "end_turn"
    assert r.usage.output_tokens == 2
    count = client.messages.count_tokens(model=MODEL, messages=ask, system="Be brief.")
    assert count.input_tokens == r.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ask) as s:
        assert "".join(s.text_stream) == "Hello world"
        assert s.get_final_message().stop_reason == "end_turn"

    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["parameters"]}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.messages.create(model=MODEL, max_tokens=64, messages=ask, tools=[tool])
    assert r.stop_reason == "tool_use"
    [text, use] = r.content
    assert text.text == "Let me check." and (use.name, use.input) == ("get_weather", ARGS)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ask, tools=[tool]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == ARGS and final.stop_reason == "tool_use"
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    r = client.messages.create(model=MODEL, max_tokens=64, messages=history, tools=[tool])
    assert r.content[0].text == "It is sunny."
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=ask,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    with pytest.raises(anthropic.NotFoundError, match="serves 'fake-model'"):
        client.messages.create(model="claude-x", max_tokens=8, messages=ask)


def test_ollama_chat_generate_and_model_listing(url):
    client = ollama.Client(host=url)
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert r.message.content == "Hello world" and r.done and r.eval_count == 2
    parts = list(
        client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
    )
    assert "".join(p.message.content for p in parts) == "Hello world"
    assert [p.done for p in parts][-1] is True and parts[-1].done_reason == "stop"
    r = client.generate(model=f"{MODEL}:latest", prompt="Hi", options={"temperature": 0})
    assert r.response == "Hello world"
    streamed = "".join(p.response for p in client.generate(model=MODEL, prompt="Hi", stream=True))
    assert streamed == "Hello world"

    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat(model=MODEL, messages=ask, tools=[WEATHER_TOOL])
    [call] = r.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", ARGS)
    parts = list(client.chat(model=MODEL, messages=ask, tools=[WEATHER_TOOL], stream=True))
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", ARGS)]
    history = [*ask, r.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    assert client.chat(model=MODEL, messages=history, tools=[WEATHER_TOOL]).message.content == (
        "It is sunny."
    )

    assert [m.model for m in client.list().models] == [MODEL]
    show = client.show(MODEL)
    assert "tools" in show.capabilities and "<tool_call>" in show.template
    assert httpx.get(f"{url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError, match="mirostat") as e:
        client.chat(model=MODEL, messages=ask, options={"mirostat": 1})
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="not found") as e:
        client.chat(model="llama3", messages=ask)
    assert e.value.status_code == 404


def test_cors_preflight_only_for_allowed_origins(url):
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        r = httpx.options(f"{url}{path}", headers={"Origin": ORIGIN, **ask})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.options(f"{url}{path}", headers={"Origin": "http://evil.test", **ask})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{url}/v1/models", headers={"Origin": "http://evil.test"})
    assert "access-control-allow-origin" not in r.headers


def test_the_key_is_checked_in_each_api_s_own_error_shape(engine):
    from fastapi.testclient import TestClient

    client = TestClient(create_app(engine, api_key="sk-k"))
    msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    r = client.post("/v1/messages", json=msg, headers={"x-api-key": "sk-k"})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello world"
    r = client.post("/v1/messages", json=msg, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    chat = {"model": MODEL, "stream": False, "messages": msg["messages"]}
    r = client.post("/api/chat", json=chat)
    assert r.status_code == 401 and "API key" in r.json()["error"]
    r = client.post("/api/chat", json=chat, headers={"Authorization": "Bearer sk-k"})
    assert r.status_code == 200 and r.json()["message"]["content"] == "Hello world"
    r = client.post("/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/api/version").status_code == 200  # open, as Ollama's is


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking"),
        (
            "/v1/messages",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}],
                    }
                ]
            },
            "messages.0.content",
        ),
        (
            "/v1/messages",
            {
                "tool_choice": {"type": "any"},
                "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            },
            "tool_choice",
        ),
        ("/api/chat", {"format": "json"}, "format"),
        ("/api/chat", {"think": True}, "think"),
        ("/api/chat", {"options": {"num_gpu": 1}}, "options.num_gpu"),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "messages.0.images",
        ),
        ("/api/generate", {"suffix": "}"}, "suffix"),
        ("/api/generate", {"context": [1, 2]}, "context"),
        ("/v1/responses", {"reasoning": {"effort": "low"}}, "reasoning"),
        ("/v1/responses", {"store": True}, "store"),
        ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, "text.format"),
        (
            "/v1/responses",
            {"tool_choice": "required", "tools": [{"type": "function", "name": "f"}]},
            "tool_choice",
        ),
    ],
)
def test_each_api_refuses_what_it_cannot_honour_naming_it(engine, path, body, param):
    from fastapi.testclient import TestClient

    base = {
        "/v1/messages": {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}],
        },
        "/api/chat": {
            "model": MODEL,
            "stream": False,
            "messages": [{"role": "user", "content": "Hi"}],
        },
        "/api/generate": {"model": MODEL, "stream": False, "prompt": "Hi"},
        "/v1/responses": {"model": MODEL, "input": "Hi"},
    }[path]
    r = TestClient(create_app(engine)).post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    # Ollama's errors are one string, which names the parameter in full.
    assert (param if isinstance(error, str) else param.split(".")[0]) in message, message
    if path == "/v1/responses":
        assert error["param"].startswith(param)


def test_ollama_raw_generate_skips_the_template(engine):
    from fastapi.testclient import TestClient

    body = {"model": MODEL, "stream": False, "raw": True, "prompt": "Once upon"}
    r = TestClient(create_app(engine)).post("/api/generate", json=body)
    assert r.json()["response"] == "Hello world"
    assert engine.tokenizer.decode(engine.calls[-1][0]) == "Once upon"
    body = {"model": MODEL, "stream": False, "system": "Be brief.", "prompt": "Once upon"}
    TestClient(create_app(engine)).post("/api/generate", json=body)
    assert engine.tokenizer.decode(engine.calls[-1][0]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOnce upon<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
