"""Tool calling at the API edge: the splitter that finds calls in streamed text, the JSON
schema a forced call must match, and the chat template seeing tools and tool results."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from mlx_lm.tool_parsers import json_tools
from mlx_lm.utils import load_tokenizer
from tool_engine import CALL_PIECES, WEATHER_TOOL, ToolEngine, qwen_tokenizer_dir

from thunderpool.api import create_app
from thunderpool.api.errors import APIError
from thunderpool.api.schemas import ChatRequest
from thunderpool.api.structured import forced_tools
from thunderpool.api.tools import Call, Text, ToolSplitter, call_schema, forced_call
from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.service import Delta

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def split(pieces: list[str]) -> list[Text | Call]:
    s = ToolSplitter("<tool_call>", "</tool_call>", json_tools.parse_tool_call, [WEATHER_TOOL])
    out = [ev for p in pieces for ev in s.feed(p)] + s.finish()
    # Merge adjacent texts and blank call ids: what a client would assemble.
    merged: list[Text | Call] = []
    for ev in out:
        if isinstance(ev, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + ev.text)
        else:
            merged.append(Call("", ev.name, ev.arguments) if isinstance(ev, Call) else ev)
    return merged


WEATHER = Call("", "get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("cut", [1, 3, 11, 12, 40, len(CALL) - 3])
def test_a_call_cut_anywhere_is_found_whole(cut):
    text = "Sure. " + CALL + " Done."
    for at in range(1, len(text), cut):
        pieces = [text[:at], text[at:]]
        assert split(pieces) == [Text("Sure. "), WEATHER, Text(" Done.")], pieces


def test_text_that_looks_like_a_marker_start_is_released():
    assert split(["a <tool", "s are fine", " <to"]) == [Text("a <tools are fine <to")]


def test_two_calls_and_a_truncated_or_broken_one():
    assert split([CALL, CALL]) == [WEATHER, WEATHER]
    # Cut off by max_tokens: no end marker, text that does not parse comes back as text.
    assert split(['<tool_call>\n{"name": "get_we']) == [Text('<tool_call>\n{"name": "get_we')]
    # No end marker but complete JSON (families without an end marker end this way).
    assert split([CALL.removesuffix("</tool_call>")]) == [WEATHER]
    assert split(["<tool_call>not json</tool_call>"]) == [Text("<tool_call>not json</tool_call>")]


def forced(tools: list, choice) -> dict:
    request = ChatRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice
    )
    return call_schema(forced_tools(request))


def test_call_schema_accepts_the_forced_call_only():
    other = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    tools = [WEATHER_TOOL, other]
    named = forced(tools, {"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, named)
    for bad in (
        {"name": "now", "arguments": {}},
        {"name": "get_weather", "arguments": {}},  # "city" is required
        {"name": "get_weather"},
        {"name": "get_weather", "arguments": {"city": "Paris"}, "extra": 1},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    anyone = forced(tools, "required")
    jsonschema.validate({"name": "now", "arguments": {}}, anyone)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, anyone)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "later", "arguments": {}}, anyone)
    assert forced([WEATHER_TOOL], "required") == named  # one tool: no anyOf
    # What constrained decoding would emit for it reads back as the call; cut short, as None.
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    call = forced_call(text)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert forced_call(text[:-3]) is None
    with pytest.raises(APIError, match="not in tools"):
        forced(tools, {"type": "function", "function": {"name": "later"}})
    with pytest.raises(APIError, match="needs a non-empty 'tools'"):
        forced([], "required")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return ToolEngine(load_tokenizer(qwen_tokenizer_dir(tmp_path_factory.mktemp("qwen"))))


def chat(client, **body):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Weather?"}], **body}
    return client.post("/v1/chat/completions", json=body)


def test_tools_and_results_reach_the_chat_template(engine):
    client = TestClient(create_app(engine))
    r = chat(client, tools=[WEATHER_TOOL])
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.calls[-1][0])
    assert json.dumps(WEATHER_TOOL) in prompt  # the template's `tools | tojson`
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]
    r = chat(client, tools=[WEATHER_TOOL], messages=history)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    prompt = engine.tokenizer.decode(engine.calls[-1][0])
    expected = (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.endswith(expected), prompt
    # tool_choice "none": the tools stay out of the prompt, the model answers in text.
    r = chat(client, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    assert "get_weather" not in engine.tokenizer.decode(engine.calls[-1][0])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "sometimes"}, "tool_choice", "'auto', 'none', 'required'"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0", "only tools of type 'function'"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools.0",
            "non-empty string 'name'",
        ),
    ],
)
def test_refusals_name_the_parameter(engine, body, param, words):
    client = TestClient(create_app(engine))
    r = chat(client, **{"tools": [WEATHER_TOOL], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_a_model_without_a_tool_format_refuses_tools_naming_its_family():
    fake = FakeEngine()
    fake.info.cluster["model_type"] = "llama"
    r = chat(TestClient(create_app(fake)), tools=[WEATHER_TOOL])
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools"
    assert "'fake-model' (family 'llama')" in r.json()["error"]["message"]
    # Without tools, earlier tool turns still go into (this model's) template.
    history = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    r = chat(TestClient(create_app(fake)), messages=history)
    assert r.status_code == 200 and fake.tokenizer.decode(fake.calls[-1][0]) == (
        "<assistant>\n<tool>42\n<assistant>"
    )
    # A forced call (constrained decoding, tests/api/test_structured.py) needs tools; "none"
    # with tools needs no tool format.
    r = chat(TestClient(create_app(fake)), tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = chat(TestClient(create_app(fake)), tools=[WEATHER_TOOL], tool_choice="none")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello world"
    r = chat(TestClient(create_app(fake)), messages=[{"role": "tool", "content": "42"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.tool_call_id"


class LoggedToolEngine(ToolEngine):
    """ToolEngine whose deltas carry one token each with its logprob (token i: -0.5 * i)."""

    async def _pieces(self, prompt, pieces):
        for i, p in enumerate(pieces):
            yield Delta(p, tokens=(i + 1,), logprobs=(TokenLogprob(i + 1, -0.5 * i),))
        yield Delta("", "stop", len(prompt), len(pieces))


def test_n_and_logprobs_ride_the_tool_path(engine):
    """One pipeline: n choices and logprobs hold with "auto" tools too, collected and streamed;
    the parser holds text back, the logprobs still come one per token, in order."""
    client = TestClient(create_app(engine))
    r = chat(client, tools=[WEATHER_TOOL], n=2, seed=7)
    assert r.status_code == 200, r.text
    picks = r.json()["choices"]
    assert [c["index"] for c in picks] == [0, 1]
    for c in picks:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
        [call] = c["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    seeds = [p.seed for _, p in engine.calls[-2:]]
    assert sorted(seeds) == [7, 8]  # each choice its own seed
    assert r.json()["usage"]["completion_tokens"] == 2 * len(CALL_PIECES)

    logged = LoggedToolEngine(engine.tokenizer)
    client = TestClient(create_app(logged))
    r = chat(client, tools=[WEATHER_TOOL], logprobs=True)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [x["logprob"] for x in content] == [-0.5 * i for i in range(len(CALL_PIECES))]
    assert [x["token"] for x in content] == [engine.tokenizer.decode([i + 1]) for i in range(4)]
    r = chat(client, tools=[WEATHER_TOOL], logprobs=True, n=2, stream=True)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line[6:].startswith("{")]
    for i in (0, 1):
        mine = [c for e in events for c in e["choices"] if c["index"] == i]
        got = [x["logprob"] for c in mine if c.get("logprobs") for x in c["logprobs"]["content"]]
        assert got == [-0.5 * k for k in range(len(CALL_PIECES))]
        calls = [t for c in mine for t in (c["delta"].get("tool_calls") or [])]
        assert [t["function"]["name"] for t in calls] == ["get_weather"]
        assert mine[-1]["finish_reason"] == "tool_calls"
    assert r.text.rstrip().endswith("data: [DONE]")
