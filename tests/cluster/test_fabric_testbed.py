"""Weights over the fabric between network-namespace hosts: only host 1 has the model.

Hosts 2 and 3 run their agents in their own mount namespaces with the model's directory
covered by an empty tmpfs and a cache of their own, so they can only get the weights over the
(testbed) network. Run under `flock /tmp/testbed.lock`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, run_trace, tiny_prompts
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes
from testbed import AGENT_PORT as PORT
from testbed import Testbed, available, node_cmd, wait_until

from thunderpool.cluster.control.client import AgentClient, AgentError
from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.weights.routes import Locate, RemoveShards
from thunderpool.cluster.weights.shard_files import encode
from thunderpool.cluster.weights.transfer import TIMEOUT_ENV
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.models.source import default_gguf_path, resolve_model

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(900),
]
TOKEN = "fabric-testbed-token"
FETCH_TIMEOUT_S = 4  # host 3's fetches: the cut-link test waits out more than this
# ~16 MB of float32: big enough that a TP2 shard takes seconds on a 8 Mbit/s link.
CONFIG = {
    **TINY["llama"],
    "hidden_size": 256,
    "intermediate_size": 768,
    "vocab_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    model_cls, args_cls = _get_classes(CONFIG)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(CONFIG))
    weights = {
        n: w * 2.0 if w.ndim == 2 and "embed" not in n else w
        for n, w in tree_flatten(model.parameters())
    }
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return path


def hidden_node(
    bed: Testbed, i: int, tmp: Path, models: Path, *extra: str, env: dict | None = None
) -> list[str]:
    """Host i's agent in its own mount namespace where `models` and the embedded model's
    package are empty tmpfs: it has neither the test checkpoint nor SmolLM2."""
    cmd = node_cmd(bed, i, tmp, *extra)
    cmd[1:1] = [f"THUNDERPOOL_CACHE={tmp}/cache{i}", *(f"{k}={v}" for k, v in (env or {}).items())]
    hide = [models, default_gguf_path().parent]
    mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(d))}" for d in hide)
    inner = f"{mounts} && exec {shlex.join(cmd)}"
    return ["unshare", "-m", "sh", "-c", inner]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fabric")
    models = tmp / "models"
    model = make_checkpoint(models / "llama-16m")
    with Testbed(3) as bed:
        first = f"{bed.host(1).ip}:{PORT}"
        source = node_cmd(bed, 1, tmp, "--token", TOKEN)
        source.insert(1, f"THUNDERPOOL_CACHE={tmp}/cache1")
        bed.popen(1, source, stderr=subprocess.DEVNULL)
        coord = Coordinator([first], TOKEN)
        assert wait_until(lambda: _count(coord) == 1, timeout=60)
        for i in (2, 3):
            env = {TIMEOUT_ENV: str(FETCH_TIMEOUT_S)} if i == 3 else {}
            cmd = hidden_node(bed, i, tmp, models, "--token", TOKEN, "--join", first, env=env)
            bed.popen(i, cmd, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: _count(coord) == 3, timeout=60)
        state = coord.probe(coord.discover())
        ids = {state.contacts[n].split(":")[0]: n for n in state.nodes}
        hosts = {i: ids[bed.host(i).ip] for i in (1, 2, 3)}
        yield bed, coord, state, hosts, model, tmp


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


def cache(bed, i: int) -> dict:
    return AgentClient(f"{bed.host(i).ip}:{PORT}", TOKEN).call("GET", "/v1/weights/cache")


def wire_bytes(bed, i: int) -> int:
    """Everything host i asked the source for: weights, files, the index and hash lists."""
    answer = cache(bed, i)
    return answer["received_bytes"] + answer["metadata_bytes"]


def launch(setup, hosts: tuple[int, ...], parallel: str, out: Path, model: str | None = None):
    bed, coord, state, ids, checkpoint, _ = setup
    model = str(checkpoint) if model is None else model
    task = TraceTask(prompts=tuple(map(tuple, tiny_prompts(2))), max_tokens=16, out=str(out))
    job = RankJob(model_dir=model, world_size=len(hosts), parallel=parallel, task=task)
    order = [ids[i] for i in hosts]
    with ClusterInstance(coord, state, order, job, timeout=300) as inst:
        return list(inst.events())


def param_bytes(events, rank: int) -> int:
    loaded = [e for e in events if e.event["kind"] == "loaded" and e.rank == rank]
    return loaded[0].event["param_bytes"]


@pytest.fixture(scope="module")
def reference(bed, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    return run_trace(bed[4], out, 1, prompts=tiny_prompts(2), max_tokens=16)["tokens"]


def test_only_host_1_has_the_model(bed):
    b, *_ = bed
    model = bed[4]

    def has(i: int) -> bool:
        client = AgentClient(f"{b.host(i).ip}:{PORT}", TOKEN)
        return client.call("POST", "/v1/weights/locate", Locate(model=str(model)))["has"]

    assert [has(i) for i in (1, 2, 3)] == [True, False, False]
    assert (model / "model.safetensors").is_file()  # while the test process sees it


def test_tp2_across_hosts_fetches_its_half_and_matches_one_rank(bed, reference, tmp_path):
    b = bed[0]
    config_bytes = (bed[4] / "config.json").stat().st_size
    before = wire_bytes(b, 2)
    events = launch(bed, (1, 2), "tp", tmp_path / "tp.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npz")["tokens"], reference)
    got = wire_bytes(b, 2) - before
    shard = param_bytes(events, 1)
    print(f"TP2: host 2 received {got} B for a {shard} B shard (model {_size(bed[4])} B)")
    assert 0 < got <= (shard + config_bytes) * 1.05
    assert got < 0.7 * _size(bed[4])
    # The same plan again moves nothing.
    before = cache(b, 2)
    launch(bed, (1, 2), "tp", tmp_path / "again.npz")
    after = cache(b, 2)
    assert after["received_bytes"] == before["received_bytes"]
    assert after["metadata_bytes"] - before["metadata_bytes"] < 64 << 10  # the index only
    np.testing.assert_array_equal(np.load(tmp_path / "again.npz")["tokens"], reference)
    listed = cache(b, 2)["shards"]
    assert len(listed) == 1 and listed[0]["bytes"] >= shard


def test_pp3_two_hosts_pull_at_once_and_each_gets_its_stage(bed, reference, tmp_path):
    b = bed[0]
    before = {i: wire_bytes(b, i) for i in (2, 3)}
    events = launch(bed, (1, 2, 3), "pp", tmp_path / "pp.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "pp.npz")["tokens"], reference)
    config_bytes = (bed[4] / "config.json").stat().st_size
    for rank, i in ((1, 2), (2, 3)):
        got = wire_bytes(b, i) - before[i]
        print(f"PP3: host {i} received {got} B for a {param_bytes(events, rank)} B stage")
        assert 0 < got <= (param_bytes(events, rank) + config_bytes) * 1.05


def test_a_cut_link_pauses_the_fetch_which_resumes_and_the_instance_starts(
    bed, reference, tmp_path
):
    b = bed[0]
    AgentClient(f"{b.host(3).ip}:{PORT}", TOKEN).call(
        "POST", "/v1/weights/cache/rm", RemoveShards()
    )
    b.rate_limit(3, "8mbit")
    result: dict = {}

    def run() -> None:
        try:
            result["events"] = launch(bed, (1, 3), "tp", tmp_path / "cut.npz")
        except Exception as e:  # reported below
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()

    def fetching() -> bool:
        fetches = cache(b, 3)["fetches"].values()
        return any(f["state"] == "fetching" and f["received_bytes"] > 0 for f in fetches)

    assert wait_until(fetching, timeout=120)
    veth = b.host(3).veth
    b.run(3, ["ip", "link", "set", veth, "down"])
    time.sleep(2.5 * FETCH_TIMEOUT_S)  # longer than a read timeout: the fetch's GETs fail
    b.run(3, ["ip", "link", "set", veth, "up"])
    thread.join(600)
    assert "error" not in result, result.get("error")
    np.testing.assert_array_equal(np.load(tmp_path / "cut.npz")["tokens"], reference)
    fetch = list(cache(b, 3)["fetches"].values())[-1]  # this launch's
    print(f"cut: {fetch}")
    assert fetch["retries"] >= 1 and fetch["state"] == "done"
    assert fetch["done_bytes"] == fetch["total_bytes"]
    # Resumed, not restarted: what was verified before the cut was not fetched again.
    assert fetch["received_bytes"] == fetch["total_bytes"]


@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_the_embedded_model_over_two_hosts_matches_one_rank(
    bed, tmp_path, parallel, one_rank_trace
):
    """SmolLM2 (9 query / 3 KV heads: TP2 splits them unevenly; tied embedding), named as
    the user names it (no --model): host 1 imports it, host 2 receives its shard."""
    b = bed[0]
    local = resolve_model(None, progress=False)
    ref = one_rank_trace(local, tiny_prompts(2), 16)  # one launch for both layouts
    before = wire_bytes(b, 2)
    events = launch(bed, (1, 2), parallel, tmp_path / "out.npz", model="")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["tokens"], ref["tokens"])
    got = wire_bytes(b, 2) - before
    files = sum(p.stat().st_size for p in local.iterdir() if not p.name.endswith(".safetensors"))
    shard = param_bytes(events, 1)
    print(f"SmolLM2 {parallel}2: host 2 received {got} B for a {shard} B shard")
    assert 0 < got <= (shard + files) * 1.05


def test_weights_are_refused_without_the_token(bed):
    b, *_ = bed
    model = bed[4]
    piece = encode("model.embed_tokens.weight|None|0|0")
    url = f"http://{b.host(1).ip}:{PORT}/v1/weights/chunk?m={encode(str(model))}&p={piece}&k=0"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 401 and len(r.content) < 300 and b"unsigned" in r.content
    r = httpx.get(url, headers={"X-Thunderpool-Signature": "00"}, timeout=30)
    assert r.status_code == 401 and len(r.content) < 300


def _size(model: Path) -> int:
    return (model / "model.safetensors").stat().st_size
