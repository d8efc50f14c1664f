"""Import a llama.cpp GGUF file as an MLX / Hugging Face model directory.

The output (`config.json`, `model*.safetensors`, tokenizer files) loads with `mlx_lm.load`.
The header is read and the architecture checked before any tensor data is touched; the
per-family maps live in `gguf_arch`, the data conversions in `gguf_quant`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.errors import ModelError
from thunderpool.models import gguf_arch, gguf_quant
from thunderpool.models.gguf_arch import SUPPORTED_ARCHS, OutTensor
from thunderpool.models.gguf_file import GGUFFile, TensorInfo
from thunderpool.models.gguf_quant import GROUP_SIZE, QUANT_BITS, q4_1_to_mlx, q8_0_to_mlx
from thunderpool.models.gguf_tokenizer import GGUFVocab, write_tokenizer

__all__ = ["IMPORT_MARKER", "SUPPORTED_ARCHS", "import_gguf", "q4_1_to_mlx", "q8_0_to_mlx"]

DTYPES = ("float32", "float16", "bfloat16", "q4", "q8")
# Written last inside the temp dir, so a directory holding it is a complete import.
IMPORT_MARKER = "thunderpool-import.json"
_SHARD_BYTES = 4 << 30


def import_gguf(
    gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = True
) -> Path:
    """Convert `gguf_path` into an MLX model directory at `out_dir` and return `out_dir`.

    `dtype` is float32, float16 or bfloat16 (everything dequantized), or q4 / q8: every weight
    mlx-lm can quantize is stored MLX affine (group 32) - Q4_1 / Q8_0 sources repacked
    losslessly, any other type dequantized and re-quantized - and the rest as float32.
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported for GGUF import; use one of {DTYPES}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelError(
            f"output directory {out_dir} already exists and is not empty; remove it or choose "
            "another directory"
        )
    reader = GGUFFile(gguf_path)
    # The architecture is (in every llama.cpp file) the first key: refuse before reading more.
    arch = gguf_arch.architecture(reader.get("general.architecture"), gguf_path)
    meta = reader.read_metadata()
    vocab = GGUFVocab.from_metadata(meta)
    names = {t.name: t for t in reader.tensors}
    config = gguf_arch.hf_config(meta, arch, names, dtype, read=lambda t: _values(reader, t))
    n_blocks = int(meta.get(f"{arch}.block_count", 0))
    plan = gguf_arch.plan(arch, config, reader.tensors, gguf_path, n_blocks)
    first_of_type: dict[int, str] = {}
    for t in (t for p in plan for t in p.sources):
        first_of_type.setdefault(t.qtype, t.name)
    for qtype, name in first_of_type.items():
        gguf_quant.check_dequantizable(qtype, name)
    quantized = _quantized_names(config, plan, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _staging_dir(out_dir) as tmp:
        write_tokenizer(vocab, tmp, config.get("max_position_embeddings"))
        other_bits = _write_weights(reader, plan, tmp, dtype, quantized, progress)
        if dtype in QUANT_BITS:
            # mlx-lm reads per-module entries as overrides of the default bits.
            q: dict = {"group_size": GROUP_SIZE, "bits": QUANT_BITS[dtype]}
            q |= {m: {"group_size": GROUP_SIZE, "bits": b} for m, b in other_bits.items()}
            config["quantization"] = q
            config["quantization_config"] = dict(q)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        stat = gguf_path.stat()
        marker = {"source": str(gguf_path), "size": stat.st_size, "mtime": stat.st_mtime}
        (tmp / IMPORT_MARKER).write_text(json.dumps({**marker, "dtype": dtype}) + "\n")
        _publish(tmp, out_dir)
    return out_dir


def _quantized_names(config: dict, plan: list[OutTensor], dtype: str) -> set[str]:
    """Check every tensor against mlx-lm's model for `config`; return the weights to quantize.

    The model is built lazily (no memory): its parameter shapes catch a wrong map before any
    byte is written, and its quantizable modules (Linear, Embedding, SwitchLinear) are exactly
    the ones mlx-lm quantizes when it loads the checkpoint.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        model = model_cls(args_cls.from_dict(config))
    except Exception as e:  # mlx-lm raises ValueError/KeyError/AssertionError for bad configs
        raise ModelError(
            f"mlx-lm cannot build a {config['model_type']} model from this GGUF's metadata "
            f"({type(e).__name__}: {e})"
        ) from e
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    for p in plan:
        want = shapes.get(p.hf_name)
        if want is not None and want != p.shape:
            raise ModelError(
                f"tensor {p.sources[0].name!r} has shape {p.shape} but {config['model_type']} "
                f"expects {want} for {p.hf_name}; the GGUF metadata and tensors disagree"
            )
    if dtype not in QUANT_BITS:
        return set()
    modules = {path for path, m in model.named_modules() if hasattr(m, "to_quantized")}
    return {
        p.hf_name
        for p in plan
        if p.hf_name.endswith(".weight")
        and p.hf_name.removesuffix(".weight") in modules
        and gguf_quant.quantizable(p.shape)
    }


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `permute(w, n_head, ...)`, which interleaves each head's two RoPE halves.

    llama.cpp: `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelError(f"cannot un-permute {rows} rows over {n_head} heads (not divisible)")
    # (n_head, half, 2, ...) -> (n_head, 2, half, ...)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _values(reader: GGUFFile, p: OutTensor | TensorInfo) -> np.ndarray:
    """The tensor as float32, with llama.cpp's transforms undone."""
    if isinstance(p, TensorInfo):
        p = OutTensor(p.name, (p,))
    arrays = [
        gguf_quant.dequantize(reader.raw(t), t.qtype, t.name).reshape(t.shape) for t in p.sources
    ]
    values = p.combine(arrays) if p.combine else arrays[0]
    if p.rope_heads:
        values = unpermute_rope(values, p.rope_heads)
    if p.shift:
        values = values + np.float32(p.shift)
    return values


def _convert(
    reader: GGUFFile, p: OutTensor, dtype: str, quantize: bool
) -> tuple[dict[str, mx.array], int | None]:
    """The MLX arrays for one output tensor, and its bits when stored quantized."""
    if quantize:
        base = p.hf_name.removesuffix(".weight")
        src = p.sources[0]
        exact = None
        if len(p.sources) == 1 and not p.combine and not p.shift:
            exact = gguf_quant.lossless(reader.raw(src), src.qtype, dtype, base)
        if exact is not None:
            *arrays, bits = exact
            # Un-permuting rows commutes with row-wise quantization, so it stays exact.
            if p.rope_heads:
                arrays = [unpermute_rope(a, p.rope_heads) for a in arrays]
            w, scales, biases = (mx.array(np.ascontiguousarray(a)) for a in arrays)
        else:
            bits = QUANT_BITS[dtype]
            w, scales, biases = gguf_quant.quantize(_values(reader, p), dtype)
        return {f"{base}.weight": w, f"{base}.scales": scales, f"{base}.biases": biases}, bits
    target = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(dtype, mx.float32)
    return {p.hf_name: mx.array(np.ascontiguousarray(_values(reader, p))).astype(target)}, None


def _out_bytes(p: OutTensor, dtype: str, quantized: bool) -> int:
    n = int(np.prod(p.shape))
    if quantized:
        return n * QUANT_BITS[dtype] // 8 + n // GROUP_SIZE * 8
    return n * (2 if dtype in ("float16", "bfloat16") else 4)


def _write_weights(
    reader: GGUFFile,
    plan: list[OutTensor],
    out: Path,
    dtype: str,
    quantized: set[str],
    progress: bool,
) -> dict[str, int]:
    """Write `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus an index.

    Returns the bits of each quantized module stored at other than the --dtype's bits.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    shards: list[list[OutTensor]] = [[]]
    size = 0
    for p in plan:
        b = _out_bytes(p, dtype, p.hf_name in quantized)
        if shards[-1] and size + b > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += b
    n = len(shards)
    weight_map: dict[str, str] = {}
    other_bits: dict[str, int] = {}
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    # Progress goes to stderr so that stdout carries only the answer.
    console = Console(stderr=True)
    with Progress(*columns, TimeElapsedColumn(), disable=not progress, console=console) as bar:
        task = bar.add_task(f"importing {reader.path.name}", total=len(plan))
        for i, shard in enumerate(shards, 1):
            fname = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            arrays: dict[str, mx.array] = {}
            for p in shard:
                converted, bits = _convert(reader, p, dtype, p.hf_name in quantized)
                arrays.update(converted)
                if bits is not None and bits != QUANT_BITS[dtype]:
                    other_bits[p.hf_name.removesuffix(".weight")] = bits
                bar.advance(task)
            mx.save_safetensors(str(out / fname), arrays, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(arrays, fname))
    if n > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return other_bits


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
