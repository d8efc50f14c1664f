"""Soak: `serve --nodes 2` on the embedded model under 16 concurrent clients for SOAK_S seconds,
a fifth of them leaving mid-stream and some sending malformed bodies.

Every request must end with its answer or a clear 4xx error (none waits past its client's
timeout, none gets a 5xx), the server must be idle afterwards, and the memory of every process
flat: the resident set (VmRSS in /proc/PID/status) of `serve` and each of its rank processes at
the end of the soak, against the same after a warm-up at the same load, within MiB_FLAT. The
decode step time after the soak against before (the median gap between streamed tokens of a
fixed-length greedy answer, ignore_eos) is recorded, not asserted (no timing is asserted in a
test here). The figures go to artifacts/soak.json.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving import serving

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct-f32"
CLIENTS = 16
SOAK_S = float(os.environ.get("THUNDERPOOL_SOAK_S", "30"))  # CI; the note has a 300 s run
WARM_S = 10.0
REQUEST_TIMEOUT_S = 120.0  # "waits forever", in a test
MIB_FLAT = 48  # eager: medians moved up to ~26 MiB over 45-300 s here; compiled: +270
MALFORMED = [
    b"{not json",
    b'{"model": "%s", "messages": "hi"}' % MODEL.encode(),
    b'{"model": "%s", "messages": [], "max_tokens": -1}' % MODEL.encode(),
    b'{"model": "%s", "prompt": "x", "max_tokens": 4, "bogus": 1}' % MODEL.encode(),
    b"[]",
]
QUESTIONS = ["What is the capital of France?", "Name a color.", "Count to five.", "Say hi."]


def rss_by_process(root: int) -> dict[int, int]:
    """VmRSS bytes of `root` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS:")), 0)  # fmt: skip
        out[pid] = kb * 1024
    return out


def step_ms(url: str, runs: int = 2) -> float:
    """Median ms between streamed tokens of a 40-token greedy answer (ignore_eos)."""
    gaps = []
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    for _ in range(runs):
        stamps = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        gaps += [b - a for a, b in zip(stamps[2:], stamps[3:], strict=False)]
    return 1000 * statistics.median(gaps)


def client(i: int, url: str, until: float, outcomes: list, lock: threading.Lock) -> None:
    rng = random.Random(i)
    leaves = i % 5 == 0  # a fifth leave mid-stream
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
        while time.monotonic() < until:
            kind = "leave" if leaves else rng.choice(["stream", "whole", "whole", "malformed"])
            try:
                outcome = _one(c, kind, rng)
            except httpx.TimeoutException:
                outcome = f"{kind}: no answer in {REQUEST_TIMEOUT_S:.0f} s"
            except httpx.HTTPError as e:
                outcome = f"{kind}: {type(e).__name__}: {e}"
            with lock:
                outcomes.append((kind, outcome))


def _one(c: httpx.Client, kind: str, rng: random.Random) -> str:
    if kind == "malformed":
        r = c.post("/v1/chat/completions", content=rng.choice(MALFORMED),
                   headers={"content-type": "application/json"})  # fmt: skip
        ok = r.status_code == 400 and r.json()["error"]["message"]
        return "ok" if ok else f"malformed: {r.status_code} {r.text[:200]}"
    ask = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    body = {"model": MODEL, "messages": ask, "max_tokens": rng.randint(4, 40), "temperature": 0.7}
    if kind == "whole":
        r = c.post("/v1/chat/completions", json=body)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return "ok" if ok else f"whole: {r.status_code} {r.text[:200]}"
    with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"{kind}: {r.status_code}"
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if kind == "leave" and lines >= 3:
                return "ok"  # closes the stream mid-answer
            if line == "data: [DONE]":
                return "ok"
    return f"{kind}: the stream ended without [DONE]"


def load(url: str, seconds: float) -> list[tuple[str, str]]:
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(i, url, until, outcomes, lock), daemon=True)
               for i in range(CLIENTS)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 2 * REQUEST_TIMEOUT_S)
        assert not t.is_alive(), "a client never finished"
    return outcomes


def _sample(root: int, seconds: float, out: list) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        out.append(rss_by_process(root))
        time.sleep(5)


def idle(url: str) -> bool:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#" and line)
    busy = ("thunderpool_active_requests", "thunderpool_queue_depth")
    return all(float(values.get(k, 0)) == 0 for k in busy)


@pytest.mark.timeout(SOAK_S + WARM_S + 600)
def test_soak():
    # The prefix cache keeps recent prompts' KV up to its budget by design (1 GiB by default):
    # a small one fills during the warm-up, so what grows after it is not the cache filling.
    # serve decodes eagerly by default (cli/jobs.py): the compiled step still grows each
    # rank's memory under this load (~0.8-1 MiB/s here, cause not found: README).
    # THUNDERPOOL_SOAK_COMPILE=1 soaks it (with 8 graphs, made in the warm-up).
    step = ("--compile",) if os.environ.get("THUNDERPOOL_SOAK_COMPILE") == "1" else ()
    args = ("--nodes", "2", "--max-context", "512", "--prefix-cache-gb", "0.02", *step)
    with serving(*args, env={"THUNDERPOOL_DECODE_GRAPHS": "8"}) as served:
        url = served.url
        before_ms = min(step_ms(url) for _ in range(2))  # each the better of a few: noise
        warm = load(url, WARM_S)
        rss0 = rss_by_process(served.proc.pid)
        series: list[dict[int, int]] = []  # every 5 s during the soak, for the figures
        sampler = threading.Thread(
            target=_sample, args=(served.proc.pid, SOAK_S, series), daemon=True
        )
        sampler.start()
        outcomes = load(url, SOAK_S)
        sampler.join(10)
        deadline = time.monotonic() + 60
        while not idle(url):
            assert time.monotonic() < deadline, "requests still running after the soak"
            time.sleep(0.5)
        rss1 = rss_by_process(served.proc.pid)
        after_ms = min(step_ms(url) for _ in range(2))  # a leak slows every one of them
        assert served.proc.poll() is None
    failed = [o for o in warm + outcomes if o[1] != "ok"]
    kinds = {k: sum(1 for kk, _ in outcomes if kk == k) for k in {k for k, _ in outcomes}}
    # Resident sets wander by tens of MiB from one sample to the next (allocator, GC): the
    # median of the first samples (the warm-up's end among them) against the last ones.
    early, late = [rss0, *series[:2]], [*series[-2:], rss1]
    growth = {
        pid: (statistics.median(r.get(pid, 0) for r in late)
              - statistics.median(r.get(pid, 0) for r in early)) / 2**20
        for pid in rss0
    }  # fmt: skip
    figures = {"soak_s": SOAK_S, "clients": CLIENTS, "requests": kinds,
               "failed": failed[:20], "step_ms_before": before_ms, "step_ms_after": after_ms,
               "step_ratio": after_ms / before_ms, "rss_mib_after_warmup":
               {p: v / 2**20 for p, v in rss0.items()}, "rss_growth_mib": growth,
               "rss_mib_every_5s": [{p: round(v / 2**20, 1) for p, v in r.items()}
                                    for r in series]}  # fmt: skip
    Path("artifacts").mkdir(exist_ok=True)
    Path("artifacts/soak.json").write_text(json.dumps(figures, indent=1))
    assert not failed, failed[:10]
    assert kinds.get("leave", 0) > 0 and kinds.get("malformed", 0) > 0
    assert all(g <= MIB_FLAT for g in growth.values()), growth
    # The step time after against before is a figure, not an assertion (no timing is asserted
    # in a test here): artifacts/soak.json has it. Read 0.97-1.23x so far; see README.
