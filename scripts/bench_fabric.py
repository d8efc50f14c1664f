#!/usr/bin/env python3
"""Weights over the fabric on the namespace testbed (root; run under flock /tmp/testbed.lock).

Host 1 holds the synthetic 1.1B llama (4.4 GB float32); host 2 cannot see it (its agent runs in
a mount namespace with the model directory covered) and sits behind a `tc tbf` rate limit.
A PP2 instance is launched three times: source-only with cold hashes (the source hashes each
piece on first request), source-only again with the hashes cached, and with host 2's shard
already cached (pre-seeded). Each prints the bytes host 2 received, the fetch's rate against
the limit and the measured link, and the time from launch to every rank loaded.

With --serve, `thunderpool serve --cluster` itself is timed instead, from its start to READY
(/health answers 200) and to the first answer of a request: source-only (host 2's cache empty)
and with host 2 pre-seeded (its shard cached by the run before).

    flock /tmp/testbed.lock env PYTHONPATH=$PWD/src python3 scripts/bench_fabric.py --rate 200mbit
    flock /tmp/testbed.lock env PYTHONPATH=$PWD/src python3 scripts/bench_fabric.py --serve
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cluster"))
from testbed import AGENT_PORT, Testbed, available, node_cmd, wait_until  # noqa: E402

from thunderpool.bench.synthetic import synthetic_model  # noqa: E402
from thunderpool.cluster.control.client import AgentClient, AgentError  # noqa: E402
from thunderpool.cluster.control.coordinator import Coordinator  # noqa: E402
from thunderpool.cluster.control.instance import ClusterInstance  # noqa: E402
from thunderpool.cluster.weights.routes import RemoveShards  # noqa: E402
from thunderpool.engine.job import RankJob, TraceTask  # noqa: E402

TOKEN = "fabric-bench-token"


def rate_Bps(text: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale / 8
    raise SystemExit(f"--rate {text!r}: use e.g. 200mbit")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="200mbit", help="tbf limit on host 2's link")
    p.add_argument("--workdir", default="/tmp/fabric-bench", help="model and caches")
    p.add_argument("--parallel", default="pp", choices=["pp", "tp"])
    p.add_argument("--size", default="1b", help="synthetic preset (bench/synthetic.py)")
    p.add_argument("--serve", action="store_true", help="time serve --cluster to READY")
    p.add_argument("--api-port", type=int, default=18431)
    args = p.parse_args()
    if why := available():
        raise SystemExit(why)
    work = Path(args.workdir)
    model = synthetic_model(args.size, cache_dir=work / "source")
    hidden = model.parent
    out = {"rate": args.rate, "model_bytes": sum(f.stat().st_size for f in model.iterdir())}
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp, Testbed(2) as bed:
        first = f"{bed.host(1).ip}:{AGENT_PORT}"
        src = node_cmd(bed, 1, Path(tmp), "--token", TOKEN)
        src.insert(1, f"THUNDERPOOL_CACHE={tmp}/cache1")
        bed.popen(1, src, stderr=subprocess.DEVNULL)
        coord = Coordinator([first], TOKEN)
        wait_until(lambda: _count(coord) == 1, timeout=60)
        cmd = node_cmd(bed, 2, Path(tmp), "--token", TOKEN, "--join", first)
        cmd.insert(1, f"THUNDERPOOL_CACHE={tmp}/cache2")
        inner = f"mount -t tmpfs none {shlex.quote(str(hidden))} && exec {shlex.join(cmd)}"
        bed.popen(2, ["unshare", "-m", "sh", "-c", inner], stderr=subprocess.DEVNULL)
        wait_until(lambda: _count(coord) == 2, timeout=60)
        bed.rate_limit(2, args.rate)
        state = coord.probe(coord.discover())
        (link,) = state.links.values()
        out["link_measured_Bps"] = link.bandwidth_Bps
        ids = {state.contacts[n].split(":")[0]: n for n in state.nodes}
        order = [ids[bed.host(1).ip], ids[bed.host(2).ip]]
        agent2 = AgentClient(f"{bed.host(2).ip}:{AGENT_PORT}", TOKEN)
        if args.serve:
            for run in ("source-only", "pre-seeded"):
                if run == "source-only":
                    agent2.call("POST", "/v1/weights/cache/rm", RemoveShards())
                row = _serve_run(args, model, first, Path(tmp), agent2, link.bandwidth_Bps)
                row = {"run": run, **row}
                print(json.dumps(row), flush=True)
                out.setdefault("runs", []).append(row)
            print(json.dumps(out, indent=1))
            return 0
        task = TraceTask(prompts=((1, 2, 3),), max_tokens=1, out=f"{tmp}/trace.npz")
        job = RankJob(model_dir=str(model), world_size=2, parallel=args.parallel, task=task)
        for run in ("source-only, cold hashes", "source-only, hashes cached", "pre-seeded"):
            if run == "source-only, hashes cached":
                agent2.call("POST", "/v1/weights/cache/rm", RemoveShards())
            start, ready, loaded = time.monotonic(), None, 0
            with ClusterInstance(coord, state, order, job, timeout=900) as inst:
                fetched = time.monotonic() - start  # start() fetched, then launched the ranks
                for ev in inst.events():
                    loaded += ev.event["kind"] == "loaded"
                    if loaded == 2:
                        ready = time.monotonic() - start
                        break
            fetch = list(agent2.call("GET", "/v1/weights/cache")["fetches"].values())[-1]
            got = fetch["received_bytes"]
            seconds = fetch["seconds"]
            row = {
                "run": run,
                "received_bytes": got,
                "fetch_seconds": round(seconds, 1),
                "rate_Bps": got / seconds if got else 0.0,
                "of_limit": got / seconds / rate_Bps(args.rate) if got else 0.0,
                "of_measured_link": got / seconds / link.bandwidth_Bps if got else 0.0,
                "launch_to_fetched_s": round(fetched, 1),
                "launch_to_loaded_s": round(ready or -1, 1),
            }
            print(json.dumps(row), flush=True)
            out.setdefault("runs", []).append(row)
    print(json.dumps(out, indent=1))
    return 0


def _serve_run(args, model: Path, first: str, tmp: Path, agent2, link_Bps: float) -> dict:
    """`serve --cluster` from its start to /health 200 (READY) and to one request answered."""
    import httpx

    _tokenizer(model)
    fetches = set(agent2.call("GET", "/v1/weights/cache")["fetches"])
    url = f"http://127.0.0.1:{args.api_port}"
    log = (tmp / "serve.log").open("w")
    cmd = [sys.executable, "-m", "thunderpool", "serve", "--cluster", "--join", first]
    cmd += ["--token", TOKEN, "--model", str(model), "--parallel", args.parallel]
    cmd += ["--nodes", "2", "--max-batch", "1", "--port", str(args.api_port)]
    env = os.environ | {"THUNDERPOOL_HOME": str(tmp / "serve-home")}
    start = time.monotonic()
    serve = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    ready = answered = None
    try:
        while serve.poll() is None and time.monotonic() - start < 1800:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    ready = time.monotonic() - start
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if ready is None:
            raise SystemExit(f"serve never became ready: {(tmp / 'serve.log').read_text()[-3000:]}")
        body = {"model": model.name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        answered = time.monotonic() - start
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
    new = [f for i, f in agent2.call("GET", "/v1/weights/cache")["fetches"].items()
           if i not in fetches]  # fmt: skip
    got = sum(f["received_bytes"] for f in new)
    seconds = sum(f["seconds"] for f in new)
    return {
        "received_bytes": got,
        "fetch_seconds": round(seconds, 1),
        "rate_Bps": got / seconds if got else 0.0,
        "of_limit": got / seconds / rate_Bps(args.rate) if got else 0.0,
        "of_measured_link": got / seconds / link_Bps if got else 0.0,
        "serve_to_ready_s": round(ready, 1),
        "serve_to_first_answer_s": round(answered, 1),
    }


def _tokenizer(model: Path) -> None:
    """serve needs a tokenizer: the embedded SmolLM2's (its common words have ids < 32000)."""
    from thunderpool.models.source import resolve_model

    source = resolve_model(None, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if not (model / name).exists():
            shutil.copy(source / name, model / name)


def _count(coord: Coordinator) -> int:
    try:
        return len(coord.discover().nodes)
    except AgentError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
