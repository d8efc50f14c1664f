"""Weights over the fabric on loopback: two agents in this process, only one with the model.

The other fetches exactly its rank's shard (TP: half of each split matrix; PP: its stage),
every chunk checked against the source's hash, and the answer equals one local rank's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import uvicorn
from conftest import tiny_prompts
from matrix_ranks import run_traces
from test_control_plane import node
from testbed import wait_until

from thunderpool.cluster.control.agent import Agent, create_agent_app
from thunderpool.cluster.control.auth import Identity, sign
from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.control.ranks import RankManager
from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
from thunderpool.cluster.weights.routes import FetchShards, RemoveShards
from thunderpool.cluster.weights.shard_files import encode
from thunderpool.cluster.weights.shards import geometry, index_model
from thunderpool.cluster.weights.source import ModelSource
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.errors import ModelError
from thunderpool.models.source import resolve_model

TOKEN = "fabric-token"
pytestmark = pytest.mark.timeout(600)


@contextlib.contextmanager
def serve(agent_for_port):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    agent = agent_for_port(port)
    server = uvicorn.Server(uvicorn.Config(create_agent_app(agent), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.01)
    try:
        yield agent, f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def hiding(hidden: Path):
    """A node's resolver that cannot see under `hidden` (the models live on another node)."""

    def resolve(model):
        if model is not None and hidden.resolve() in (
            Path(model).resolve(),
            *Path(model).resolve().parents,
        ):
            raise ModelError(f"{model} is not on this node")
        return resolve_model(model, progress=False)

    return resolve


@pytest.fixture(scope="module")
def pair(tiny_models, tmp_path_factory):
    model = tiny_models["llama"]
    caches = tmp_path_factory.mktemp("caches")

    def make(node_id, resolve):
        def build(port):
            ranks = RankManager(resolve_model=resolve)
            info = node(node_id, "127.0.0.1").model_copy(update={"port": port})
            ident = Identity(node_id, TOKEN, False)
            return Agent(ident, info, f"127.0.0.1:{port}", 0, ranks, caches / node_id)

        return build

    plain = lambda m: resolve_model(m, progress=False)  # noqa: E731
    with serve(make("a", plain)) as (a, a_addr), serve(make("b", hiding(model.parent))) as (b, _):
        b.join(a_addr)
        yield model, a, b, Coordinator([a_addr], TOKEN)


def launch(pair, parallel: str, out: Path, model: Path | None = None, order=("a", "b")) -> list:
    model, coord = model or pair[0], pair[3]
    state = coord.discover()
    task = TraceTask(prompts=tuple(map(tuple, tiny_prompts(2))), max_tokens=16, out=str(out))
    job = RankJob(model_dir=str(model), world_size=2, parallel=parallel, task=task)
    with ClusterInstance(coord, state, list(order), job, timeout=300) as inst:
        return list(inst.events())


def received(agent) -> int:
    return agent.weights.cache()["received_bytes"]


def loaded_bytes(events, rank: int) -> int:
    return next(
        e.event["param_bytes"] for e in events if e.event["kind"] == "loaded" and e.rank == rank
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # even (mlx-lm) and uneven (2+1 KV) splits
def test_tp2_fetches_half_of_each_split_matrix_and_matches_one_rank(
    pair, tiny_models, tmp_path, kind, one_rank
):
    _, a, b, _ = pair
    model = tiny_models[kind]
    ref = one_rank[kind]
    before = received(b)
    events = launch(pair, "tp", tmp_path / "tp.npz", model)
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npz")["tokens"], ref["tokens"])
    got = received(b) - before
    files = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".json")
    whole = (model / "model.safetensors").stat().st_size
    # Its shard (sliced layers and head, whole embedding) and config: no more, within 5%.
    assert 0 < got <= (loaded_bytes(events, 1) + files) * 1.05, (got, loaded_bytes(events, 1))
    assert got < 0.75 * whole
    assert a.weights.source.served_bytes >= got
    if kind == "llama":  # the cache's reuse is the same for every model: once
        # The same plan again: nothing crosses the network.
        again = received(b)
        launch(pair, "tp", tmp_path / "tp2.npz", model)
        assert received(b) == again
        np.testing.assert_array_equal(np.load(tmp_path / "tp2.npz")["tokens"], ref["tokens"])


def quantize(
    model: Path, out: Path, bits: int = 4, group_size: int = 32, mode: str = "affine"
) -> Path:
    """`model` quantized by mlx-lm (every projection, embedding and head)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    if not (out / "config.json").is_file():
        weights, config = load_model(model)
        weights, config = quantize_model(weights, config, group_size, bits, mode=mode)
        save_model(out, weights)
        save_config(config, out / "config.json")
    return out


@pytest.fixture(scope="module")
def one_rank(tiny_models, one_rank_trace, tmp_path_factory) -> dict:
    """One rank's trace of each model launched here: llama's shared with other modules
    (one_rank_trace), the others in one launch (matrix_ranks.run_traces)."""
    llama = tiny_models["llama"]
    models = {"qwen3": tiny_models["qwen3"], "qwen3_moe": tiny_models["qwen3_moe"],
              "llama-q3": quantize(llama, llama.parent / "llama-q3", bits=3),
              "llama-mxfp4": quantize(llama, llama.parent / "llama-mxfp4", mode="mxfp4")}
    common = {"nodes": 1, "prompts": tiny_prompts(2), "max_tokens": 16}
    traces = run_traces({k: {**common, "model_dir": m} for k, m in models.items()},
                        tmp_path_factory.mktemp("one-rank"))
    return {**traces, "llama": one_rank_trace(llama, tiny_prompts(2), 16)}


# End to end, one checkpoint per way of packing: 3-bit values straddle words (as 5 and 6 bits
# do), mxfp4 has scales and no biases, qwen3_moe cuts each expert. That the source cuts every
# width as the loader does is tests/cluster/test_shards.py, 4 bits in
# test_tp_pieces_are_exactly_what_each_rank_keeps, 2, 3, 5 and 6 bits, mx, nv and mixed in
# test_tp3_source_cuts_are_the_loaders_cuts_for_every_width; a fetched piece is bytes,
# whatever it packs.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-q3", "llama-mxfp4", "qwen3_moe"])
def test_tp2_slices_quantized_and_expert_matrices_at_the_source(
    pair, tiny_models, tmp_path, kind, one_rank
):
    """Packed weights with their scales and biases (rows, or whole input groups and words:
    3- and 6-bit values straddle words) and each expert's gate/up/down are cut at the source
    like parallel/tensor.py cuts them."""
    _, a, b, _ = pair
    family, _, fmt = kind.partition("-")
    model = tiny_models[family]
    if fmt == "mxfp4":  # scales without biases, as gpt-oss ships
        model = quantize(model, model.parent / kind, mode="mxfp4")
    elif fmt:  # beside the others, so node b cannot see it either
        model = quantize(model, model.parent / kind, bits=int(fmt[1:]))
    index = index_model(model)
    sliced = {p.name for p in rank_pieces(index, RankLayout(rank=1, world=2)) if p.axis is not None}
    biases = "down_proj.scales" if fmt == "mxfp4" else "down_proj.biases"
    want = ("o_proj.scales", biases, "q_proj.weight", "lm_head.scales")
    if kind == "qwen3_moe":
        want = ("experts.3.gate_proj.weight", "experts.0.down_proj.weight", "o_proj.weight")
    assert all(any(n.endswith(w) for n in sliced) for w in want), sorted(sliced)
    ref = one_rank[kind]
    before = received(b)
    events = launch(pair, "tp", tmp_path / "tp.npz", model)
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npz")["tokens"], ref["tokens"])
    got = received(b) - before
    files = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".json")
    assert 0 < got <= (loaded_bytes(events, 1) + files) * 1.05, (got, loaded_bytes(events, 1))
    assert got < 0.7 * (model / "model.safetensors").stat().st_size


@pytest.mark.slow
def test_ep2_as_planned_fetches_only_its_experts_and_matches_one_rank(
    pair, tiny_models, tmp_path, one_rank
):
    """The planner's EP plan, launched over the fabric: node b is sent its attention slices
    and only its own experts' tensors (per-expert checkpoint), and decodes as one rank does."""
    from thunderpool.planner.hardware import LinkSpec, NodeSpec
    from thunderpool.planner.placement import place
    from thunderpool.planner.spec import model_spec

    _, a, b, coord = pair
    model = tiny_models["qwen3_moe"]
    nodes = [NodeSpec(n, 8 << 30, 4 << 30, 50e9, 1e11) for n in ("a", "b")]
    plan = next(
        p
        for p in place(model_spec(model), nodes, [LinkSpec("a", "b", 1e-4, 1e9, "ethernet")])
        if p.kind == "ep"
    )
    layout = plan.layout()
    assert layout.parallel == "ep" and layout.expert_split == (2, 2)
    ref = one_rank["qwen3_moe"]
    before = received(b)
    task = TraceTask(prompts=tuple(map(tuple, tiny_prompts(2))), max_tokens=16, out="")
    task = task.model_copy(update={"out": str(tmp_path / "ep.npz")})
    job = RankJob(model_dir=str(model), world_size=2, task=task, layout=layout)
    with ClusterInstance(coord, coord.discover(), list(plan.nodes), job, timeout=300) as inst:
        events = list(inst.events())
    got = np.load(tmp_path / "ep.npz")
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=1e-4)
    assert [e.event.get("experts") for e in events if e.event["kind"] == "loaded"] in (
        [[0, 2], [2, 4]],
        [[2, 4], [0, 2]],
    )
    index = index_model(model)
    pieces = rank_pieces(index, RankLayout(rank=1, world=2, parallel="ep", expert_split=(2, 2)))
    assert not any(geometry(p, index).size for p in pieces if ".experts.0." in p.name)
    fetched = received(b) - before
    # Its whole experts move (no earlier shard holds them); pieces cached before may not.
    experts = sum(geometry(p, index).size for p in pieces if ".experts." in p.name)
    assert 0 < experts <= fetched <= sum(geometry(p, index).size for p in pieces)
    files = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".json")
    assert 0 < fetched <= (loaded_bytes(events, 1) + files) * 1.05, (
        fetched,
        loaded_bytes(events, 1),
    )


def test_pp2_fetches_its_stage_and_reuses_what_the_tp_shard_holds(pair, tmp_path, one_rank):
    model, a, b, _ = pair
    ref = one_rank["llama"]
    tp = rank_pieces(index_model(model), RankLayout(rank=1, world=2, parallel="tp"))
    launch(pair, "tp", tmp_path / "tp.npz")  # b holds the TP shard whatever ran before
    before = received(b)
    events = launch(pair, "pp", tmp_path / "pp.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "pp.npz")["tokens"], ref["tokens"])
    index = index_model(model)
    pp = rank_pieces(index, RankLayout(rank=1, world=2, parallel="pp"))
    # Only the difference moves: pieces the TP shard already holds (norms, config) are copied.
    new = sum(geometry(p, index).size for p in set(pp) - set(tp))
    assert received(b) - before == new
    assert received(b) - before <= loaded_bytes(events, 1) * 1.05
    assert not any("embed_tokens" in p.name or p.name.startswith("lm_head") for p in pp)


def test_a_flipped_byte_is_detected_refetched_and_never_loaded(
    pair, tmp_path, monkeypatch, one_rank
):
    model, a, b, _ = pair
    b.weights.remove(RemoveShards())
    flipped = []
    real = ModelSource.chunk

    def flip_once(self, name, piece, k, chunk):
        data = real(self, name, piece, k, chunk)
        if not flipped and len(data) > 100:
            flipped.append(piece.key)
            data = data[:100] + bytes([data[100] ^ 0x01]) + data[101:]
        return data

    monkeypatch.setattr(ModelSource, "chunk", flip_once)
    ref = one_rank["llama"]
    launch(pair, "tp", tmp_path / "tp.npz")
    assert flipped
    fetches = b.weights.cache()["fetches"].values()
    assert sum(f["corrupt_chunks"] for f in fetches) == 1
    np.testing.assert_array_equal(np.load(tmp_path / "tp.npz")["tokens"], ref["tokens"])


def test_weights_need_the_token_and_a_fresh_signature(pair):
    import httpx

    model, a, _, coord = pair
    address = coord.discover().contacts["a"]
    index = index_model(model)
    piece = next(p for p in rank_pieces(index, RankLayout(rank=0, world=1)) if not p.is_file)
    path = f"/v1/weights/chunk?m={encode(str(model))}&p={encode(piece.key)}&k=0"
    url = f"http://{address}{path}"
    served = a.weights.source.served_bytes
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=sign("wrong", "GET", path)).status_code == 401
    headers = sign(TOKEN, "GET", path)
    ok = httpx.get(url, headers=headers)
    assert ok.status_code == 200 and len(ok.content) == geometry(piece, index).size
    replay = httpx.get(url, headers=headers)
    assert replay.status_code == 401 and replay.content.startswith(b'{"detail":"replayed')
    other = path.replace("k=0", "k=1")
    assert (
        httpx.get(f"http://{address}{other}", headers=sign(TOKEN, "GET", path)).status_code == 401
    )
    assert a.weights.source.served_bytes == served + len(ok.content)


def test_cache_ls_and_rm_from_the_command_line(pair):
    import subprocess
    import sys

    _, _, b, coord = pair
    address = coord.discover().contacts["a"]
    cli = [sys.executable, "-m", "thunderpool", "cache"]
    flags = ["--join", address, "--token", TOKEN]
    listed = subprocess.run([*cli, "ls", *flags], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    shards = b.weights.cache()["shards"]
    assert shards and all(s["key"] in listed.stdout for s in shards)
    removed = subprocess.run(
        [*cli, "rm", "--node", "b", *flags], capture_output=True, text=True, timeout=120
    )
    assert removed.returncode == 0, removed.stderr
    assert f"removed {len(shards)} shard(s)" in removed.stdout
    assert b.weights.cache()["shards"] == []


def test_health_shows_each_fetching_nodes_bytes_rate_and_eta():
    from fastapi.testclient import TestClient

    from thunderpool.api.openapi import Health
    from thunderpool.api.routes import create_app
    from thunderpool.cli.cache import health_listener
    from thunderpool.cluster.weights.fabric import NodeFetch
    from thunderpool.engine.service import EngineInfo
    from thunderpool.serving.gateway import Gateway

    gw = Gateway(EngineInfo(model="m", max_context=64), None, "t")
    mib = 1 << 20
    snaps = [
        {"total_bytes": 4 * mib, "done_bytes": 1 * mib, "rate_Bps": 2 * mib, "eta_s": 1.5},
        {"total_bytes": 4 * mib, "done_bytes": 0, "rate_Bps": 0.0, "eta_s": None},
    ]
    health_listener(gw)([NodeFetch("b", "mac-2", snaps[0]), NodeFetch("c", "mac-3", snaps[1])])
    r = TestClient(create_app(gw)).get("/health")
    assert r.status_code == 503
    body = Health.model_validate(r.json()).model_dump()
    assert body["progress"] == 0.125 and body["detail"].startswith("fetching weights: mac-2 ")
    assert body["fetch"] == [
        {"node": "mac-2", "bytes_done": mib, "bytes_total": 4 * mib, "rate_Bps": 2.0 * mib,
         "eta_s": 1.5},
        {"node": "mac-3", "bytes_done": 0, "bytes_total": 4 * mib, "rate_Bps": 0.0, "eta_s": None},
    ]  # fmt: skip
    gw.lost("a node left")  # not loading weights any more: no per-node entries
    assert "fetch" not in TestClient(create_app(gw)).get("/health").json()


def test_a_coordinator_without_the_model_plans_from_a_members_config_and_headers(
    pair, tmp_path, monkeypatch
):
    """Only node a has the model, not this machine: the coordinator fetches its small files
    and safetensors headers from a (hash-checked) and plans exactly as with a local copy."""
    import argparse

    import thunderpool.models.source as models
    from thunderpool.cli.cluster import ranked_plans
    from thunderpool.cluster.control.remote_model import MARKER, model_here_or_remote
    from thunderpool.planner.spec import model_spec

    model, _, _, coord = pair
    state = coord.discover()
    args = argparse.Namespace(model=str(model), join=[state.contacts["a"]], token=TOKEN)
    here = ranked_plans(args, state)
    hidden = hiding(model.parent)
    monkeypatch.setattr(models, "resolve_model", lambda m, *_, **__: hidden(m))
    with pytest.raises(ModelError):
        models.resolve_model(str(model))
    monkeypatch.setenv("THUNDERPOOL_CACHE", str(tmp_path / "cache"))
    described = model_here_or_remote(str(model), lambda: coord)
    assert (described / MARKER).is_file() and described.is_relative_to(tmp_path / "cache")
    for f in model.iterdir():
        if f.suffix == ".json":
            assert (described / f.name).read_bytes() == f.read_bytes()
    assert model_spec(described) == model_spec(model)
    weights = described / "model.safetensors"
    assert weights.stat().st_size < (model / "model.safetensors").stat().st_size / 100
    assert ranked_plans(args, state) == here


def test_a_shard_in_many_chunks_holds_exactly_the_slices(pair, tmp_path):
    """The receiver writes multi-chunk pieces at the right offsets (TP rank 1 of a 16 MB
    model in 64 KiB chunks), and a fetch cut after some chunks resumes from them."""
    from test_fabric_testbed import make_checkpoint

    from thunderpool.cluster.weights.shards import IN_PLACE, SHARD_MANIFEST
    from thunderpool.cluster.weights.transfer import ShardFetch, SourceClient

    _, a, _, coord = pair
    model = make_checkpoint(tmp_path / "m16")  # `a` resolves any path; nobody hides this one
    layout = RankLayout(rank=1, world=2, parallel="tp")
    client = SourceClient([coord.discover().contacts["a"]], TOKEN)

    class Cut(Exception):
        pass

    calls = []
    real_get = SourceClient.get

    def cut_after_50_chunks(self, path, source=0):
        if "/chunk?" in path:
            calls.append(path)
            if len(calls) == 50:
                raise Cut()
        return real_get(self, path, source)

    first = ShardFetch(tmp_path / "cache", client, str(model), [layout], chunk=1 << 16, workers=1)
    SourceClient.get = cut_after_50_chunks
    try:
        with pytest.raises(Cut):
            first.run()
    finally:
        SourceClient.get = real_get
    assert 0 < first.progress.received_bytes < first.progress.total_bytes
    again = ShardFetch(tmp_path / "cache", client, str(model), [layout], chunk=1 << 16)
    shard = again.run()[1]
    total = again.progress.total_bytes
    assert again.progress.received_bytes == total - first.progress.received_bytes  # resumed
    assert (shard / SHARD_MANIFEST).is_file()
    full = {k: np.array(v) for k, v in mx.load(str(model / "model.safetensors")).items()}
    got = {k: np.array(v) for k, v in mx.load(str(shard / "model.safetensors")).items()}
    index = index_model(model)
    for piece in rank_pieces(index, layout):
        if piece.is_file:
            continue
        want, mine = full[piece.name], got[piece.name]
        if piece.axis is not None:
            want = np.take(want, range(piece.a, piece.b), axis=piece.axis)
        if piece.name in IN_PLACE and piece.axis == 0:  # full shape, its rows in place
            assert mine.shape == full[piece.name].shape
            mine = mine[piece.a : piece.b]
        np.testing.assert_array_equal(mine, want, err_msg=piece.key)
    on_disk = (shard / "model.safetensors").stat().st_blocks * 512
    assert on_disk < 0.6 * (model / "model.safetensors").stat().st_size


# Last in this module: node c joins the pair's cluster for good.
@pytest.fixture(scope="module")
def third(pair, tmp_path_factory):
    model, a, _, coord = pair
    caches = tmp_path_factory.mktemp("caches-c")

    def build(port):
        ranks = RankManager(resolve_model=hiding(model.parent))
        info = node("c", "127.0.0.1").model_copy(update={"port": port})
        return Agent(Identity("c", TOKEN, False), info, f"127.0.0.1:{port}", 0, ranks, caches)

    with serve(build) as (c, _):
        c.join(coord.discover().contacts["a"])
        yield c


@pytest.mark.slow
def test_a_node_fetches_what_a_peer_holds_from_that_peer(
    pair, third, tiny_models, tmp_path, one_rank
):
    """b holds TP rank 1's shard from an earlier plan; in a plan on b and c, c gets rank 1's
    pieces from b (checked against the source's hashes) while b fetches rank 0's from a."""
    _, a, b, coord = pair
    c, model = third, tiny_models["qwen3"]
    ref = one_rank["qwen3"]
    b_fetch = b.weights.start_fetch(
        FetchShards(
            model=str(model),
            sources=(coord.discover().contacts["a"],),
            ranks=(RankLayout(rank=1, world=2, parallel="tp"),),
        )
    )  # b: rank 1's shard (cached already, or now)
    assert wait_until(lambda: b.weights.fetches[b_fetch].progress.state == "done", timeout=120)
    from_a, from_b = a.weights.source.served_bytes, b.weights.cache()["peer_served_bytes"]
    fetches_b = set(b.weights.fetches)
    launch(pair, "tp", tmp_path / "bc.npz", model, order=("b", "c"))
    np.testing.assert_array_equal(np.load(tmp_path / "bc.npz")["tokens"], ref["tokens"])
    (mine,) = c.weights.cache()["fetches"].values()
    assert mine["state"] == "done" and mine["peer_bytes"] == mine["received_bytes"] > 0, mine
    assert b.weights.cache()["peer_served_bytes"] - from_b == mine["peer_bytes"]
    (theirs,) = [f.progress for i, f in b.weights.fetches.items() if i not in fetches_b]
    assert theirs.peer_bytes == 0 and theirs.received_bytes > 0  # rank 0: nobody holds it
    assert a.weights.source.served_bytes - from_a == theirs.received_bytes


def test_the_draft_runs_on_the_leaders_node_and_is_refused_where_it_is_missing(pair, tmp_path):
    """--draft-model with --cluster: the job names the draft as the user did; the leader's
    node resolves it to its own copy. A leader whose node lacks it is refused before any rank
    starts or any weight moves."""
    from thunderpool.bench.synthetic import write_truncated
    from thunderpool.engine.control import Control
    from thunderpool.engine.engine import Engine
    from thunderpool.engine.loader import Layout, load_shard
    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.errors import LaunchError

    model, _, b, coord = pair
    draft = model.parent / "llama-draft2"  # where node b cannot see it
    if not (draft / "config.json").is_file():
        write_truncated(model, 2, draft)
    prompts = tiny_prompts(2)
    task = TraceTask(prompts=tuple(map(tuple, prompts)), max_tokens=16, out=str(tmp_path / "d.npz"))
    job = RankJob(model_dir=str(model), world_size=2, task=task, draft_model=str(draft), spec_k=3)
    state, before = coord.discover(), received(b)
    with pytest.raises(LaunchError, match=r"is not on the leader's node .*runs the draft"):
        with ClusterInstance(coord, state, ["b", "a"], job, timeout=300) as inst:
            list(inst.events())
    assert received(b) == before and not b.ranks.instances
    with ClusterInstance(coord, state, ["a", "a"], job, timeout=300) as inst:  # no fetch: cheap
        events = list(inst.events())
    runner = load_shard(model, mx.distributed.init(), Layout())[0]
    engine, ref = Engine(runner, Control(runner.group)), []
    for p in prompts:
        ref.append([])
        engine.generate(p, SamplingParams(max_tokens=16), lambda ev, t=ref[-1]: t.append(ev.token))
    np.testing.assert_array_equal(np.load(tmp_path / "d.npz")["tokens"], np.array(ref))
    done = next(e.event for e in events if e.event["kind"] == "done")
    assert done["spec_steps"] > 0
