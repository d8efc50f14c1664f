"""Control plane without sockets: the pure reducer, HMAC signing, and the agent's refusals."""

from __future__ import annotations

import json
import logging
import pickle
import time

import pytest
from fastapi.testclient import TestClient

from thunderpool import __version__
from thunderpool.cluster.control.agent import Agent, create_agent_app
from thunderpool.cluster.control.auth import (
    NONCE_HEADER,
    SIG_HEADER,
    TS_HEADER,
    AuthError,
    Identity,
    NonceCache,
    load_identity,
    sign,
    verify,
)
from thunderpool.cluster.control.messages import Hello, Interface, Left, LinkMeasured, NodeInfo
from thunderpool.cluster.control.ranks import RankManager
from thunderpool.cluster.control.state import ClusterState, apply


def node(node_id: str, address: str, version: str = __version__) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        name=f"host-{node_id}",
        port=7070,
        version=version,
        mlx_version="0.32",
        python_version="3.11",
        os="Linux",
        chip="cpu",
        cpu_count=2,
        memory_total_bytes=2**34,
        memory_available_bytes=2**33,
        interfaces=(Interface(name="eth0", address=address, kind="ethernet"),),
    )


def link(a: str, b: str, rtt: float, bw: float = 1e9, addr: str = "10.0.0.2") -> LinkMeasured:
    return LinkMeasured(
        a=a, b=b, a_address="10.0.0.1", b_address=addr, rtt_s=rtt, bandwidth_Bps=bw, link="ethernet"
    )


def test_membership_and_links_follow_the_messages():
    s = apply(ClusterState(), Hello(node=node("a", "10.0.0.1"), contact="10.0.0.1:7070"))
    s = apply(s, Hello(node=node("b", "10.0.0.2"), contact="10.0.0.2:7070"))
    assert sorted(s.nodes) == ["a", "b"] and s.epoch == 2
    assert s.unprobed_pairs() == [("a", "b")]
    s = apply(s, link("a", "b", 0.002))
    assert s.link("b", "a").rtt_s == 0.002 and s.unprobed_pairs() == []
    # A slower path does not replace the faster one; a much faster one does.
    s = apply(s, link("a", "b", 0.009, addr="192.168.1.2"))
    assert s.link("a", "b").rtt_s == 0.002
    s = apply(s, link("a", "b", 0.0001, addr="169.254.0.2"))
    assert s.link("a", "b").b_address == "169.254.0.2"
    # Same hello again: nothing to re-probe. New addresses: its links are dropped.
    assert apply(s, Hello(node=node("b", "10.0.0.2"))).link("a", "b") is not None
    moved = apply(s, Hello(node=node("b", "10.0.0.9")))
    assert moved.link("a", "b") is None and moved.epoch == s.epoch + 1
    gone = apply(s, Left(node_id="b"))
    assert list(gone.nodes) == ["a"] and gone.links == {} and "b" not in gone.contacts
    # Links to unknown nodes are ignored.
    assert apply(gone, link("a", "b", 0.001)).links == {}


def test_a_stale_copy_never_overwrites_a_newer_self_report():
    """A node re-reports its addresses with a newer revision (doctor --fix addressed a
    cable); a peer relaying the copy it kept from before changes nothing."""
    old = node("b", "10.0.0.2").model_copy(update={"revision": 5})
    new = node("b", "10.0.0.9").model_copy(update={"revision": 7})
    s = apply(ClusterState(), Hello(node=old, contact="10.0.0.2:7070"))
    s = apply(s, Hello(node=new))
    assert s.nodes["b"].interfaces[0].address == "10.0.0.9"
    assert apply(s, Hello(node=old)).nodes["b"] == new


def test_an_agent_takes_new_network_facts_and_tells_its_peers(monkeypatch):
    told = []
    monkeypatch.setattr(
        "thunderpool.cluster.control.agent.AgentClient",
        lambda contact, token: type("C", (), {"call": lambda s, *a, **k: told.append(contact)})(),
    )
    me = Agent(
        Identity("a", "secret", False), node("a", "10.0.0.1"), "10.0.0.1:7070", 7071, RankManager()
    )
    me.accept(Hello(node=node("b", "10.0.0.2"), contact="10.0.0.2:7070"))
    before = me.info.revision
    assert not me.refresh(node("a", "10.0.0.1")) and told == []
    assert me.refresh(
        node("a", "10.0.0.1").model_copy(update={"interfaces": node("a", "10.0.5.1").interfaces})
    )
    assert me.info.revision > before and me.state.nodes["a"].interfaces[0].address == "10.0.5.1"
    assert told == ["10.0.0.2:7070"]


def test_signatures_verify_and_refuse():
    body = b'{"x": 1}'
    headers = sign("secret", "POST", "/v1/hello", body, ts=1000.0)
    verify("secret", "POST", "/v1/hello", body, headers, now=1010.0)
    for token, method, path, other in (
        ("other", "POST", "/v1/hello", body),
        ("secret", "POST", "/v1/hello", b'{"x": 2}'),
        ("secret", "POST", "/v1/start", body),  # re-aimed at another path
        ("secret", "GET", "/v1/hello", body),  # or another method
        ("secret", "POST", "/v1/hello?x=1", body),  # or another query
    ):
        with pytest.raises(AuthError, match="wrong cluster token"):
            verify(token, method, path, other, headers, now=1010.0)
    with pytest.raises(AuthError, match="stale"):
        verify("secret", "POST", "/v1/hello", body, headers, now=2000.0)
    with pytest.raises(AuthError, match="unsigned"):
        verify("secret", "POST", "/v1/hello", body, {}, now=1000.0)
    forged = {**headers, NONCE_HEADER: "another-nonce"}
    with pytest.raises(AuthError, match="wrong cluster token"):
        verify("secret", "POST", "/v1/hello", body, forged, now=1010.0)
    nonces = NonceCache()
    verify("secret", "POST", "/v1/hello", body, headers, nonces, now=1010.0)
    with pytest.raises(AuthError, match="replayed"):
        verify("secret", "POST", "/v1/hello", body, headers, nonces, now=1011.0)


def test_token_is_generated_once_then_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("THUNDERPOOL_TOKEN", raising=False)
    first = load_identity(home=tmp_path)
    again = load_identity(home=tmp_path)
    assert first.created and not again.created
    assert (first.token, first.node_id) == (again.token, again.node_id)
    assert oct((tmp_path / "identity.json").stat().st_mode & 0o777) == "0o600"
    assert load_identity("given", home=tmp_path).token == "given"


@pytest.fixture
def agent_client():
    agent = Agent(
        Identity("a", "secret", False), node("a", "10.0.0.1"), "10.0.0.1:7070", 7071, RankManager()
    )
    return TestClient(create_agent_app(agent)), agent


def post(client, path: str, body: bytes, token: str | None):
    headers = sign(token, "POST", path, body) if token else {}
    return client.post(path, content=body, headers=headers)


def test_agent_accepts_a_signed_hello_and_refuses_the_rest(agent_client):
    client, agent = agent_client
    hello = Hello(node=node("b", "10.0.0.2"), contact="10.0.0.2:7070").model_dump_json().encode()
    assert post(client, "/v1/hello", hello, None).status_code == 401
    r = post(client, "/v1/hello", hello, "wrong")
    assert r.status_code == 401 and "wrong cluster token" in r.json()["detail"]
    assert "b" not in agent.state.nodes
    r = post(client, "/v1/hello", hello, "secret")
    assert r.status_code == 200 and sorted(r.json()["nodes"]) == ["a", "b"]
    assert agent.state.contacts["b"] == "testclient:7070"  # the address packets came from


def test_agent_refuses_another_version_naming_both(agent_client):
    client, agent = agent_client
    old = Hello(node=node("c", "10.0.0.3", version="0.0.1")).model_dump_json().encode()
    r = post(client, "/v1/hello", old, "secret")
    assert r.status_code == 409
    assert __version__ in r.json()["detail"] and "0.0.1" in r.json()["detail"]
    assert "c" not in agent.state.nodes


def test_agent_refuses_malformed_messages(agent_client):
    client, _ = agent_client
    for body in (b"garbage", b"{}", json.dumps({"kind": "hello", "node": 5}).encode()):
        r = post(client, "/v1/hello", body, "secret")
        assert r.status_code == 400, body
    assert client.get("/v1/state").status_code == 401


def test_agent_refuses_stale_unsigned_and_forged_messages_once_each(agent_client, caplog):
    client, agent = agent_client
    hello = Hello(node=node("b", "10.0.0.2")).model_dump_json().encode()
    cases = {
        "stale control message": sign("secret", "POST", "/v1/hello", hello, ts=time.time() - 1000),
        "unsigned control message": {},
        "bad timestamp 'soon'": {TS_HEADER: "soon", SIG_HEADER: "00", NONCE_HEADER: "n"},
        "wrong cluster token": sign("secret", "POST", "/v1/hello", b"{}"),  # another body
    }
    for why, headers in cases.items():
        caplog.clear()
        r = client.post("/v1/hello", content=hello, headers=headers)
        assert r.status_code == 401 and r.json()["detail"].startswith(why), r.text
        lines = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
        assert lines == [f"refused a control message from testclient: {r.json()['detail']}"]
    assert "b" not in agent.state.nodes


def test_a_captured_request_replayed_or_re_aimed_is_refused(agent_client):
    client, agent = agent_client
    hello = Hello(node=node("b", "10.0.0.2"), contact="10.0.0.2:7070").model_dump_json().encode()
    headers = sign("secret", "POST", "/v1/hello", hello)
    assert client.post("/v1/hello", content=hello, headers=headers).status_code == 200
    r = client.post("/v1/hello", content=hello, headers=headers)  # verbatim, seconds later
    assert r.status_code == 401 and r.json()["detail"].startswith("replayed"), r.text
    fresh = sign("secret", "POST", "/v1/hello", hello)
    r = client.post("/v1/start", content=hello, headers=fresh)  # same body, another path
    assert r.status_code == 401 and "wrong cluster token" in r.json()["detail"]
    state = sign("secret", "GET", "/v1/state")
    assert client.get("/v1/state", headers=state).status_code == 200
    other_query = sign("secret", "GET", "/v1/state")
    assert client.get("/v1/state?x=1", headers=other_query).status_code == 401


UNPICKLED: list[str] = []


def _unpickled() -> None:
    UNPICKLED.append("unpickled")


class Canary:
    """Unpickling this calls `_unpickled`, so a peer that ran pickle.loads would be seen."""

    def __reduce__(self):
        return _unpickled, ()


def test_agent_never_unpickles_a_body(agent_client):
    client, agent = agent_client
    UNPICKLED.clear()
    payload = pickle.dumps(Canary())
    for path in ("/v1/hello", "/v1/probe", "/v1/start", "/v1/stop"):
        r = post(client, path, payload, "secret")
        assert r.status_code == 400 and r.json()["detail"].startswith("invalid message"), path
        assert post(client, path, payload, None).status_code == 401
    assert UNPICKLED == [] and list(agent.state.nodes) == ["a"]
    pickle.loads(payload)  # the canary works: this is what the agent never did
    assert UNPICKLED == ["unpickled"]


def test_node_specs_carry_the_calibrated_fixed_costs():
    """Live plans pay the simulator's per-matmul cost and per-row cost (by chip) and
    per-collective cost (by link kind), as presets.toml states them, not zero."""
    from thunderpool.cluster.control.coordinator import node_specs
    from thunderpool.planner.presets import presets

    cal = presets()["calibration"]
    ultra = node("b", "10.0.0.2").model_copy(update={"chip": "Apple M3 Ultra"})
    s = apply(ClusterState(), Hello(node=node("a", "10.0.0.1"), contact="10.0.0.1:7070"))
    s = apply(s, Hello(node=ultra, contact="10.0.0.2:7070"))
    s = apply(s, link("a", "b", 0.002))
    nodes, links = node_specs(s)
    by_name = {n.name: n.op_latency_s for n in nodes}
    assert by_name == pytest.approx(
        {"a": cal["op_latency_us"]["cpu"] * 1e-6, "b": cal["op_latency_us"]["m3-ultra"] * 1e-6}
    )
    rows = cal["row_op_latency_us"]
    assert [n.row_op_latency_s for n in nodes] == [rows["cpu"] * 1e-6, rows["m3-ultra"] * 1e-6]
    reads = cal["row_read_fraction"]
    assert [n.row_read_fraction for n in nodes] == [reads["cpu"], reads["m3-ultra"]]
    assert links[0].overhead_s == pytest.approx(cal["collective_overhead_us"]["tcp"] * 1e-6)
    rdma = apply(s, link("a", "b", 1e-5).model_copy(update={"link": "rdma"}))
    assert node_specs(rdma)[1][0].overhead_s == pytest.approx(
        cal["collective_overhead_us"]["rdma"] * 1e-6
    )


def test_a_measured_op_latency_replaces_the_calibrated_one():
    from thunderpool.cluster.control.coordinator import node_specs

    measured = node("a", "10.0.0.1").model_copy(update={"op_latency_s": 4e-5})
    s = apply(ClusterState(), Hello(node=measured, contact="10.0.0.1:7070"))
    assert node_specs(s)[0][0].op_latency_s == 4e-5


def test_node_specs_carry_the_pinned_core_rates():
    """What one pinned core reaches, as the agent measured it, reaches the planner unchanged."""
    from thunderpool.cluster.control.coordinator import node_specs

    pinned = node("a", "10.0.0.1").model_copy(
        update={
            "core_mem_bw_Bps": 3.5e9,
            "core_flops": 7e10,
            "core_op_latency_s": 5e-5,
            "host_mem_bw_Bps": 9e9,
            "short_row_mem_bw_Bps": 2e9,
        }
    )
    s = apply(ClusterState(), Hello(node=pinned, contact="10.0.0.1:7070"))
    (spec,), _ = node_specs(s)
    got = (spec.core_mem_bw_Bps, spec.core_flops, spec.host_mem_bw_Bps, spec.short_row_mem_bw_Bps)
    assert got == (3.5e9, 7e10, 9e9, 2e9)
    assert spec.core_op_latency_s == 5e-5


def test_agents_on_one_machine_share_their_lowest_host_bandwidth():
    """Each agent of a machine measured its bus; the planner gives all of them the lowest."""
    from thunderpool.cluster.control.coordinator import node_specs

    s = ClusterState()
    for name, address, host, bw in (
        ("a", "10.0.0.1", "boot-1", 34e9),
        ("b", "10.0.0.2", "boot-1", 50e9),  # its processes did not overlap fully
        ("c", "10.0.0.3", "boot-2", 60e9),
    ):
        info = node(name, address).model_copy(update={"host_id": host, "host_mem_bw_Bps": bw})
        s = apply(s, Hello(node=info, contact=f"{address}:7070"))
    nodes, _ = node_specs(s)
    assert {n.name: n.host_mem_bw_Bps for n in nodes} == {"a": 34e9, "b": 34e9, "c": 60e9}


def test_join_waits_for_a_seed_that_is_not_up_yet_but_not_for_a_refusal():
    """Nodes started together: the seed may still be measuring. A seed that does not answer
    is retried until it does; a refusal ends the join at once."""
    from thunderpool.cluster.control.agent import join_all
    from thunderpool.cluster.control.client import AgentError, AgentUnreachable

    class Joiner:
        def __init__(self, failures):
            self.failures, self.calls = list(failures), 0

        def join(self, seed):
            self.calls += 1
            if self.failures:
                raise self.failures.pop(0)
            return [seed]

    said = []
    late = Joiner([AgentUnreachable("nothing listening")] * 2)
    join_all(late, ["10.0.0.1:7070"], wait_s=30, say=said.append)
    assert late.calls == 3 and said == ["waiting up to 30 s for 10.0.0.1:7070 to answer"]
    refused = Joiner([AgentError("wrong version")])
    with pytest.raises(AgentError, match="cannot join through 10.0.0.1:7070: wrong version"):
        join_all(refused, ["10.0.0.1:7070"], wait_s=30, say=said.append)
    assert refused.calls == 1
    gone = Joiner([AgentUnreachable("nothing listening")] * 100)
    with pytest.raises(AgentError, match="nothing listening"):
        join_all(gone, ["10.0.0.1:7070"], wait_s=0, say=said.append)
    assert gone.calls == 1
