"""`thunderpool serve` for real: 2 TP ranks on the embedded model behind the HTTP API.

Continuous batching must not change greedy outputs: 8 concurrent requests get exactly the
text they get one at a time. A client that disconnects stops its generation.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from serving import serving

pytestmark = pytest.mark.reference
MODEL = "SmolLM2-135M-Instruct-f32"
ORIGIN = "http://localhost:3000"

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What do bees make?",
    "Which planet is known as the red planet?",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def served():
    args = ["--nodes", "2", "--parallel", "tp", "--max-context", "1024", "--cors-origin", ORIGIN]
    with serving(*args) as served:
        yield served


@pytest.fixture(scope="module")
def server(served):
    return served.url


def chat(url: str, question: str, stream: bool = False, max_tokens: int = 16) -> str:
    body = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        "stream": stream,
    }
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices:
                    text += choices[0]["delta"].get("content") or ""
    return text


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_eight_concurrent_requests_equal_one_at_a_time(server):
    alone = [chat(server, q) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda iq: chat(server, iq[1], stream=iq[0] % 2 == 0), enumerate(QUESTIONS))
        )
    assert together == alone
    assert "Paris" in alone[0]


def test_official_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    plain = client.chat.completions.create(
        model="SmolLM2-135M-Instruct-f32",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
    )
    chunks = client.chat.completions.create(
        model="SmolLM2-135M-Instruct-f32",
        max_tokens=12,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.choices[0].message.content == streamed == chat(server, QUESTIONS[0], max_tokens=12)
    assert plain.usage.completion_tokens == 12 or plain.choices[0].finish_reason == "stop"


def test_disconnect_stops_generation(server):
    before = metric(server, "thunderpool_tokens_generated_total")
    body = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 60
    while metric(server, "thunderpool_active_requests") > 0:
        assert time.monotonic() < deadline, "the cancelled request kept running"
        time.sleep(0.2)
    assert metric(server, "thunderpool_tokens_generated_total") - before < 100
    # The cluster still answers correctly afterwards.
    assert "Paris" in chat(server, QUESTIONS[0])


def test_cluster_view_and_errors(server):
    cluster = httpx.get(f"{server}/v1/cluster", timeout=10).json()
    assert len(cluster["nodes"]) == 2
    assert cluster["placement"]["parallel"] == "tp"
    heads = [r["heads"]["q"] for r in cluster["placement"]["ranks"]]
    assert heads == [[0, 6], [6, 9]]  # SmolLM2's 9 heads split as 3 KV groups: 2 + 1
    too_long = {
        "model": "SmolLM2-135M-Instruct-f32",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "word " * 2000}],
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=too_long, timeout=30)
    assert r.status_code == 400 and "1024" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions", json={**too_long, "model": "nope"}, timeout=30)
    assert r.status_code == 404


def test_every_api_gives_the_same_greedy_text(server):
    """OpenAI chat, Responses, Anthropic Messages and Ollama chat/generate put the same prompt
    through the same template, so greedy decoding gives the same tokens, streamed or not."""
    import anthropic
    import ollama
    import openai

    q, n = QUESTIONS[0], 16
    oa = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    ask = [{"role": "user", "content": q}]
    ref = oa.chat.completions.create(model=MODEL, max_tokens=n, temperature=0, messages=ask)
    text = ref.choices[0].message.content
    k, k_in = ref.usage.completion_tokens, ref.usage.prompt_tokens
    # It ends with its end token: each API's own word for that is checked below.
    assert text == "The capital of France is Paris." and ref.choices[0].finish_reason == "stop"

    r = oa.responses.create(model=MODEL, input=q, max_output_tokens=n, temperature=0)
    assert r.output_text == text and r.status == "completed"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.usage.prompt_tokens, k)
    events = oa.responses.create(
        model=MODEL, input=q, max_output_tokens=n, temperature=0, stream=True
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text

    # This SDK has no sampling arguments (its API dropped them); the server still takes them.
    an = anthropic.Anthropic(base_url=server, api_key="unused")
    greedy = {"extra_body": {"temperature": 0}}
    m = an.messages.create(model=MODEL, max_tokens=n, messages=ask, **greedy)
    assert m.content[0].text == text and m.stop_reason == "end_turn"
    assert (m.usage.input_tokens, m.usage.output_tokens) == (ref.usage.prompt_tokens, k)
    assert an.messages.count_tokens(model=MODEL, messages=ask).input_tokens == k_in
    m = an.messages.create(model=MODEL, max_tokens=3, messages=ask, **greedy)
    assert text.startswith(m.content[0].text) and m.stop_reason == "max_tokens"
    with an.messages.stream(model=MODEL, max_tokens=n, messages=ask, **greedy) as s:
        assert "".join(s.text_stream) == text
    # A stop sequence cuts the same text and is named as the reason.
    m = an.messages.create(
        model=MODEL, max_tokens=n, messages=ask, stop_sequences=["Paris"], **greedy
    )
    assert m.content[0].text == text[: text.index("Paris")]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "Paris")

    ol = ollama.Client(host=server)
    greedy = {"temperature": 0, "num_predict": n}  # Ollama's own default is 0.8
    assert ol.chat(model=MODEL, messages=ask, options=greedy).message.content == text
    parts = ol.chat(model=MODEL, messages=ask, options=greedy, stream=True)
    assert "".join(p.message.content for p in parts) == text
    g = ol.generate(model=MODEL, prompt=q, options=greedy)
    assert g.response == text and g.done_reason == "stop" and g.eval_count == k
    parts = ol.generate(model=MODEL, prompt=q, options=greedy, stream=True)
    assert "".join(p.response for p in parts) == text


def test_tools_are_refused_for_a_template_without_them_and_cors(server):
    import openai

    oa = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="family 'llama'"):
        oa.chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], tools=[tool]
        )
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{server}/v1/chat/completions", headers=ask, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(
        f"{server}/v1/chat/completions", headers={**ask, "Origin": "http://other.test"}, timeout=10
    )
    assert "access-control-allow-origin" not in r.headers


def test_a_browser_page_cannot_drive_it(server):
    port = server.rsplit(":", 1)[1]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    # A page on another site, its name rebound to 127.0.0.1 (DNS rebinding) ...
    rebound = {"host": f"attacker.example:{port}"}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=rebound, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    # ... or posting a form to localhost from its own origin.
    page = {"origin": "http://attacker.example"}
    r = httpx.post(f"{server}/v1/admin/replan", data={"x": "1"}, headers=page, timeout=30)
    assert r.status_code == 403
    r = httpx.post(f"{server}/v1/completions", json=body, headers=page, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "foreign_origin"
    ok = httpx.post(f"{server}/v1/completions", json=body, headers={"origin": ORIGIN}, timeout=60)
    assert ok.status_code == 200  # a --cors-origin may


def test_requests_cannot_stop_it(served):
    # Before: replan needed no key on localhost, counted as a failed start, and the fourth
    # POST in a row ended serve.
    url = served.url
    assert httpx.post(f"{url}/v1/admin/replan", timeout=30).status_code == 401
    from thunderpool.serving.admin import admin_token_file

    path = admin_token_file(int(url.rsplit(":", 1)[1]))  # serve's and this test's home alike
    assert str(path) in served.log.read_text().replace("\n", "")
    auth = {"authorization": f"Bearer {path.read_text().strip()}"}
    before = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instance"]["generation"]
    for _ in range(5):
        assert httpx.post(f"{url}/v1/admin/replan", headers=auth, timeout=30).status_code == 202
        time.sleep(0.2)
    deadline = time.monotonic() + 240
    while True:
        assert served.proc.poll() is None, served.log.read_text()[-2000:]
        assert time.monotonic() < deadline, served.log.read_text()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                now = httpx.get(f"{url}/v1/cluster", timeout=30).json()["instance"]
                if now["generation"] > before:
                    break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    assert chat(url, QUESTIONS[0]) and served.proc.poll() is None
    assert "/v1/admin/replan" not in httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"]


def test_vllm_length_controls_match_transformers(server, smollm2_transformers):
    """vLLM's ignore_eos and min_tokens (what guidellm and `vllm bench serve` send) against
    transformers' model decoding greedily with the same rule (with its own KV cache)."""
    import torch
    from mlx_lm.utils import load_tokenizer

    from thunderpool.models.source import resolve_model

    model, _, _, _ = smollm2_transformers
    ours = load_tokenizer(resolve_model(None, progress=False))
    ask = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = list(ours.apply_chat_template(ask, add_generation_prompt=True))
    eos = set(ours.eos_token_ids)

    # transformers 5.x names the KV cache `cache` (`past_key_values` before, now deprecated).
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def greedy(n: int, min_new: int = 0, stop_at_eos: bool = False) -> list[int]:
        out: list[int] = []
        ids, past = torch.tensor([prompt]), None  # transformers' own KV cache, fp32
        with torch.no_grad():
            for step in range(n):
                o = model(ids, **{kv: past}, use_cache=True)
                logits, past = o.logits[0, -1], getattr(o, kv)
                if step < min_new:
                    logits[sorted(eos)] = -torch.inf
                out.append(int(logits.argmax()))
                ids = torch.tensor([[out[-1]]])
                if stop_at_eos and out[-1] in eos:
                    break
        return out

    def text(tokens: list[int]) -> str:  # an end token shows no text (vLLM's)
        return ours.decode([t for t in tokens if t not in eos])

    def ask_for(**extra) -> dict:
        body = {"model": MODEL, "messages": ask, "temperature": 0, **extra}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    plain = ask_for(max_tokens=40)
    k = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and k < 20
    # ignore_eos: on past the end token to max_tokens.
    got = ask_for(max_tokens=k + 6, ignore_eos=True)
    assert got["usage"]["completion_tokens"] == k + 6
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["choices"][0]["message"]["content"] == text(greedy(k + 6))
    # min_tokens: no end token before min_tokens tokens; then the first one ends it.
    ref = greedy(k + 12, min_new=k + 3, stop_at_eos=True)
    got = ask_for(max_tokens=k + 12, min_tokens=k + 3)
    assert got["choices"][0]["message"]["content"] == text(ref)
    assert got["choices"][0]["finish_reason"] == ("stop" if ref[-1] in eos else "length")
    assert got["usage"]["completion_tokens"] == len(ref) >= k + 3
    # continuous_usage_stats: every chunk carries its usage so far (with include_usage).
    body = {"model": MODEL, "messages": ask, "temperature": 0, "max_tokens": k + 6,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    counts = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                assert c["usage"]["prompt_tokens"] == len(prompt)
                counts.append(c["usage"]["completion_tokens"])
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == k + 6
    r = httpx.post(f"{server}/v1/chat/completions", json={**body, "min_tokens": 99}, timeout=30)
    assert r.status_code == 400 and "min_tokens=99" in r.json()["error"]["message"]


GUIDELLM = os.environ.get("THUNDERPOOL_GUIDELLM", "/opt/guidellm/bin/guidellm")


@pytest.mark.timeout(300)
def test_guidellm_runs_unchanged(server, tmp_path):
    """vLLM's load generator, with its defaults (streamed, ignore_eos to fix output lengths,
    continuous usage), a short concurrent sweep: 0 errors, every output the length asked."""
    if not Path(GUIDELLM).is_file():
        if os.environ.get("THUNDERPOOL_REQUIRE_TOOLS"):
            pytest.fail(f"{GUIDELLM} is missing; .ci/run installs guidellm there")
        pytest.skip(f"guidellm is not installed at {GUIDELLM} (see .ci/run)")
    from thunderpool.models.source import resolve_model

    out = tmp_path / "guidellm.json"
    cmd = [
        GUIDELLM, "run",
        "--backend", f"kind=openai_http,target={server}",
        "--tokenizer", f"kind=huggingface_auto,model={resolve_model(None, progress=False)}",
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", "1,4",
        "--constraint", "kind=max_requests,count=8",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--output", f"kind=json,path={out}", "--disable-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert len(benchmarks) == 2  # one per concurrency level
    for b in benchmarks:
        totals = b["metrics"]["request_totals"]
        assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
        assert totals["successful"] == 8
        assert b["metrics"]["output_token_count"]["successful"]["total_sum"] == 8 * 16
