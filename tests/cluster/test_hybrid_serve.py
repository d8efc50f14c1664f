"""`serve --cluster` on four testbed hosts in two islands: the planner itself picks hybrid TP×PP
(TP inside each island, PP between them), the served greedy text equals one process's, and a
lost agent of the second stage's island makes the supervisor replan onto the nodes left.

Every agent reports a host id of its own (`node --host-id`) and runs on one core (taskset),
as containers with cpusets on one machine would; by the namespaces' shared boot id the planner
would place at most two ranks on these two cores. The islands are joined by 20 Mbit/s (htb),
nothing limits traffic inside them. The model's layers outweigh its head, so halving them by
TP inside an island pays, while TP over all four gathers the logits over the slow link every
step: at the agents' default rates (not measured) the planner predicts hybrid ~39 tok/s, PP4
~30 and TP4 ~23; after the loss, TP2 over the intact island ~54, one node ~30.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from conftest import make_tiny_chat
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, cluster_serve, healthy, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

TOKEN = "hybrid-serve-token"
API_PORT = 18437
URL = f"http://127.0.0.1:{API_PORT}"
ISLANDS = [(1, 2), (3, 4)]
RATE = "20mbit"
WIDE = {"intermediate_size": 6144}  # 4 layers of ~9.5 MB (f32) against a 12.6 MB head
PROMPT = "The harbour at dawn was"
MAX_TOKENS = 8


def _known(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


def one_process(model_dir, prompt: str, max_tokens: int) -> tuple[str, int]:
    """The greedy completion of mlx-lm's own model in this process: (text, token count)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    seq, out = list(tokenizer.encode(prompt)), []
    for _ in range(max_tokens):
        token = int(mx.argmax(model(mx.array([seq]))[0, -1]).item())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        seq.append(token)
    detok = tokenizer.detokenizer  # the streaming detokenizer the server's text comes from
    detok.reset()
    for token in out:
        detok.add_token(token)
    detok.finalize()
    return detok.text, len(out)


def complete() -> tuple[str, int]:
    body = {"model": "wide", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{URL}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


def cluster_info() -> dict:
    return httpx.get(f"{URL}/v1/cluster", timeout=10).json()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("hybrid-serve")
    model = make_tiny_chat(home / "wide", **WIDE)
    with Testbed(4) as bed:
        bed.limit_between(ISLANDS, RATE)  # before the agents join: their probes see it
        first = f"{bed.host(1).ip}:{PORT}"

        def agent(i: int, *join: str) -> subprocess.Popen:
            # Like containers with cpusets: each island's two agents on the two cores.
            own = ("--token", TOKEN, "--host-id", f"hybrid-host-{i}", *join)
            cmd = ["taskset", "-c", str((i - 1) % 2), *node_cmd(bed, i, home, *own)]
            return bed.popen(i, cmd, stderr=subprocess.DEVNULL)

        # All at once: a seed that does not answer yet is retried.
        agents = {1: agent(1), **{i: agent(i, "--join", first) for i in (2, 3, 4)}}
        reference = one_process(model, PROMPT, MAX_TOKENS)  # while the agents start
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _known(coord) == 4, timeout=90, interval=0.5)
        args = ("--join", first, "--token", TOKEN, "--model", str(model), "--nodes", "4")
        with cluster_serve(home, URL, *args):
            yield bed, agents, reference, home / "serve.log"


@pytest.mark.slow
def test_planner_picks_hybrid_across_islands_and_replans_after_a_loss(served):
    bed, agents, reference, log = served
    ip = {bed.host(i).ip: i for i in range(1, 5)}
    info = cluster_info()
    assert info["instance"]["parallel"] == "hybrid", log.read_text()
    assert info["placement"]["groups"] == [2, 2]
    hosts = [ip[h] for h in info["instance"]["hosts"]]
    stages = [tuple(sorted(hosts[:2])), tuple(sorted(hosts[2:]))]
    assert sorted(stages) == ISLANDS  # TP inside each island, PP between them
    assert [r["stage"] for r in info["placement"]["ranks"]] == [0, 0, 1, 1]
    assert complete() == reference

    # Lose an agent of the second stage's island (not host 1, the coordinator's seed).
    victim = next(i for i in stages[1] if i != 1)
    agents[victim].kill()
    assert wait_until(
        lambda: healthy(URL) and cluster_info()["instance"]["generation"] == 2,
        timeout=180,
        interval=0.5,
    ), log.read_text()
    after = cluster_info()
    # No 4-node plan is left; the best of any kind is TP over the intact island (its fast link
    # and half the weights per rank beat one node, PP, and any plan across the slow link).
    assert after["instance"]["parallel"] == "tp", log.read_text()
    assert sorted(ip[h] for h in after["instance"]["hosts"]) == list(stages[0])
    assert complete() == reference
