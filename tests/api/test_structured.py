"""Structured output and the sampling surface through the HTTP API: on a real `serve` of the
embedded SmolLM2 (one rank), every json_schema answer validates, forced tool calls parse, n
greedy choices agree (numbers are bounded where the 135M model would write digits until
max_tokens: a valid prefix, never a finished answer); on a real engine in this process (a
tiny model with SmolLM2's tokenizer), logprobs equal the unsharded model's log_softmax."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from local_engine import LocalEngine
from serving import serving

from thunderpool.api.routes import create_app

pytestmark = pytest.mark.reference

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"],
    },
    {"type": "string", "pattern": "^[A-Z][a-z]{2,5}$"},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {"type": "integer", "minimum": 10, "maximum": 99},
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 15},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        },
        "required": ["city", "zip"],
    },
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "maximum": 999},
                    "y": {"type": "integer", "maximum": 999},
                },
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {"type": "null"},
    {"type": "object", "properties": {"answer": {"const": "yes"}}, "required": ["answer"]},
    {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 6}, {"type": "integer", "maximum": 99}],
        "items": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 5}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "v": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/v"}},
        "required": ["a"],
    },
    {"type": "boolean"},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title", "year"],
    },
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def server():
    """`thunderpool serve` of the embedded model on one rank (its rank gets the fast BLAS)."""
    with serving("--nodes", "1", "--max-context", "1024") as served:
        yield served.url


@pytest.fixture(scope="module")
def local(tiny_chat):
    engine = LocalEngine(tiny_chat)
    yield engine
    engine.close()


def post_all(target, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies sent at once, so the engine batches them (each row its own matcher).
    `target`: a server's URL, or a LocalEngine (then the app runs in this process)."""

    async def go():
        if isinstance(target, str):
            client = httpx.AsyncClient(base_url=target)
        else:
            transport = httpx.ASGITransport(app=create_app(target))
            client = httpx.AsyncClient(transport=transport, base_url="http://t")
        async with client as c:
            return await asyncio.gather(*(c.post(path, json=b, timeout=900) for b in bodies))

    return asyncio.run(go())


MODEL = "SmolLM2-135M-Instruct-f32"


def chat_body(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.slow
def test_twenty_json_schemas_validate(server):
    bodies = [
        chat_body(
            "Reply in JSON.",
            temperature=0,
            max_tokens=48,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": s, "strict": True},
            },
        )
        for i, s in enumerate(SCHEMAS)
    ]
    failed = []
    for schema, r in zip(SCHEMAS, post_all(server, "/v1/chat/completions", bodies), strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        try:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError):
            failed.append((schema, choice["finish_reason"], text))
    assert not failed, failed


@pytest.mark.slow
def test_json_object_and_forced_tool_calls(server):
    ask = "What is the weather in Paris? Also add 2 and 3."
    named = {"type": "function", "function": {"name": "add"}}
    bodies = [
        chat_body(
            'Reply with a JSON object with one key, "name", for a cat.',
            temperature=0,
            max_tokens=96,
            response_format={"type": "json_object"},
        ),
        chat_body(ask, temperature=0, max_tokens=48, tools=TOOLS, tool_choice="required"),
        chat_body(ask, temperature=0.8, seed=3, max_tokens=48, tools=TOOLS, tool_choice=named),
    ]
    obj, required, forced = post_all(server, "/v1/chat/completions", bodies)
    assert obj.status_code == 200, obj.text
    choice = obj.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for r, names in ((required, set(params)), (forced, {"add"})):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), params[call["function"]["name"]]
        )


@pytest.mark.slow
def test_streamed_tool_call(server):
    body = chat_body(
        "Add 2 and 3.",
        temperature=0,
        max_tokens=40,
        tools=TOOLS,
        tool_choice="required",
        stream=True,
    )
    (r,) = post_all(server, "/v1/chat/completions", [body])
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events]
    calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    json.loads(calls[0][0]["function"]["arguments"])
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_logprobs_equal_the_models_log_softmax(local):
    """Chat and completions logprobs (and top_logprobs) against a full forward of the
    unsharded model over prompt + answer, fp32, within 1e-4."""
    prompt = "The capital of France is"
    chat = chat_body(prompt, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    comp = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 6, "logprobs": 2}
    (r_chat,) = post_all(local, "/v1/chat/completions", [chat])
    (r_comp,) = post_all(local, "/v1/completions", [comp])
    tok = local.tokenizer
    chat_ids = tok.apply_chat_template(chat["messages"], add_generation_prompt=True)
    content = r_chat.json()["choices"][0]["logprobs"]["content"]
    lp = r_comp.json()["choices"][0]["logprobs"]
    for ids, entries in (
        (
            chat_ids,
            [
                (c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                for c in content
            ],
        ),
        (tok.encode(prompt), list(zip(lp["token_logprobs"], lp["top_logprobs"], strict=True))),
    ):
        ref = reference_logprobs(local, list(ids), len(entries))
        for (chosen, tops), (ref_chosen, ref_top) in zip(entries, ref, strict=True):
            assert abs(chosen - ref_chosen) < 1e-4
            want = {tok.decode([t]): v for t, v in ref_top[: len(tops)]}
            assert tops.keys() == want.keys()
            assert all(abs(tops[k] - want[k]) < 1e-4 for k in tops)


def test_streamed_logprobs_equal_collected(local):
    body = chat_body("Hello", temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    (whole,) = post_all(local, "/v1/chat/completions", [body])
    (r,) = post_all(local, "/v1/chat/completions", [{**body, "stream": True}])
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    streamed = [
        e
        for ev in events
        for c in ev["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    assert streamed == whole.json()["choices"][0]["logprobs"]["content"]
    assert len(streamed) == 5


def reference_logprobs(local, prompt: list[int], steps: int):
    """Greedy continuation by full forwards (no cache): (chosen logprob, top pairs) per step."""
    model, seq, out = local.runner.model, list(prompt), []
    for _ in range(steps):
        logits = np.array(model(mx.array([seq]))[0, -1].astype(mx.float32), dtype=np.float64)
        lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        t = int(lp.argmax())
        top = [(int(i), float(lp[i])) for i in np.argsort(-lp)[:5]]
        out.append((float(lp[t]), top))
        seq.append(t)
    return out


@pytest.mark.slow
def test_n_greedy_choices_are_identical(server):
    """n = 3 greedy choices, with logprobs carried over the engine link: identical."""
    body = chat_body("Name a color.", temperature=0, max_tokens=8, n=3, logprobs=True)
    (r,) = post_all(server, "/v1/chat/completions", [body])
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["message"]["content"] for c in choices]
    assert texts[0] and len(set(texts)) == 1
    logprobs = [c["logprobs"]["content"] for c in choices]
    # Same tokens; values within float noise (rows joined the batch at different steps).
    for lp in logprobs[1:]:
        assert [e["token"] for e in lp] == [e["token"] for e in logprobs[0]]
        np.testing.assert_allclose(
            [e["logprob"] for e in lp], [e["logprob"] for e in logprobs[0]], atol=1e-4
        )
    assert "".join(e["token"] for e in logprobs[0]) == texts[0]
    eos = choices[0]["finish_reason"] == "stop"  # the EOS token has no logprob entry
    assert r.json()["usage"]["completion_tokens"] == 3 * (len(logprobs[0]) + eos)


@pytest.mark.slow
def test_unenforceable_schema_is_400(server):
    bad = {"type": "string", "minLength": 3, "maxLength": 2}
    body = chat_body("x", response_format={"type": "json_schema", "json_schema": {"schema": bad}})
    (r,) = post_all(server, "/v1/chat/completions", [body])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "minLength (3) is greater" in err["message"]
