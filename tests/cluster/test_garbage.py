"""Bad input on every listening port: the agent's HTTP port, the link probe, the engine link
and the API. Garbage, truncated and oversized frames (and on the engine link, invalid messages
and wrong answers) are each refused with exactly one log line, and the server keeps serving."""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from test_control_plane import UNPICKLED, Canary, node

from thunderpool.cluster.control.agent import Agent, create_agent_app
from thunderpool.cluster.control.auth import AuthError, Identity
from thunderpool.cluster.control.client import AgentClient
from thunderpool.cluster.control.probe import ProbeServer, measure
from thunderpool.cluster.control.ranks import RankManager
from thunderpool.engine import link
from thunderpool.engine.link import LeaderServer
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta

TOKEN = "garbage-test-token"
WAIT_S = 10.0  # a hang guard for every wait below, never a timing
HTTP_GARBAGE = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not HTTP at all\r\n\r\n"
HUGE_HEADER = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1_000_000 + b"\r\n\r\n"


def http_body(path: str, length: int) -> bytes:
    """A POST whose header promises `length` body bytes, of which 10 follow."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
    return head.encode() + b"0123456789"


def exchange(port: int, data: bytes) -> bytes:
    """Send `data`, close our side, and return everything the server sent before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        # A server that refuses early resets the connection while we still send or close.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, OSError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    """What arrived before the close; Linux keeps it readable even after a reset."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass  # the server closed with our bytes unread: a refusal too
    return out


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def wait_until(ready) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.01)


def refused_once(caplog, expected: str, still_serves) -> None:
    """The refusal's log line arrives (its thread may lag the close), the server answers a
    valid request, and by then exactly one line was logged."""
    wait_until(lambda: warnings(caplog))
    still_serves()
    lines = warnings(caplog)
    assert len(lines) == 1 and expected in lines[0], lines


@contextmanager
def uvicorn_thread(app) -> Iterator[int]:
    """`app` on a real socket; uvicorn's log lines reach caplog (log_config=None, propagate)."""
    uv = logging.getLogger("uvicorn")
    propagate, uv.propagate = uv.propagate, True  # another test's uvicorn may have cut it
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off")
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not server.started and time.monotonic() < deadline:
            thread.join(0.01)
        assert server.started, "uvicorn did not start"
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()
        uv.propagate = propagate


# --- the agent's HTTP port ---------------------------------------------------------------


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[Agent, int]]:
    me = Agent(Identity("a", TOKEN, False), node("a", "127.0.0.1"), "", 0, RankManager())
    with uvicorn_thread(create_agent_app(me)) as port:
        yield me, port


# A client that hangs up mid-body is one line; a body over the limit is refused unread.
MID_BODY = "127.0.0.1 hung up after"  # 0 or 10 bytes: whether the body arrived first
HTTP_TOO_BIG = "refused a 4294967295-byte body from 127.0.0.1"
# Our side has already shut its writes: the server answers 413, unless it saw the EOF first
# and dropped the connection; either way the body is refused unread and logged once.
TOO_BIG_REPLY = b"413-or-closed"


def answered(reply: bytes, answer: bytes) -> bool:
    if answer == TOO_BIG_REPLY:
        return reply == b"" or reply.startswith(b"HTTP/1.1 413 ")
    return reply.startswith(answer) if answer else reply == b""


@pytest.mark.parametrize(
    "data, answer, expected",
    [
        (HTTP_GARBAGE, b"HTTP/1.1 400 ", "Invalid HTTP request received."),
        (http_body("/v1/hello", 1000), b"", MID_BODY),
        (http_body("/v1/hello", 0xFFFFFFFF), TOO_BIG_REPLY, HTTP_TOO_BIG),
        (HUGE_HEADER, b"HTTP/1.1 400 ", "Invalid HTTP request received."),
    ],
    ids=["garbage", "truncated", "oversized", "huge-header"],
)
def test_agent_port(agent, caplog, data, answer, expected):
    me, port = agent
    before = me.state

    def still_serves():
        state = AgentClient(f"127.0.0.1:{port}", TOKEN, timeout=WAIT_S).call("GET", "/v1/state")
        assert list(state["nodes"]) == ["a"]

    reply = exchange(port, data)
    assert answered(reply, answer), reply
    refused_once(caplog, expected, still_serves)
    assert me.state == before


def test_a_join_with_the_wrong_token_is_refused(agent, caplog):
    me, port = agent
    stranger = Agent(
        Identity("b", "not-the-token", False), node("b", "127.0.0.2"), "", 0, RankManager()
    )
    with pytest.raises(AuthError, match="wrong cluster token"):
        stranger.join(f"127.0.0.1:{port}")
    assert "b" not in me.state.nodes
    lines = warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("refused a control message from 127.0.0.1: wrong cluster token")


# --- the link probe ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def probe() -> Iterator[int]:
    server = ProbeServer("127.0.0.1", 0).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def frame(op: str, length: int, payload: bytes) -> bytes:
    return struct.pack(">IB", length, ord(op)) + payload


@pytest.mark.parametrize(
    "data, expected",
    [
        # "garb" read as a length
        (b"garbage, not a probe frame", "refused a frame (length 1734439522, op 97)"),
        (frame("Z", 4, b"abcd"), "refused a frame (length 4, op 90)"),
        (frame("E", 1000, b"0123456789"), "refused a truncated frame (10 of 1000 bytes)"),
        (b"\x00\x00", "refused a truncated header (2 bytes)"),
        (frame("E", 0xFFFFFFFF, b"0123456789"), "refused a frame (length 4294967295, op 69)"),
    ],
    ids=["garbage", "unknown-op", "truncated", "truncated-header", "oversized"],
)
def test_probe_port(probe, caplog, data, expected):
    def still_serves():
        rtt, bandwidth, _ = measure("127.0.0.1", probe, rounds=2, blob_bytes=1 << 16)
        assert rtt > 0 and bandwidth > 0

    assert exchange(probe, data) == b""
    refused_once(caplog, f"probe: {expected} from 127.0.0.1", still_serves)


# --- the engine link ---------------------------------------------------------------------


class FakeScheduler:
    """Answers each prompt with one finished delta, except HOLD, which it keeps running."""

    HOLD = 0

    def __init__(self):
        self.submitted: list[list[int]] = []
        self.cancelled: list[int] = []

    def submit(self, prompt, params, emit) -> int:
        self.submitted.append(prompt)
        if prompt[0] != self.HOLD:
            emit(Delta("hi", "stop", len(prompt), 1, tokens=(7,)))
        return 100 + len(self.submitted)

    def cancel(self, sid: int) -> None:
        self.cancelled.append(sid)


@pytest.fixture
def leader() -> Iterator[tuple[LeaderServer, FakeScheduler]]:
    scheduler = FakeScheduler()
    server = LeaderServer("127.0.0.1", TOKEN, scheduler, 64, lambda: {}).start()
    try:
        yield server, scheduler
    finally:
        server.shutdown()
        server.server_close()


def submit(id: int, prompt: list[int], **fields) -> link.Submit:
    params = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, **fields}
    return link.Submit(id=id, prompt=prompt, params=SamplingParams(**params))


def raw(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def encoded(msg) -> bytes:
    return raw(msg.model_dump_json().encode())


@contextmanager
def session(port: int) -> Iterator[socket.socket]:
    """An authenticated link, past the Info the leader sends first."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        link.answer(sock, TOKEN)
        assert isinstance(link.recv(sock, link.ToGateway), link.Info)
        yield sock


def next_delta(sock: socket.socket) -> link.DeltaMsg:
    while not isinstance(msg := link.recv(sock, link.ToGateway), link.DeltaMsg):
        pass  # metrics
    return msg


def link_serves(port: int, scheduler: FakeScheduler) -> None:
    with session(port) as sock:
        link.send(sock, submit(3, [5, 6]))
        assert next_delta(sock) == link.DeltaMsg(
            id=3, delta=Delta("hi", "stop", prompt_tokens=2, completion_tokens=1, tokens=(7,))
        )
    assert scheduler.submitted[-1] == [5, 6]


def only_a_challenge(reply: bytes) -> None:
    """The leader spoke first, sent nothing past its challenge, and closed."""
    (n,) = struct.unpack(">I", reply[:4])
    assert len(reply) == 4 + n, reply
    assert isinstance(link.ToGateway.validate_json(reply[4:]), link.Challenge)


TOO_BIG = f"over the {link.MAX_FRAME}-byte limit"


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", f"frame of 1195725856 bytes is {TOO_BIG}"),
        (raw(b"hello"), "invalid message: Invalid JSON"),
        (struct.pack(">I", 1000) + b"0123456789", "truncated frame: 10 of 1000 bytes"),
        (struct.pack(">I", 0xFFFFFFFF) + b"0123456789", f"frame of 4294967295 bytes is {TOO_BIG}"),
        # Well-formed JSON frames: not a message of the protocol, then one that fails its checks.
        (encoded(link.Metrics(values={})), "invalid message: Input tag 'metrics'"),
        (
            raw(encoded(submit(1, [1]))[4:].replace(b'"top_p":1.0', b'"top_p":5.0')),
            "invalid message: Value error, top_p=5.0 must be in (0, 1]",
        ),
        # A valid request that skips the handshake.
        (encoded(submit(1, [1])), "the peer did not answer the challenge"),
    ],
    ids=["garbage", "not-json", "truncated", "oversized", "wrong-kind", "invalid", "no-auth"],
)
def test_link_refuses_before_the_handshake(leader, caplog, data, expected):
    server, scheduler = leader
    only_a_challenge(exchange(server.port, data))
    refused_once(
        caplog,
        f"engine link: refused a connection from 127.0.0.1: {expected}",
        lambda: link_serves(server.port, scheduler),
    )
    assert scheduler.submitted == [[5, 6]]  # only the valid session's


def test_link_refuses_a_wrong_token(leader, caplog):
    server, scheduler = leader
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        link.answer(sock, "not-the-token")
        with contextlib.suppress(OSError):  # the leader may have closed already
            link.send(sock, submit(1, [1]))
        assert read_all(sock) == b""  # no Info, no delta: closed
    refused_once(
        caplog,
        "engine link: refused a connection from 127.0.0.1: the peer did not answer the challenge "
        "with the link token",
        lambda: link_serves(server.port, scheduler),
    )
    assert scheduler.submitted == [[5, 6]]


def test_link_drops_a_peer_that_never_answers(leader, caplog, monkeypatch):
    server, scheduler = leader
    monkeypatch.setattr(link, "AUTH_TIMEOUT_S", 0.2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        only_a_challenge(read_all(sock))  # the leader closes; we never said a word
    refused_once(
        caplog,
        "engine link: refused a connection from 127.0.0.1: timed out",
        lambda: link_serves(server.port, scheduler),
    )
    assert scheduler.submitted == [[5, 6]]


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"garbage!", f"frame of 1734439522 bytes is {TOO_BIG}"),
        (raw(pickle.dumps(Canary())), "invalid message: Invalid JSON"),
        (struct.pack(">I", 1000) + b"0123456789", "truncated frame: 10 of 1000 bytes"),
        (struct.pack(">I", 0xFFFFFFFF), f"frame of 4294967295 bytes is {TOO_BIG}"),
        (
            raw(b'{"kind": "pickle", "data": "gASVAAAAAAAAAAB9lC4="}'),
            "invalid message: Input tag 'pickle'",
        ),
    ],
    ids=["garbage", "pickle", "truncated", "oversized", "unknown-kind"],
)
def test_link_drops_a_session_after_a_bad_frame(leader, caplog, data, expected):
    """A bad frame mid-session ends that session and cancels its running requests."""
    server, scheduler = leader
    UNPICKLED.clear()
    with session(server.port) as sock:
        link.send(sock, submit(1, [FakeScheduler.HOLD]))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        read_all(sock)
    refused_once(
        caplog,
        f"engine link: dropped 127.0.0.1 after a bad frame: {expected}",
        lambda: link_serves(server.port, scheduler),
    )
    wait_until(lambda: 101 in scheduler.cancelled)
    assert 101 in scheduler.cancelled  # the held request's scheduler id
    assert UNPICKLED == []


# --- the API port ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api() -> Iterator[int]:
    # FakeEngine lives with the API tests.
    sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
    try:
        from fake_engine import FakeEngine
    finally:
        sys.path.pop(0)

    from thunderpool.api import create_app

    with uvicorn_thread(create_app(FakeEngine())) as port:
        yield port


@pytest.mark.parametrize(
    "data, answer, expected",
    [
        (HTTP_GARBAGE, b"HTTP/1.1 400 ", "Invalid HTTP request received."),
        (http_body("/v1/chat/completions", 1000), b"", MID_BODY),
        (http_body("/v1/chat/completions", 0xFFFFFFFF), TOO_BIG_REPLY, HTTP_TOO_BIG),
        (HUGE_HEADER, b"HTTP/1.1 400 ", "Invalid HTTP request received."),
    ],
    ids=["garbage", "truncated", "oversized", "huge-header"],
)
def test_api_port(api, caplog, data, answer, expected):
    def still_serves():
        r = httpx.get(f"http://127.0.0.1:{api}/health", timeout=WAIT_S)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})

    reply = exchange(api, data)
    assert answered(reply, answer), reply
    refused_once(caplog, expected, still_serves)
