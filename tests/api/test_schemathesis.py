"""Fuzzing the API against its own OpenAPI document (schemathesis, in-process over ASGI):
no request, valid or not, gets a 5xx from a ready server or hangs, and every answer (status,
media type, body, headers, SSE events, the 401 without a key) is one the document lists."""

from __future__ import annotations

import json

import anyio
import schemathesis
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from fuzz_checks import schema_valid_accepted
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, positive_data_acceptance
from starlette.types import ASGIApp, Receive, Scope, Send

from thunderpool.api import create_app
from thunderpool.api.schemas import ChatRequest, CompletionRequest
from thunderpool.engine.service import EngineStatus

KEY = "sk-fuzz-key"
CALL_TIMEOUT_S = 10.0  # a hang guard, not a timing: FakeEngine answers in microseconds
AUTH = {"Authorization": f"Bearer {KEY}"}
# Every default check, positive_data_acceptance as fuzz_checks.py narrows it: a schema cannot
# say "max_tokens within the context", so those schema-valid requests are rightly 400s.
EXCLUDED = [positive_data_acceptance]
ADDED = [schema_valid_accepted]


class FuzzEngine(FakeEngine):
    """FakeEngine answering every prompt "Hello world": fuzzed text must not happen upon the
    words ("forever", "explode", "fail") that script its deliberate failures."""

    def generate(self, prompt, params, **kwargs):
        return super().generate([ord("x")] * len(prompt), params, **kwargs)


def hang_guard(app: ASGIApp) -> ASGIApp:
    """`app`, failing any call that runs past CALL_TIMEOUT_S instead of hanging the test."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan scope lasts the whole run
            await app(scope, receive, send)
            return
        with anyio.fail_after(CALL_TIMEOUT_S):
            await app(scope, receive, send)

    return guarded


open_api = schemathesis.openapi.from_asgi("/openapi.json", hang_guard(create_app(FuzzEngine())))
keyed_api = schemathesis.openapi.from_asgi(
    "/openapi.json", hang_guard(create_app(FuzzEngine(), api_key=KEY))
)
loading = FuzzEngine()
loading.state = EngineStatus("loading", 0.5, "reading weights")
loading_api = schemathesis.openapi.from_asgi("/openapi.json", hang_guard(create_app(loading)))
# Derandomized: CI replays the same requests, so a failure reproduces; deadline=None because
# timing is not what is under test (the hang guard above is).
fuzz = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


# The other APIs (Anthropic, Ollama, Responses) get fewer examples: they share the
# Conversation behind OpenAI chat, and CI time is short.
OTHERS = r"^/(api/|v1/messages|v1/responses)"


@open_api.exclude(path_regex=OTHERS).parametrize()
@fuzz
def test_without_a_key(case):
    case.call_and_validate(excluded_checks=EXCLUDED, additional_checks=ADDED)


@open_api.include(path_regex=OTHERS).parametrize()
@settings(fuzz, max_examples=10)
def test_other_apis_without_a_key(case):
    case.call_and_validate(excluded_checks=EXCLUDED, additional_checks=ADDED)


@keyed_api.exclude(path_regex=OTHERS).parametrize()
@fuzz
def test_with_a_key(case):
    case.call_and_validate(headers=AUTH, excluded_checks=EXCLUDED, additional_checks=ADDED)


@keyed_api.include(path_regex=OTHERS).parametrize()
@settings(fuzz, max_examples=6)
def test_other_apis_with_a_key(case):
    case.call_and_validate(headers=AUTH, excluded_checks=EXCLUDED, additional_checks=ADDED)


@loading_api.exclude(path_regex=OTHERS).parametrize()
@settings(fuzz, max_examples=10)
def test_while_loading(case):
    """The 503s (and their Retry-After) are as documented too: here a 5xx is the answer."""
    case.call_and_validate(excluded_checks=[*EXCLUDED, not_a_server_error], additional_checks=ADDED)


@loading_api.include(path_regex=OTHERS).parametrize()
@settings(fuzz, max_examples=3)
def test_other_apis_while_loading(case):
    case.call_and_validate(excluded_checks=[*EXCLUDED, not_a_server_error], additional_checks=ADDED)


def test_wire_models_have_distinct_names():
    """/openapi.json keeps one schema per name: two models of one name would be documented
    (and fuzzed) as one of them."""
    from thunderpool.api.routes import WIRE_MODELS
    from thunderpool.api.schemas import ChatCompletion, ChatCompletionChunk

    seen: dict[str, dict] = {}
    for model in (ChatRequest, ChatCompletion, ChatCompletionChunk, *WIRE_MODELS):
        schema = model.model_json_schema()
        parts = {**schema.pop("$defs", {}), model.__name__: schema}
        for name, part in parts.items():
            assert seen.setdefault(name, part) == part, f"two wire models are named {name}"


def test_the_document_names_bodies_answers_and_the_key():
    client = TestClient(create_app(FakeEngine(), api_key=KEY))
    keyed = client.get("/openapi.json").json()
    bare = TestClient(create_app(FakeEngine())).get("/openapi.json").json()
    for doc, refusals in ((keyed, ["401"]), (bare, [])):
        for path, model in (
            ("/v1/chat/completions", ChatRequest),
            ("/v1/completions", CompletionRequest),
        ):
            op = doc["paths"][path]["post"]
            body = op["requestBody"]["content"]["application/json"]
            assert body["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
            answers = ["200", "400", "404", "413", "429", "503", *refusals]
            assert sorted(op["responses"]) == sorted(answers)
            assert sorted(op["responses"]["200"]["content"]) == [
                "application/json",
                "text/event-stream",
            ]
            # The examples are requests this server answers (the fuzz replays them first).
            assert sorted(body["examples"]) == ["streamed", "whole"]
            for example in body["examples"].values():
                model.model_validate(example["value"])
                r = client.post(path, json=example["value"], headers=AUTH)
                assert r.status_code == 200 and "Hello" in r.text, r.text
        assert "422" not in json.dumps(doc["paths"])
        assert "security" not in doc["paths"]["/health"]["get"]
    assert keyed["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    assert keyed["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "securitySchemes" not in bare["components"]
    assert "security" not in bare["paths"]["/v1/models"]["get"]
    assert bare["components"]["schemas"]["ChatRequest"]["required"] == ["model", "messages"]
    assert keyed["components"]["schemas"]["CompletionRequest"]["required"] == ["model", "prompt"]
