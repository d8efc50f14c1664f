"""Which bytes of a model each rank loads: safetensors indexes, pieces, and their chunks.

A piece is one tensor, or one plain row/column range of one tensor (a TP rank's heads or
channels), or one small non-weight file (config, tokenizer, chat template). Its byte stream is
the C-order bytes of the slice, cut into chunks the source hashes and the receiver verifies.
The slices here are the ones parallel/tensor.py, parallel/vocab.py and parallel/experts.py cut,
computed with the same split functions, so a pre-sliced shard loads into exactly the same
sharded model. An EP rank gets rows [e0, e1) of stacked experts and, of a checkpoint that
stores each expert apart, only its own experts' tensors: the others are empty slices, which
the loader pads back with zeros that the rank never reads.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from thunderpool.errors import ModelError

CHUNK_BYTES = 8 << 20
# Row ranges of the vocabulary tables are written at their place in a full-shape, sparse
# tensor, not pre-sliced: a rank may read its rows of them straight from the file by name.
IN_PLACE = tuple(
    f"{m}.{t}" for m in ("lm_head", "model.embed_tokens") for t in ("weight", "scales", "biases")
)
# Families whose embedding is a plain nn.Embedding, which a vocabulary split may cut by rows.
_PLAIN_EMBEDDING = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SHARD_MANIFEST = "thunderpool-shard.json"  # engine/loader.py reads the same name
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SKIP_FILES = {"model.safetensors.index.json", SHARD_MANIFEST}
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


class Tensor(BaseModel):
    """One tensor of the source model: where it lives and what it is."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    file: str  # a safetensors file of the model directory
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file
    end: int


class ModelIndex(BaseModel):
    """What a source tells a receiver about a model before any weight moves."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    identity: str  # sha256 of config.json and every safetensors header
    config: dict
    tensors: dict[str, Tensor]
    files: dict[str, int]  # non-weight file name -> size


class Piece(BaseModel):
    """A tensor, a range [a, b) of it along `axis`, or (axis None, name "file:x") a file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    axis: int | None = None
    a: int = 0
    b: int = 0

    @property
    def is_file(self) -> bool:
        return self.name.startswith("file:")

    @property
    def key(self) -> str:
        return f"{self.name}|{self.axis}|{self.a}|{self.b}"


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where a piece's bytes are in its source file: `lines` runs of `line` bytes, the
    i-th at file offset base + i * stride; chunks hold whole lines (a contiguous piece is one
    long line cut by bytes)."""

    base: int
    lines: int
    line: int
    stride: int
    shape: tuple[int, ...]  # the piece's own shape

    @property
    def size(self) -> int:
        return self.lines * self.line

    @property
    def contiguous(self) -> bool:
        return self.lines == 1 or self.stride == self.line

    def lines_per_chunk(self, chunk: int) -> int:
        return max(1, chunk // max(self.line, 1))

    def chunks(self, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
        """(offset in the piece's stream, length) of each chunk."""
        if self.size == 0:
            return [(0, 0)]
        if self.contiguous:
            return [(o, min(chunk, self.size - o)) for o in range(0, self.size, chunk)]
        step = self.lines_per_chunk(chunk)
        return [
            (i * self.line, (min(i + step, self.lines) - i) * self.line)
            for i in range(0, self.lines, step)
        ]


def geometry(piece: Piece, index: ModelIndex) -> Geometry:
    if piece.is_file:
        size = index.files[piece.name.removeprefix("file:")]
        return Geometry(0, 1, size, size, (size,))
    t = index.tensors[piece.name]
    item = _ITEMSIZE[t.dtype]
    if piece.axis is None:
        return Geometry(t.start, 1, t.end - t.start, t.end - t.start, t.shape)
    shape = list(t.shape)
    row = item * _prod(shape[piece.axis + 1 :])  # bytes of one step along the axis
    outer = _prod(shape[: piece.axis])
    shape[piece.axis] = piece.b - piece.a
    if outer == 1:  # rows [a, b): one contiguous range
        return Geometry(t.start + piece.a * row, 1, (piece.b - piece.a) * row, 0, tuple(shape))
    full = t.shape[piece.axis] * row
    line = (piece.b - piece.a) * row
    return Geometry(t.start + piece.a * row, outer, line, full, tuple(shape))


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def read_header(path: Path) -> tuple[int, dict]:
    """(data start, header) of a safetensors file, reading only its header."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def index_model(model_dir: Path) -> ModelIndex:
    """The index of a model directory; reads config.json and the safetensors headers only."""
    digest = hashlib.sha256()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{model_dir} has no config.json; pass an MLX/HF model directory")
    config_bytes = config_path.read_bytes()
    digest.update(config_bytes)
    tensors: dict[str, Tensor] = {}
    weight_files = sorted(model_dir.glob("model*.safetensors"))
    if not weight_files:
        raise ModelError(f"{model_dir} has no model*.safetensors weight files")
    for path in weight_files:
        start, header = read_header(path)
        digest.update(path.name.encode() + json.dumps(header, sort_keys=True).encode())
        for name, t in header.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            tensors[name] = Tensor(
                file=path.name, dtype=t["dtype"], shape=tuple(t["shape"]), start=start + a,
                end=start + b,
            )  # fmt: skip
    files = {
        p.name: p.stat().st_size
        for p in sorted(model_dir.iterdir())
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in _SKIP_FILES
    }
    return ModelIndex(
        identity=digest.hexdigest(), config=json.loads(config_bytes), tensors=tensors, files=files
    )


# A routed expert's tensor inside a layer: stacked (switch_mlp.*, gpt-oss's experts.*) or one
# expert's own (experts.N.*, as Hugging Face checkpoints store them).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.(?:switch_mlp|experts)\.(?:(?P<e>\d+)\.)?")


# Projections whose output rows (True) or input columns (False) a TP rank keeps, by their
# name inside a layer: attention (q/k/v/o) and every gated MLP, dense, shared or expert.
_ATTENTION = {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
_GLU = {"gate_proj": True, "up_proj": True, "down_proj": False, "w1": True, "w3": True, "w2": False}
_MLP = re.compile(
    r"^(?P<block>(?:mlp|block_sparse_moe)(?:\.(?:switch_mlp|shared_experts?|experts\.\d+))?)"
    r"\.(?P<proj>\w+)$"
)


def shard_key(identity: str, pieces: list[Piece]) -> str:
    text = identity + "\n" + "\n".join(sorted(p.key for p in pieces))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_label(index: ModelIndex) -> str:
    kind = str(index.config.get("model_type", "model"))
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '', kind)}-{index.identity[:12]}"
