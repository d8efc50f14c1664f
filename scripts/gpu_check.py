"""The GPU run that would prove the compiled decode step (issue 25 item 10): until it passes on
a GPU, `--compile` is off by default there (engine/compiled.py: wanted).

On a machine with an NVIDIA GPU and MLX's CUDA build (`pip install "mlx[cuda]"` and this repo
with `pip install -e .`), or on a Mac (Metal), from the repository root:

    PYTHONPATH=src:tests python3 scripts/gpu_check.py [--tol 1e-3] [--keep DIR]

Tiny random llama, qwen3 (uneven KV heads on 2 ranks, q/k norms) and qwen3_moe checkpoints,
float32, on MLX's default device, which must be the GPU (`--cpu` runs the same checks where
there is no GPU: a dry run of this script, not a proof). Checks, each compiled (`--compile`)
against eager (`--no-compile`) on the same weights:
  A. one rank in this process, teacher-forced (tests/engine/compiled_ranks.py): a row alone, a
     second row joining (left padding), the first leaving; every step's logits within --tol,
     the same argmax, and every decode step compiled;
  B. TP2 and PP2 as two rank processes sharing the one GPU (MLX ring on loopback): the same;
  C. greedy decoding through the real launcher (LocalInstance, one rank, TP2, PP2): identical
     tokens and logits within --tol.
Prints one line per check and exits non-zero if any fails. No test runs it: no GPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import thunderpool

thunderpool.hide_torch()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.utils import _get_classes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RANKS = REPO / "tests" / "engine" / "compiled_ranks.py"
BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}
TINY = {  # as tests/conftest.py's TINY
    "llama": {
        **BASE,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        **BASE,
        "model_type": "qwen3",
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        **BASE,
        "model_type": "qwen3_moe",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}
TP2 = ("llama", "qwen3", "qwen3_moe")
PP2 = ("llama", "qwen3_moe")
PROMPTS = ((3, 17, 42, 9, 100, 7, 250), (5, 8, 13, 21, 34, 55, 89, 144, 233, 1, 2, 3, 4))


def make_tiny(kind: str, path: Path, seed: int = 0) -> Path:
    """A random checkpoint with Hugging Face tensor names (as tests/conftest.py's make_tiny)."""
    config = TINY[kind]
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        w = w * 2.0 if w.ndim == 2 and "embed" not in name else w  # peaked logits: no ties
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            for e in range(w.shape[0]):
                weights[f"{prefix}.experts.{e}.{proj}"] = w[e]
        else:
            weights[name] = w
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class Report:
    def __init__(self, tol: float):
        self.tol, self.failed = tol, []

    def logits(self, name: str, eager, comp, compiled_steps: int | None, want: int) -> None:
        """Teacher-forced results of compiled_ranks.compare (lists of (B, V) per step)."""
        worst, same = 0.0, True
        for e, c in zip(eager, comp, strict=True):
            e, c = np.array(e), np.array(c)
            worst = max(worst, float(np.abs(c - e).max()))
            same &= bool((c.argmax(-1) == e.argmax(-1)).all())
        ok = same and worst <= self.tol and len(eager) == len(comp) == want
        ok &= compiled_steps == want
        self.line(
            ok,
            f"{name}: max |compiled - eager| {worst:.2e}, argmax equal {same}, "
            f"{compiled_steps}/{want} steps compiled",
        )

    def trace(self, name: str, eager: dict, comp: dict) -> None:
        same = np.array_equal(eager["tokens"], comp["tokens"])
        worst = float(np.abs(eager["logits"] - comp["logits"]).max())
        self.line(
            same and worst <= self.tol,
            f"{name}: greedy tokens equal {same}, max |compiled - eager| {worst:.2e}",
        )

    def line(self, ok: bool, text: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {text}", flush=True)
        if not ok:
            self.failed.append(text)


def one_rank(models: dict[str, Path], report: Report) -> None:
    from compiled_ranks import PHASES, compare

    from thunderpool.engine.loader import Layout, load_shard

    steps = sum(s for _, _, s in PHASES)
    group = mx.distributed.init()
    for kind, path in models.items():
        runner, _, _ = load_shard(path, group, Layout(compile=True))
        reference, _, _ = load_shard(path, group, Layout(compile=False))
        result = compare(runner, reference)
        report.logits(
            f"A one rank {kind}",
            result["eager"]["logits"],
            result["compiled"]["logits"],
            result["compiled"]["compiled_steps"],
            steps,
        )


def two_ranks(models: dict[str, Path], tmp: Path, report: Report) -> None:
    from compiled_ranks import PHASES

    from thunderpool.launch.local import free_ports

    steps = sum(s for _, _, s in PHASES)
    layouts = {
        "tp": {k: str(models[k]) for k in TP2},
        "pp": {k: str(models[k]) for k in PP2},
    }
    spec, out, hosts = tmp / "spec.json", tmp / "out.json", tmp / "hosts.json"
    spec.write_text(json.dumps({"layouts": layouts}))
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = []
    for rank in range(2):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}
        log = (tmp / f"rank{rank}.log").open("w")
        cmd = [sys.executable, str(RANKS), str(spec), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        logs = "\n".join((tmp / f"rank{r}.log").read_text()[-3000:] for r in range(2))
        report.line(False, f"B TP2/PP2 rank processes exited {codes}:\n{logs}")
        return
    for name, result in json.loads(out.read_text()).items():
        report.logits(
            f"B {name}",
            result["eager"]["logits"],
            result["compiled"]["logits"],
            result["compiled"]["compiled_steps"],
            steps,
        )


def traced(model: Path, out: Path, nodes: int, parallel: str, compile: bool) -> dict:
    from thunderpool.engine.job import RankJob, TraceTask
    from thunderpool.launch.local import LocalInstance

    task = TraceTask(prompts=PROMPTS, max_tokens=24, out=str(out))
    job = RankJob(
        model_dir=str(model), world_size=nodes, parallel=parallel, task=task, compile=compile
    )
    with LocalInstance(job, timeout=600, pin=False) as inst:
        list(inst.events())
    data = np.load(out)
    return {"tokens": data["tokens"], "logits": data["logits"]}


def launched(models: dict[str, Path], tmp: Path, report: Report) -> None:
    cells = [("llama", 1, "tp"), ("qwen3", 1, "tp")]
    cells += [(k, 2, "tp") for k in TP2] + [(k, 2, "pp") for k in PP2]
    for kind, nodes, parallel in cells:
        runs = {
            c: traced(models[kind], tmp / f"{kind}-{nodes}{parallel}-{c}.npz", nodes, parallel, c)
            for c in (False, True)
        }
        name = f"C {kind} {'one rank' if nodes == 1 else f'{parallel.upper()}{nodes}'}"
        report.trace(name, runs[False], runs[True])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tol", type=float, default=1e-3, help="float32 logits tolerance")
    parser.add_argument(
        "--cpu", action="store_true", help="run on a machine without a GPU: a dry run, no proof"
    )
    parser.add_argument("--keep", type=Path, help="write the checkpoints and logs here")
    args = parser.parse_args()
    if mx.default_device() != mx.gpu and not args.cpu:
        print(
            "MLX's default device is the CPU: install mlx[cuda] (or run on a Mac); --cpu for a "
            "dry run",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(RANKS.parent))
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    info = mx.metal.device_info() if mx.metal.is_available() else {}
    print(
        f"mlx {mx.__version__}, default device {mx.default_device()} "
        f"{info.get('device_name', '')}, tol {args.tol}",
        flush=True,
    )
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        models = {k: make_tiny(k, tmp / k) for k in TINY}
        report = Report(args.tol)
        one_rank(models, report)
        two_ranks(models, tmp, report)
        launched(models, tmp, report)
    took = time.monotonic() - start
    if report.failed:
        print(f"{len(report.failed)} check(s) FAILED in {took:.0f} s", flush=True)
        return 1
    print(f"all checks passed on the {device} in {took:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
