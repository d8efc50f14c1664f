"""serving/view.py: /v1/cluster built from the coordinator's state and the ranks' own reports."""

from __future__ import annotations

from dataclasses import dataclass

from thunderpool.cluster.control.messages import Hello, LinkMeasured, NodeInfo
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.serving.view import ClusterView

CONFIG = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2}
GIB = 1024**3


def node(node_id: str, ip: str, total: int, name: str = "box") -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        name=name,
        port=7070,
        version="0",
        mlx_version="0",
        python_version="3.11",
        os="Linux",
        chip="cpu",
        cpu_count=2,
        memory_total_bytes=total,
        memory_available_bytes=total // 2,
        mem_bw_Bps=20e9,
    )


def link(a: str, b: str, a_ip: str, b_ip: str, rtt_s: float, kind: str) -> LinkMeasured:
    return LinkMeasured(
        a=a, b=b, a_address=a_ip, b_address=b_ip, rtt_s=rtt_s, bandwidth_Bps=2.5e9, link=kind
    )


@dataclass
class FakeClusterInstance:
    state: ClusterState
    order: list[str]
    job: RankJob


@dataclass
class FakeLocalInstance:
    job: RankJob


def job(world: int, parallel: str = "pp", **layout) -> RankJob:
    task = TraceTask(prompts=((1,),), max_tokens=1, out="x.npz")
    return RankJob(model_dir="m", world_size=world, parallel=parallel, task=task, **layout)


def three_nodes() -> ClusterState:
    s = ClusterState()
    for i, total in ((1, 64), (2, 32), (3, 16)):
        s = apply(
            s, Hello(node=node(f"n{i}", f"10.1.0.{i}", total * GIB), contact=f"10.1.0.{i}:7070")
        )
    # Measured from either end: the state keeps one entry per pair.
    s = apply(s, link("n1", "n2", "10.1.0.1", "10.1.0.2", 0.0004, "ethernet"))
    s = apply(s, link("n2", "n1", "10.1.0.2", "10.1.0.1", 0.0004, "ethernet"))
    s = apply(s, link("n1", "n3", "10.1.0.1", "10.1.0.3", 0.02, "wifi"))
    return s


def test_cluster_ranks_show_their_node_host_and_each_link_once():
    state = three_nodes()
    view = ClusterView(CONFIG)
    shown = view.begin(FakeClusterInstance(state, ["n2", "n1"], job(2, layer_split=(1, 3))))
    nodes = shown["nodes"]
    assert [(n["rank"], n["node_id"], n["host"]) for n in nodes] == [
        (0, "n2", "10.1.0.2"),
        (1, "n1", "10.1.0.1"),
    ]
    # Both nodes are called "box": the address tells them apart.
    assert [n["name"] for n in nodes] == ["box@10.1.0.2", "box@10.1.0.1"]
    assert [n["memory_total_bytes"] for n in nodes] == [32 * GIB, 64 * GIB]
    assert nodes[0]["speed"] == {"mem_bw_gbps": 20.0}
    assert nodes[0]["param_bytes"] is None  # nothing reported yet
    # Only the link between the instance's two nodes, once, with the measured numbers.
    (only,) = shown["links"]
    assert {only["a"], only["b"]} == {"box@10.1.0.1", "box@10.1.0.2"}
    assert only["kind"] == "ethernet"
    assert abs(only["rtt_ms"] - 0.4) < 1e-9 and only["bandwidth_gbps"] == 2.5
    assert [r["layers"] for r in shown["placement"]["ranks"]] == [[0, 1], [1, 4]]


def test_each_rank_keeps_its_own_report():
    view = ClusterView(CONFIG)
    view.begin(FakeClusterInstance(three_nodes(), ["n1", "n2", "n3"], job(3)))
    loaded = {"kind": "loaded", "param_bytes": 300, "peak_rss_bytes": 900, "method": "lazy"}
    assert view.observe(1, loaded) is not None
    assert view.observe(1, loaded) is None  # nothing changed
    assert view.observe(0, {"kind": "progress", "fraction": 0.5}) is None
    assert view.observe(7, loaded) is None  # no such rank
    shown = view.observe(2, {"kind": "memory", "rss_bytes": 500, "peak_rss_bytes": 800})
    mem = [
        (n["param_bytes"], n["rss_bytes"], n["memory_used_bytes"], n["peak_rss_bytes"])
        for n in shown["nodes"]
    ]
    # Before its first memory report a rank's peak at load stands for what it uses.
    assert mem == [(None, None, None, None), (300, None, 900, 900), (None, 500, 500, 800)]
    assert shown["placement"]["method"] == "lazy"


def test_each_rank_shows_its_blas_and_backend():
    view = ClusterView(CONFIG)
    view.begin(FakeClusterInstance(three_nodes(), ["n1", "n2", "n3"], job(3)))
    blis = "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4"
    fast = {"kind": "runtime", "blas": "BLIS", "blas_path": blis, "backend": "ring"}
    slow = {"kind": "runtime", "blas": "reference", "blas_path": None, "backend": "ring"}
    view.observe(0, fast)
    shown = view.observe(2, slow)
    runs = [(n["blas"], n["blas_path"], n["backend"]) for n in shown["nodes"]]
    assert runs == [("BLIS", blis, "ring"), (None, None, None), ("reference", None, "ring")]


def test_local_ranks_are_loopback_neighbours_listed_once():
    view = ClusterView(CONFIG)
    two = view.begin(FakeLocalInstance(job(2, "tp")))
    assert [n["host"] for n in two["nodes"]] == ["127.0.0.1"] * 2
    assert [(x["a"], x["b"], x["kind"]) for x in two["links"]] == [("rank0", "rank1", "loopback")]
    three = view.begin(FakeLocalInstance(job(3, "tp")))
    assert [(x["a"], x["b"]) for x in three["links"]] == [
        ("rank0", "rank1"),
        ("rank0", "rank2"),
        ("rank1", "rank2"),
    ]
    assert view.begin(FakeLocalInstance(job(1, "tp")))["links"] == []
