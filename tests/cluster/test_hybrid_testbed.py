"""Hybrid TP×PP across four hosts (network namespaces): two TP groups of two hosts, each its
own MLX ring world, joined by our hand-off on the hosts' link addresses; the greedy tokens and
fp32 logits equal one process's."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import tiny_prompts
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, node_cmd, wait_until

from thunderpool.cluster.client import AgentError
from thunderpool.cluster.coordinator import ClusterInstance, Coordinator, handoff_addresses
from thunderpool.engine.job import RankJob, TraceTask

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

TOKEN = "testbed-token-hybrid"


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


def _reference(model_dir, prompts, steps):
    """Greedy tokens and logits of mlx-lm's own model in this process (full forward)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    tokens, logits = [], []
    for prompt in prompts:
        seq, toks, lgs = list(prompt), [], []
        for _ in range(steps):
            out = model(mx.array([seq]))[0, -1].astype(mx.float32)
            toks.append(int(mx.argmax(out).item()))
            lgs.append(np.array(out))
            seq.append(toks[-1])
        tokens.append(toks)
        logits.append(np.stack(lgs))
    return np.array(tokens), np.stack(logits)


@pytest.mark.slow
def test_tp2_pp2_on_four_hosts_matches_one_process(tiny_models, tmp_path):
    prompts, steps = tiny_prompts(2), 8
    tokens, logits = _reference(tiny_models["llama"], prompts, steps)
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
        out = tmp_path / "cluster.npz"  # one filesystem: the leader in host 1 writes it here
        task = TraceTask(prompts=tuple(map(tuple, prompts)), max_tokens=steps, out=str(out))
        job = RankJob(
            model_dir=str(tiny_models["llama"]),
            world_size=4,
            parallel="hybrid",
            groups=(2, 2),
            task=task,
        )
        with ClusterInstance(coord, state, order, job, timeout=120) as inst:
            events = list(inst.events())
    loaded = sorted((e.rank, e.event["layers"]) for e in events if e.event["kind"] == "loaded")
    assert loaded == [(0, [0, 2]), (1, [0, 2]), (2, [2, 4]), (3, [2, 4])]
    np.testing.assert_array_equal(np.load(out)["tokens"], tokens)
    np.testing.assert_allclose(np.load(out)["logits"], logits, atol=1e-4, rtol=1e-4)
