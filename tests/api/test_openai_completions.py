"""Chat and text completions over a fake engine: exact bodies, what reaches the engine
(template, sampling fields), and SSE framing."""

from __future__ import annotations

import pytest
from fake_engine import MODEL, chat_text
from openai_wire import HI_TOKENS, NOT_CACHED, USAGE, chat, chunks, fixture_client, fixture_engine  # noqa: F401 (fixtures)

from thunderpool.engine.sampling import SamplingParams


def test_chat_non_streamed(client, engine):
    r = chat(client)
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    del body["id"], body["created"]
    assert body == {
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello world"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": USAGE,
        "system_fingerprint": None,
    }
    prompt, params = engine.calls[0]
    assert prompt == [ord(c) for c in chat_text(("user", "Hi"))]
    # Default max_tokens is the rest of the context; OpenAI's sampling defaults apply.
    assert params == SamplingParams(max_tokens=256 - HI_TOKENS, temperature=1.0, top_p=1.0)


def test_chat_template_gets_system_developer_and_text_parts(client, engine):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "No jokes."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Hi"},
    ]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    expected = chat_text(
        ("system", "Be brief."),
        ("system", "No jokes."),
        ("user", "a\nb"),
        ("assistant", "ok"),
        ("user", "Hi"),
    )
    assert engine.tokenizer.decode(engine.calls[0][0]) == expected
    assert r.json()["usage"]["prompt_tokens"] == len(expected)


def test_sampling_fields_pass_through(client, engine):
    r = chat(client, max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, seed=11, stop="\n")
    assert r.status_code == 200, r.text
    r = chat(client, max_completion_tokens=6, max_tokens=99, stop=["END", "###"], n=1)
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stop": ["a"]})
    assert r.status_code == 200, r.text
    assert [p for _, p in engine.calls] == [
        SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=4, seed=11, stop=("\n",)),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0, stop=("END", "###")),
        SamplingParams(max_tokens=255, temperature=1.0, top_p=1.0, stop=("a",)),
    ]


def test_sampling_surface_passes_through(client, engine):
    r = chat(
        client,
        max_tokens=5,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias={"12": -100, "3": 2},
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_object"},
    )
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 4}
    )
    assert r.status_code == 200, r.text
    assert [p for _, p in engine.calls] == [
        SamplingParams(
            max_tokens=5,
            temperature=1.0,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            repetition_penalty=1.1,
            min_p=0.05,
            logit_bias=((3, 2.0), (12, -100.0)),
            logprobs=True,
            top_logprobs=2,
            json_schema='{"type": "object"}',
        ),
        SamplingParams(max_tokens=3, temperature=1.0, logprobs=True, top_logprobs=4),
    ]


def test_unknown_fields_are_refused_and_annotations_accepted(client):
    r = chat(client, user="u1", metadata={"k": "v"}, store=False, response_format={"type": "text"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "Hello world"
    for field, value in (("reasoning_effort", "high"), ("functions", []), ("store", True)):
        r = chat(client, **{field: value})
        assert r.status_code == 400, field
        assert field in r.json()["error"]["message"]


def test_max_tokens_reached_is_length(client):
    r = chat(client, max_tokens=1)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["message"]["content"] == "Hello"
    assert (
        r.json()["usage"]
        == {
            "prompt_tokens": HI_TOKENS,
            "completion_tokens": 1,
            "total_tokens": HI_TOKENS + 1,
        }
        | NOT_CACHED
    )


@pytest.mark.parametrize("prompt", ["Say hi", ["Say hi"]])
def test_completion_non_streamed(client, engine, prompt):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-")
    del body["id"], body["created"]
    assert body == {
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "Hello world", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8} | NOT_CACHED,
        "system_fingerprint": None,
    }
    assert engine.calls[0][0] == [ord(c) for c in "Say hi"]


def test_chat_streamed_sse_framing(client):
    r = chat(client, stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    got = chunks(r.text)
    ids = {c.pop("id") for c in got}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert len({c.pop("created") for c in got}) == 1
    head = {"object": "chat.completion.chunk", "model": MODEL, "system_fingerprint": None}

    def chunk(delta, finish=None):
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**head, "choices": [choice], "usage": None}

    assert got == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hello"}),
        chunk({"content": " world"}),
        chunk({}, "stop"),
    ]


def test_stream_include_usage_adds_a_final_usage_chunk(client):
    r = chat(client, stream=True, stream_options={"include_usage": True})
    got = chunks(r.text)
    assert [c["usage"] for c in got[:-1]] == [None] * 4
    assert got[-1]["choices"] == [] and got[-1]["usage"] == USAGE
    assert got[-2]["choices"][0]["finish_reason"] == "stop"


def test_completion_streamed(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Say hi",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    got = chunks(r.text)
    assert {c["object"] for c in got} == {"text_completion"}
    assert [c["choices"] for c in got] == [
        [{"index": 0, "text": "Hello", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": " world", "finish_reason": None, "logprobs": None}],
        [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}],
        [],
    ]
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    assert got[-1]["usage"] == usage | NOT_CACHED
