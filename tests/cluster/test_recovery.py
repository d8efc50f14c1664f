"""Node loss on the namespace testbed: `serve --cluster` survives a killed rank, a killed agent
and a cut cable, and a node that comes back rejoins without disturbing the running instance.

Three hosts, a two-node PP instance (the namespaces share two cores, so the planner allows two
ranks at most): after a loss there is always a plan for two on the nodes left.

Each loss happens in the middle of a streaming request, with a second request queued behind
it (--max-batch 1). The stream must end with an error event and a closed connection; a request
sent during recovery gets 503 with Retry-After; the queued request is run after recovery with
exactly the text it gets alone; no rank of the lost instance is left on any host.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, cluster_serve, healthy, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

TOKEN = "recovery-token-123"
API_PORT = 18431
URL = f"http://127.0.0.1:{API_PORT}"
LONG = "Tell me a very long story about the sea."
SHORT = "Name three colors."


def workers(bed: Testbed, i: int) -> set[int]:
    """Rank processes running inside host i's namespace."""
    out = subprocess.run(
        ["ip", "netns", "pids", bed.host(i).netns], capture_output=True, text=True
    ).stdout
    pids = set()
    for pid in out.split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"thunderpool.rank" in cmd:
            pids.add(int(pid))
    return pids


def all_workers(bed: Testbed) -> set[int]:
    return set().union(*(workers(bed, i) for i in (1, 2, 3)))


def complete(prompt: str, max_tokens: int = 24) -> str:
    r = httpx.post(
        f"{URL}/v1/completions",
        json={"model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def cluster_info() -> dict:
    return httpx.get(f"{URL}/v1/cluster", timeout=10).json()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_chat):
    home = tmp_path_factory.mktemp("recovery")
    with Testbed(3) as bed:
        first = f"{bed.host(1).ip}:{PORT}"
        agents = {
            1: bed.popen(1, node_cmd(bed, 1, home, "--token", TOKEN), stderr=subprocess.DEVNULL)
        }
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _known(coord) == 1, timeout=60, interval=0.5)
        for i in (2, 3):
            agents[i] = bed.popen(
                i,
                node_cmd(bed, i, home, "--token", TOKEN, "--join", first),
                stderr=subprocess.DEVNULL,
            )
        assert wait_until(lambda: _known(coord) == 3, timeout=60, interval=0.5)
        args = ("--join", first, "--token", TOKEN, "--model", str(tiny_chat), "--parallel", "pp")
        with cluster_serve(home, URL, *args, "--nodes", "2", "--max-batch", "1") as serve:
            reference = {p: complete(p) for p in (SHORT, "What is two plus two?")}
            yield bed, home, agents, reference, serve


LOST: list[int] = []  # the host whose agent was killed, for the rejoin test


def _follower(bed: Testbed) -> int:
    """A host running a rank of the instance but not its leader."""
    hosts = cluster_info()["instance"]["hosts"]
    return next(i for i in (1, 2, 3) if bed.host(i).ip in hosts[1:])


def _known(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


def _lose_during_stream(served, lose) -> dict:
    """Stream LONG; once tokens flow, queue SHORT behind it, then `lose()` something.

    Returns what happened: the stream's events, the 503 seen during recovery, the queued text.
    """
    bed, home, _, reference, _ = served
    before = cluster_info()["instance"]
    old = all_workers(bed)
    assert len(old) == len(before["nodes"])
    events: list[str] = []
    pool = concurrent.futures.ThreadPoolExecutor(2)
    started = concurrent.futures.Future()

    def stream() -> None:
        body = {"model": "tiny-chat", "prompt": LONG, "max_tokens": 1500, "temperature": 0}
        with httpx.stream(
            "POST", f"{URL}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        started.set_result(True)

    streaming = pool.submit(stream)
    started.result(timeout=60)
    queued = pool.submit(complete, SHORT)
    assert wait_until(lambda: _metric("gateway_requests_waiting") >= 1, timeout=10)
    lost_at = time.monotonic()
    lose()
    streaming.result(timeout=30)  # the stream ends (error event, connection closed): no hang
    ended_s = time.monotonic() - lost_at
    # The loss is known once /health stops saying ok; from then on new requests get 503.
    assert wait_until(lambda: not healthy(URL), timeout=10)
    during = httpx.post(
        f"{URL}/v1/completions",
        json={"model": "tiny-chat", "prompt": "x", "max_tokens": 2},
        timeout=10,
    )
    text = queued.result(timeout=240)
    pool.shutdown()
    assert wait_until(lambda: healthy(URL), timeout=60, interval=0.5)
    print(f"stream ended {ended_s:.2f} s after the loss; serving again after "
          f"{time.monotonic() - lost_at:.1f} s")  # fmt: skip
    after = cluster_info()["instance"]
    return {
        "events": events,
        "during": during,
        "queued": text,
        "reference": reference[SHORT],
        "reference_2": reference["What is two plus two?"],
        "before": before,
        "after": after,
        "old_workers": old,
        "log": (home / "serve.log").read_text(),
    }


def _metric(name: str) -> float:
    text = httpx.get(f"{URL}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"thunderpool_{name} "):
            return float(line.split()[-1])
    return 0.0


def _check(outcome: dict, bed: Testbed) -> None:
    last = json.loads(outcome["events"][-1])
    assert "error" in last, outcome["events"][-3:]
    assert "[DONE]" not in outcome["events"]
    during = outcome["during"]
    assert during.status_code == 503 and during.headers["retry-after"] == "5"
    assert during.json()["error"]["code"] == "model_not_ready"
    assert outcome["queued"] == outcome["reference"]
    assert outcome["after"]["generation"] == outcome["before"]["generation"] + 1
    # Every rank of the lost instance is gone from every host (a cut-off host's agent stops
    # its ranks once the coordinator's polls stop coming).
    assert wait_until(lambda: not (outcome["old_workers"] & all_workers(bed)), timeout=20)
    assert complete("What is two plus two?") == outcome["reference_2"]


def test_a_killed_rank_is_replaced_and_queued_requests_run(served):
    bed = served[0]
    victim = max(workers(bed, _follower(bed)))
    outcome = _lose_during_stream(served, lambda: subprocess.run(["kill", "-9", str(victim)]))
    _check(outcome, bed)
    # Every node still answers, so the new instance is again PP over two of them.
    assert len(outcome["after"]["nodes"]) == 2
    assert "exited with code -9" in outcome["log"]


def test_a_killed_agent_is_left_out_of_the_new_plan(served):
    bed, _, agents, _, _ = served
    victim = _follower(bed)
    LOST.append(victim)
    lost_ip = bed.host(victim).ip
    # `ip netns exec` and `env` exec in place: the pid is the agent's own.
    outcome = _lose_during_stream(served, lambda: agents[victim].kill())
    _check(outcome, bed)
    assert lost_ip not in outcome["after"]["hosts"] and len(outcome["after"]["hosts"]) == 2
    members = {m["contact"].split(":")[0]: m["alive"] for m in cluster_info()["members"]}
    assert wait_until(
        lambda: (
            {m["contact"].split(":")[0]: m["alive"] for m in cluster_info()["members"]}[lost_ip]
            is False
        ),
        timeout=10,
    ), members


def test_a_node_that_comes_back_rejoins_and_a_replan_uses_it(served):
    bed, home, agents, reference, _ = served
    back = LOST[0]
    seed = next(f"{bed.host(i).ip}:{PORT}" for i in (1, 2, 3) if i != back)
    agents[back] = bed.popen(
        back, node_cmd(bed, back, home, "--token", TOKEN, "--join", seed), stderr=subprocess.DEVNULL
    )
    lost_ip = bed.host(back).ip

    def alive() -> bool:
        members = cluster_info().get("members", [])
        return any(m["contact"].startswith(lost_ip) and m["alive"] for m in members)

    assert wait_until(alive, timeout=60, interval=0.5)
    generation = cluster_info()["instance"]["generation"]
    time.sleep(3)  # a membership refresh or two later, the instance is still the same one
    assert cluster_info()["instance"]["generation"] == generation
    assert complete(SHORT) == reference[SHORT]
    token = (home / "serve" / f"admin-{URL.rsplit(':', 1)[1]}.token").read_text().strip()
    auth = {"authorization": f"Bearer {token}"}  # an admin endpoint: the token serve wrote
    r = httpx.post(f"{URL}/v1/admin/replan", headers=auth, timeout=10)
    assert r.status_code == 202
    assert wait_until(
        lambda: healthy(URL) and cluster_info()["instance"]["generation"] == generation + 1,
        timeout=120,
        interval=0.5,
    )
    assert len(cluster_info()["instance"]["hosts"]) == 2
    assert complete(SHORT) == reference[SHORT]


def test_a_cut_cable_is_detected_and_the_cut_off_ranks_stop(served):
    bed = served[0]
    back = LOST[0]  # rejoined in the test above
    # Cut a node of the instance other than the one that came back: the new plan for two
    # must then use the node that rejoined.
    hosts = cluster_info()["instance"]["hosts"]
    victim = next(i for i in (1, 2, 3) if i != back and bed.host(i).ip in hosts)
    port = bed.host(victim).port
    try:
        outcome = _lose_during_stream(
            served, lambda: subprocess.run(["ip", "link", "set", port, "down"], check=True)
        )
        assert "no answer within 2 s" in outcome["log"]
        _check(outcome, bed)
        assert bed.host(victim).ip not in outcome["after"]["hosts"]
        assert bed.host(back).ip in outcome["after"]["hosts"]
        assert not workers(bed, victim)
    finally:
        subprocess.run(["ip", "link", "set", port, "up"], check=True)


def test_ctrl_c_on_serve_stops_the_ranks_on_every_node(served):
    bed, serve = served[0], served[4]
    assert all_workers(bed)
    start = time.monotonic()
    serve.send_signal(signal.SIGINT)
    serve.wait(timeout=30)
    print(f"serve stopped {time.monotonic() - start:.1f} s after Ctrl-C")
    assert not all_workers(bed)  # stopped through every agent before serve exited
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{URL}/health", timeout=2)
