"""Import a llama.cpp GGUF file (llama / qwen2 families) as an MLX / Hugging Face model directory.

The output (`config.json`, `model*.safetensors`, tokenizer files) loads with `mlx_lm.load`.
Tensor names and the RoPE row permutation follow llama.cpp's `convert_hf_to_gguf.py`, inverted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from thunderpool.errors import ModelError
from thunderpool.models.gguf_tokenizer import GGUFVocab, write_tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "float16", "bfloat16", "q4")
# Written last inside the temp dir, so a directory holding it is a complete import.
IMPORT_MARKER = "thunderpool-import.json"
# Q4_1 block: fp16 scale d, fp16 min m, 16 bytes holding 32 4-bit values (w = d*q + m).
_Q4_1_GROUP, _Q4_1_BYTES = 32, 20
_SHARD_BYTES = 4 << 30

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True, slots=True)
class _Planned:
    """One GGUF tensor and where it goes in the HF checkpoint."""

    gguf_name: str
    hf_name: str
    tensor: Any  # gguf.ReaderTensor
    n_rope_heads: int | None  # heads to un-permute rows for (llama q/k), else None


def import_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = True
) -> Path:
    """Convert `gguf_path` into an MLX model directory at `out_dir` and return `out_dir`.

    `dtype` is float32, float16 or bfloat16 (everything dequantized), or q4 (Q4_1 matrices
    kept losslessly as MLX affine 4-bit, group size 32; other tensors dequantized to float32).
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported for GGUF import; use one of {DTYPES}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelError(
            f"output directory {out_dir} already exists and is not empty; remove it or choose "
            "another directory"
        )
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    arch = architecture(meta, gguf_path)
    config = hf_config(meta, arch, {t.name for t in reader.tensors}, dtype)
    vocab = GGUFVocab.from_metadata(meta)
    plan = _plan(reader, arch, config, gguf_path)
    _check_types(plan, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _staging_dir(out_dir) as tmp:
        write_tokenizer(vocab, tmp, config.get("max_position_embeddings"))
        _write_weights(plan, tmp, dtype, progress, gguf_path.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        stat = gguf_path.stat()
        marker = {"source": str(gguf_path), "size": stat.st_size, "mtime": stat.st_mtime}
        (tmp / IMPORT_MARKER).write_text(json.dumps({**marker, "dtype": dtype}) + "\n")
        _publish(tmp, out_dir)
    return out_dir


def open_gguf(path: Path):
    """A `gguf.GGUFReader` for `path`, or a ModelError saying why the file cannot be read."""
    import gguf

    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF'); "
            "pass a llama.cpp .gguf model file"
        )
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:
        raise ModelError(f"cannot read GGUF file {path}: {e}; the file may be truncated") from e


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def architecture(meta: dict[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}. For other models pass a Hugging Face MLX repo id"
        )
    return arch


def hf_config(meta: dict[str, Any], arch: str, tensor_names: set[str], dtype: str) -> dict:
    """An HF-style config.json for mlx-lm's llama / qwen2 models from `<arch>.*` metadata."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelError(f"GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        # Some files store one count per layer; only a uniform count maps onto HF configs.
        if len(set(n_kv)) != 1:
            raise ModelError(f"per-layer kv head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    tied = "output.weight" not in tensor_names
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(key("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "vocab_size": int(key("vocab_size", len(tokens))),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32" if dtype == "q4" else dtype,
    }
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    else:
        config["use_sliding_window"] = False
    for name in ("bos", "eos", "padding"):
        if (idx := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(idx)
    if (scaling := meta.get(f"{arch}.rope.scaling.type")) not in (None, "none"):
        if scaling != "linear":
            raise ModelError(f"GGUF rope scaling {scaling!r} is not supported (only 'linear')")
        config["rope_scaling"] = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    if dtype == "q4":
        config["quantization"] = {"group_size": _Q4_1_GROUP, "bits": 4}
        config["quantization_config"] = dict(config["quantization"])
    return config


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name for a GGUF tensor name, or None if the name is unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `permute(w, n_head, ...)`, which interleaves each head's two RoPE halves.

    llama.cpp: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot un-permute {rows} rows over {n_head} heads (not divisible)")
    # (n_head, half, 2, ...) -> (n_head, 2, half, ...)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1_to_mlx(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack Q4_1 rows (rows, n_blocks * 20 bytes) as MLX affine 4-bit (w, scales, biases).

    Q4_1 keeps value i in the low nibble and value i+16 in the high nibble of byte i; MLX packs
    8 consecutive values per uint32, value j in bits 4j..4j+3.
    """
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, _Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (rows, nb)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # (rows, nb, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint32)  # (rows, nb, 32)
    q = q.reshape(rows, -1, 8)  # (rows, in / 8, 8)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    packed = np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)  # (rows, in / 8)
    return packed, d, m


def _plan(reader, arch: str, config: dict, path: Path) -> list[_Planned]:
    plan = []
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ModelError(
                f"{path} uses llama3-style rope frequency scaling (rope_freqs.weight), which the "
                "GGUF importer does not support; use the model's Hugging Face MLX repo instead"
            )
        name = hf_name(t.name)
        if name is None:
            raise ModelError(f"unexpected tensor {t.name!r} in {path} for architecture {arch!r}")
        heads = None
        if arch == "llama" and ".attn_q." in t.name:
            heads = config["num_attention_heads"]
        elif arch == "llama" and ".attn_k." in t.name:
            heads = config["num_key_value_heads"]
        plan.append(_Planned(t.name, name, t, heads))
    return plan


def _check_types(plan: list[_Planned], path: Path) -> None:
    """Fail before writing anything if a tensor uses a type the gguf package cannot dequantize."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    seen: dict[Any, str] = {}
    for p in plan:
        seen.setdefault(p.tensor.tensor_type, p.gguf_name)
    for qtype, name in seen.items():
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError as e:
            raise ModelError(
                f"tensor {name!r} in {path} uses quantization {qtype.name}, which cannot be "
                "dequantized by the installed gguf package; upgrade it (pip install -U gguf) or "
                "use another quantization of the model"
            ) from e


def _convert(p: _Planned, dtype: str) -> dict[str, mx.array]:
    """The MLX arrays for one GGUF tensor (three for a q4-kept matrix)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = p.tensor
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml lists dims innermost first
    is_matrix = len(shape) == 2 and p.hf_name.endswith(".weight") and "embed" not in p.hf_name
    if dtype == "q4" and t.tensor_type == GGMLQuantizationType.Q4_1 and is_matrix:
        w, scales, biases = q4_1_to_mlx(np.asarray(t.data))
        if p.n_rope_heads:
            w, scales, biases = (unpermute_rope(a, p.n_rope_heads) for a in (w, scales, biases))
        base = p.hf_name.removesuffix(".weight")
        arrays = {".weight": w, ".scales": scales, ".biases": biases}
        return {base + k: mx.array(np.ascontiguousarray(a)) for k, a in arrays.items()}
    values = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
    if p.n_rope_heads:
        values = unpermute_rope(values, p.n_rope_heads)
    target = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(dtype, mx.float32)
    return {p.hf_name: mx.array(np.ascontiguousarray(values)).astype(target)}


def _out_bytes(p: _Planned, dtype: str) -> int:
    n = int(np.prod(p.tensor.shape))
    return n * (2 if dtype in ("float16", "bfloat16") else 4)


def _write_weights(plan: list[_Planned], out: Path, dtype: str, progress: bool, label: str) -> None:
    """Write `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus an index."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in plan:
        b = _out_bytes(p, dtype)
        if shards[-1] and size + b > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += b
    n = len(shards)
    weight_map: dict[str, str] = {}
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    # Progress goes to stderr so that stdout carries only the answer.
    console = Console(stderr=True)
    with Progress(*columns, TimeElapsedColumn(), disable=not progress, console=console) as bar:
        task = bar.add_task(f"importing {label}", total=len(plan))
        for i, shard in enumerate(shards, 1):
            fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            arrays: dict[str, mx.array] = {}
            for p in shard:
                arrays.update(_convert(p, dtype))
                bar.advance(task)
            mx.save_safetensors(str(out / fname), arrays, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(arrays, fname))
    if n > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


@contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    """A temp dir next to `out_dir` (same filesystem, so the final rename is atomic)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model dir should read like any other
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temp dir into place; an empty `out_dir` left by a caller is replaced."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    try:
        os.rename(tmp, out_dir)
    except OSError as e:
        # A concurrent import of the same file may have finished first; its result is as good.
        if (out_dir / IMPORT_MARKER).is_file():
            return
        raise ModelError(f"cannot move the imported model into {out_dir}: {e}") from e
