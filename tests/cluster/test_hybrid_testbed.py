"""Hybrid TP×PP across four hosts (network namespaces): two TP groups of two hosts, each its
own MLX ring world, joined by our hand-off on the hosts' link addresses; for tiny llama and
qwen3_moe checkpoints, the greedy tokens and fp32 logits equal one process's full forward."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import greedy_full_forward, tiny_prompts
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import Coordinator, handoff_addresses
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.engine.job import RankJob, TraceTask

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TOKEN = "testbed-token-hybrid"


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


# model -> (layer split, layers of each stage): llama in even stages, qwen3_moe (experts split
# inside each group) in uneven ones. Each launch costs ~10 s of rank starts on this box, so the
# other families and the embedded model run hybrid on loopback ranks (parallel/test_hybrid.py).
CELLS = {
    "llama": (None, [(0, 2), (2, 4)]),
    "qwen3_moe": ((3, 1), [(0, 3), (3, 4)]),
}


@pytest.mark.slow
def test_tp2_pp2_on_four_hosts_matches_one_process(tiny_models, tmp_path):
    """Each family on the same four hosts, one instance after another."""
    prompts, steps = tiny_prompts(2), 8
    models = tiny_models
    want = {kind: greedy_full_forward(models[kind], prompts, steps) for kind in CELLS}
    with Testbed(4) as bed:
        first = f"{bed.host(1).ip}:{PORT}"
        coord = Coordinator([first], TOKEN)
        bed.popen(1, node_cmd(bed, 1, tmp_path, "--token", TOKEN), stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _count(coord) == 1, timeout=60)
        for i in (2, 3, 4):
            cmd = node_cmd(bed, i, tmp_path, "--token", TOKEN, "--join", first)
            bed.popen(i, cmd, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _count(coord) == 4, timeout=60)
        state = coord.probe(coord.discover())
        ids = {state.contacts[n].split(":")[0]: n for n in state.nodes}
        order = [ids[bed.host(i).ip] for i in (1, 2, 3, 4)]
        # Each rank takes its hand-off on its own host's address (stage 1 from stage 0, and
        # stage 0 back from stage 1).
        addresses = handoff_addresses(state, order, (2, 2), 29000)
        assert [a.rsplit(":", 1)[0] for a in addresses] == [bed.host(i).ip for i in (1, 2, 3, 4)]
        for kind, (split, stages) in CELLS.items():
            out = tmp_path / f"{kind}.npz"  # one filesystem: the leader in host 1 writes it
            task = TraceTask(prompts=tuple(map(tuple, prompts)), max_tokens=steps, out=str(out))
            job = RankJob(
                model_dir=str(models[kind]),
                world_size=4,
                parallel="hybrid",
                groups=(2, 2),
                layer_split=split,
                task=task,
            )
            with ClusterInstance(coord, state, order, job, timeout=120) as inst:
                events = list(inst.events())
            got = sorted((e.rank, e.event["layers"]) for e in events if e.event["kind"] == "loaded")
            assert got == [(r, list(stages[r // 2])) for r in range(4)], kind
            tokens, logits = want[kind]
            np.testing.assert_array_equal(np.load(out)["tokens"], tokens, err_msg=kind)
            np.testing.assert_allclose(np.load(out)["logits"], logits, atol=1e-4, rtol=1e-4)
