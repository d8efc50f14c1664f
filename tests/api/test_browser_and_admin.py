"""What no client can do: drive a local server from another site's page (a foreign Host: DNS
rebinding; a foreign Origin: a cross-site POST), use the admin endpoints without a
credential, or end `serve` by asking for replans."""

from __future__ import annotations

import stat
import threading
import time

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from thunderpool.api import create_app
from thunderpool.serving import admin, supervisor
from thunderpool.serving.admin import mount_admin, write_admin_token

BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}


def client(**kw) -> TestClient:
    app = create_app(FakeEngine(), bind_host="127.0.0.1", **kw)
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize(
    "host,status",
    [
        ("127.0.0.1:8000", 200),
        ("localhost:8000", 200),
        ("[::1]:8000", 200),
        ("192.168.1.20:8000", 200),  # an IP literal cannot be rebound
        ("attacker.example:8000", 400),  # its name now resolving to 127.0.0.1
        ("attacker.example", 400),
        ("", 400),
    ],
)
def test_a_foreign_host_is_refused(host, status):
    r = client().get("/v1/models", headers={"host": host})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "invalid_host"
        assert "--allowed-host" in r.json()["error"]["message"]


def test_allowed_host_names_pass():
    c = client(allowed_hosts=["llm.internal", "*.corp.example"])
    for host in ("llm.internal", "LLM.internal:443", "gpu.corp.example"):
        assert c.get("/v1/models", headers={"host": host}).status_code == 200, host
    assert c.get("/v1/models", headers={"host": "corp.example.evil"}).status_code == 400


def test_a_post_from_another_sites_page_is_refused():
    c = client()
    page = {"origin": "http://attacker.example"}
    r = c.post("/v1/completions", json=BODY, headers=page)
    assert r.status_code == 403 and r.json()["error"]["code"] == "foreign_origin"
    assert "--cors-origin http://attacker.example" in r.json()["error"]["message"]
    # The form POST a page sends without a preflight; and a sandboxed page's "null".
    r = c.post("/v1/completions", data={"x": "1"}, headers={"origin": "null"})
    assert r.status_code == 403
    # Another local port is another site too.
    r = c.post("/v1/completions", json=BODY, headers={"origin": "http://127.0.0.1:3000"})
    assert r.status_code == 403
    # Reading is not changing state; this server's own page and non-browser clients pass.
    assert c.get("/v1/models", headers=page).status_code == 200
    assert c.post("/v1/completions", json=BODY).status_code == 200
    own = {"origin": "http://127.0.0.1:8000"}
    assert c.post("/v1/completions", json=BODY, headers=own).status_code == 200


def test_a_cors_origin_may_post():
    c = client(cors_origins=["http://localhost:3000"])
    r = c.post("/v1/completions", json=BODY, headers={"origin": "http://localhost:3000"})
    assert r.status_code == 200


class Replans:
    generation = 1

    def __init__(self):
        self.asked = 0

    def request_replan(self) -> bool:
        self.asked += 1
        return self.asked > 1


def test_admin_needs_a_credential_even_on_localhost(tmp_path, monkeypatch):
    monkeypatch.setenv("THUNDERPOOL_HOME", str(tmp_path))
    token, path = write_admin_token(8000)
    assert path == admin.admin_token_file(8000) and path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    app = create_app(FakeEngine(), bind_host="127.0.0.1")
    replans = Replans()
    mount_admin(app, replans, token, api_key=None)
    c = TestClient(app, base_url="http://127.0.0.1:8000")
    assert c.post("/v1/admin/replan").status_code == 401
    assert c.post("/v1/admin/replan", headers={"authorization": "Bearer nope"}).status_code == 401
    ok = {"authorization": f"Bearer {token}"}
    assert c.post("/v1/admin/replan", headers=ok).json() == {
        "replanning": True, "instance": 1, "pending": False}  # fmt: skip
    assert c.post("/v1/admin/replan", headers=ok).json()["pending"] is True
    assert replans.asked == 2
    assert "/v1/admin/replan" not in c.get("/openapi.json").json()["paths"]
    # --api-key is a credential too; the token stays one.
    app = create_app(FakeEngine(), api_key="k")
    mount_admin(app, replans, token, api_key="k")
    c = TestClient(app)
    assert c.post("/v1/admin/replan", headers={"authorization": "Bearer k"}).status_code == 202
    assert c.post("/v1/admin/replan", headers=ok).status_code == 202


class FakeInstance:
    """Loads for `load_s`, then serves until interrupted."""

    leader_host = "127.0.0.1"

    def __init__(self, load_s: float):
        self.load_s, self._stop = load_s, threading.Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def interrupt(self):
        self._stop.set()

    def events(self):
        from types import SimpleNamespace

        time.sleep(self.load_s)
        yield SimpleNamespace(rank=0, event={"kind": "ready", "link_port": 1})
        self._stop.wait(30)


def test_requested_replans_never_end_serve(monkeypatch):
    # Before: each replan interrupted the (loading) instance and counted as a failed start,
    # and the fourth in a row ended serve.
    from rich.console import Console

    from thunderpool.serving.gateway import Gateway

    started = []

    def plan(first):
        started.append(FakeInstance(0.2))
        return started[-1]

    gateway = Gateway(FakeEngine().info, None, "t")
    monkeypatch.setattr(gateway, "attach", lambda host, port: None)
    sup = supervisor.Supervisor(gateway, plan, Console(file=open("/dev/null", "w")))
    errors = []
    runner = threading.Thread(target=lambda: _run(sup, errors), daemon=True)
    runner.start()
    for _ in range(12):  # while loading, while serving, while draining
        sup.request_replan()
        time.sleep(0.07)
    deadline = time.monotonic() + 10
    while not sup._serving and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.is_alive() and not errors and sup._serving
    assert 2 <= len(started) <= 6  # a replan while one is pending is the same replan
    sup.stop()


def _run(sup, errors):
    try:
        sup.run()
    except Exception as e:  # noqa: BLE001 - the test asserts there is none
        errors.append(e)


# --- limits: one client's running generations, the body size -----------------------------


@pytest.fixture()
def limited():
    import socket

    import uvicorn

    engine = FakeEngine()
    app = create_app(engine, max_concurrent_per_key=2)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):  # hang guard only
        if server.started:
            break
        thread.join(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_one_clients_running_requests_are_limited(limited):
    import httpx

    forever = {"model": "fake-model", "prompt": "forever", "max_tokens": 100, "stream": True}
    key = {"authorization": "Bearer a"}
    with httpx.Client(base_url=limited, timeout=30) as c:
        with (
            c.stream("POST", "/v1/completions", json=forever, headers=key) as one,
            c.stream("POST", "/v1/completions", json=forever, headers=key) as two,
        ):
            assert one.status_code == two.status_code == 200
            r = c.post("/v1/completions", json=BODY, headers=key)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_requests"
            assert "--max-concurrent-per-key" in r.json()["error"]["message"]
            # Each API answers in its own error format.
            msg = {"model": "fake-model", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            r = c.post("/v1/messages", json=msg, headers=key)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            r = c.post("/api/generate", json={"model": "fake-model", "prompt": "hi"}, headers=key)
            assert r.status_code == 429 and "error" in r.json()
            # Another key, or no key (its address), is another client.
            assert c.post("/v1/completions", json=BODY, headers={"x-api-key": "b"}).is_success
            assert c.post("/v1/completions", json=BODY).is_success
            assert c.get("/v1/models", headers=key).is_success  # only generation counts
        # A closed stream frees its place, once the server has seen the client leave.
        deadline = time.monotonic() + 10
        while (r := c.post("/v1/completions", json=BODY, headers=key)).status_code == 429:
            assert time.monotonic() < deadline, "the closed streams still count"
            time.sleep(0.05)
        assert r.status_code == 200


def test_a_body_past_the_limit_is_413_and_documented():
    r = client().post(
        "/v1/completions",
        content=b"x" * (16 << 20 | 1),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    doc = client().get("/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/api/chat"):
        assert {"413", "429"} <= set(doc[path]["post"]["responses"]), path
    assert "retry-after" in {
        h.lower() for h in doc["/v1/completions"]["post"]["responses"]["429"]["headers"]
    }
