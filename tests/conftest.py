"""Shared fixtures: tiny random HF-format checkpoints and a helper to run rank instances."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

# Started in the background of a non-interactive shell (`pytest &`), pytest inherits SIGINT
# ignored and so would every process it starts; the Ctrl-C tests need it delivered.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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

# The embedded SmolLM2-135M's shape, as the planner reads a config.
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}

TINY = {
    # 8 query / 2 KV heads: TP2 is even (mlx-lm's shard), TP3 replicates KV heads.
    "llama": {
        **BASE,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    # 6 query / 3 KV heads like SmolLM2: TP2 splits KV heads 2+1, TP3 is even.
    "qwen3": {
        **BASE,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        **BASE,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
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


def make_tiny(kind: str, path: Path, seed: int = 0, **config_fields) -> Path:
    """Write a random checkpoint with Hugging Face tensor names (experts unstacked);
    `config_fields` change the shape of `kind`."""
    config = {**TINY[kind], **config_fields}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        # Bigger-than-default weights give peaked logits, so greedy ties are not a coin flip.
        w = w * 2.0 if w.ndim == 2 and "embed" not in name else w
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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny(kind, root / kind) for kind in TINY}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make_tiny_chat(path: Path, seed: int = 0, **config_fields) -> Path:
    """A tiny random llama with the embedded SmolLM2's tokenizer and chat template: what
    `serve` needs, loaded in a blink; `config_fields` change its shape."""
    import shutil

    from thunderpool.models.source import resolve_model

    source = resolve_model(None, progress=False)
    config = {
        **TINY["llama"],
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 2048,
        **config_fields,
    }
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {
        n: w * 2.0 if w.ndim == 2 and "embed" not in n else w
        for n, w in tree_flatten(model.parameters())
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> Path:
    return make_tiny_chat(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat")


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory):
    """transformers' own GGUF loader on the packaged SmolLM2: (model, tokenizer, the dir that
    holds a link to the file, its name). The reference of the GGUF import and of the engine's
    tokens, loaded once: dequantizing the GGUF is most of its cost."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF weights
    from thunderpool.errors import ModelError
    from thunderpool.models.source import default_gguf_path

    try:
        gguf = default_gguf_path()
    except ModelError as e:
        pytest.skip(str(e))
    # transformers wants (dir, gguf_file=name): the packaged file linked into a dir of its own.
    d = tmp_path_factory.mktemp("gguf")
    (d / gguf.name).symlink_to(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval(), tok, d, gguf.name


def tiny_prompts(n: int = 2, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


def run_trace(
    model_dir: Path,
    out: Path,
    nodes: int = 1,
    parallel: str = "tp",
    prompts: list[list[int]] | None = None,
    max_tokens: int = 32,
    sampling=None,
    env: dict[str, str] | None = None,
    **job_fields,
) -> dict[str, np.ndarray]:
    """Greedy-decode `prompts` on `nodes` real rank processes; returns tokens and logits."""
    from thunderpool.engine.job import RankJob, TraceTask
    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.launch.local import LocalInstance

    task = TraceTask(
        prompts=tuple(map(tuple, prompts or tiny_prompts())),
        max_tokens=max_tokens,
        out=str(out),
        sampling=sampling or SamplingParams(),
    )
    job = RankJob(
        model_dir=str(model_dir), world_size=nodes, parallel=parallel, task=task, **job_fields
    )
    with LocalInstance(job, timeout=120, env=env) as inst:
        events = list(inst.events())
    assert [e.event["kind"] for e in events].count("loaded") == nodes
    data = np.load(out)
    return {"tokens": data["tokens"], "logits": data["logits"], "events": events}


def greedy_full_forward(model_dir: Path, prompts, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and fp32 last-position logits of mlx-lm's own model in this process,
    recomputing the whole sequence at every step (no KV cache): the unsharded reference."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    tokens, logits = [], []
    for prompt in prompts:
        seq, toks, lgs = list(prompt), [], []
        for _ in range(steps):
            out = model(mx.array([seq]))
            out = (out[0] if isinstance(out, tuple) else out)[0, -1].astype(mx.float32)
            toks.append(int(mx.argmax(out).item()))
            lgs.append(np.array(out))
            seq.append(toks[-1])
        tokens.append(toks)
        logits.append(np.stack(lgs))
    return np.array(tokens), np.stack(logits)


@pytest.fixture(scope="session")
def one_rank_trace(tmp_path_factory):
    """run_trace on one rank, once per (model files, prompts, max_tokens): the tests that check
    sharded runs against the same one-rank reference share its launch (greedy decoding on one
    rank is deterministic). Returns trace(model_dir, prompts, max_tokens) -> run_trace's dict."""
    root = tmp_path_factory.mktemp("one-rank")
    done: dict[tuple, dict] = {}

    def trace(model_dir: Path, prompts: list[list[int]], max_tokens: int = 32) -> dict:
        files = sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model_dir.iterdir()
        )
        key = (str(model_dir.resolve()), tuple(files), tuple(map(tuple, prompts)), max_tokens)
        if key not in done:
            out = root / f"{len(done)}.npz"
            done[key] = run_trace(model_dir, out, 1, prompts=prompts, max_tokens=max_tokens)
        return done[key]

    return trace
