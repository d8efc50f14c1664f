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

from pydantic import BaseModel, ConfigDict, Field

from thunderpool.errors import ModelError, ShardingError
from thunderpool.parallel.experts import ExpertShare, routed_experts, split_experts
from thunderpool.parallel.packing import Packing, from_config, head_unit
from thunderpool.parallel.pipeline import split_layers
from thunderpool.parallel.tensor import proportional_split, split_heads

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


class RankLayout(BaseModel):
    """The layout one rank loads, as engine.job.RankJob states it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rank: int
    world: int
    parallel: str = "tp"
    tp_weights: tuple[float, ...] | None = None
    layer_split: tuple[int, ...] | None = None
    expert_split: tuple[int, ...] | None = None  # EP: routed experts per rank
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None  # EP: (layer, expert, rank)
    # Hybrid TP×PP: this TP rank's stage of `stages` (layers cut by layer_split), or None.
    stage: int | None = Field(None, ge=0)
    stages: int = Field(1, ge=1)


def rank_pieces(index: ModelIndex, layout: RankLayout) -> list[Piece]:
    """Exactly what this rank's loader reads: its stage's tensors (PP), its heads' and
    channels' slices (TP), or those plus its whole experts (EP), and every non-weight file."""
    files = [Piece(name=f"file:{f}") for f in index.files]
    names = sorted(index.tensors)
    if layout.stage is not None:  # hybrid: the stage's tensors, TP-sliced over its group
        stage = layout.stage, layout.stages
        names = [n for n in names if _in_stage(n, index.config, layout, *stage)]
    if layout.world == 1:
        return files + [Piece(name=n) for n in names]
    if layout.parallel == "pp":
        stage = layout.rank, layout.world
        return files + [Piece(name=n) for n in names if _in_stage(n, index.config, layout, *stage)]
    if layout.parallel == "ep":
        share = expert_share(index.config, layout)
        extra: dict[int, set[int]] = {}  # layer -> replicated experts this rank also holds
        for layer, e, r in layout.expert_replicas or ():
            if r == layout.rank:
                extra.setdefault(layer, set()).add(e)
        return files + [_ep_piece(n, index, layout, share, extra) for n in names]
    return files + [_tp_piece(n, index, layout) for n in names]


def expert_share(config: dict, layout: RankLayout) -> ExpertShare:
    """The routed experts this EP rank holds, split as parallel/experts.py splits them."""
    n = routed_experts(config)
    if not n:
        raise ShardingError(
            f"--parallel ep needs a MoE model; {config.get('model_type')} has no routed experts"
        )
    weights = list(layout.tp_weights or [1.0] * layout.world)
    counts = list(layout.expert_split) if layout.expert_split else None
    return split_experts(n, weights, counts)[layout.rank]


# A routed expert's tensor inside a layer: stacked (switch_mlp.*, gpt-oss's experts.*) or one
# expert's own (experts.N.*, as Hugging Face checkpoints store them).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.(?:switch_mlp|experts)\.(?:(?P<e>\d+)\.)?")


def _ep_piece(
    name: str, index: ModelIndex, layout: RankLayout, share: ExpertShare, extra: dict
) -> Piece:
    """The rows of stacked experts this rank holds, its own per-expert tensors whole and the
    others' as empty slices; everything else as TP slices it. A layer with replicated experts
    on this rank gets the one row range that covers them too (a piece is one range)."""
    config, t = index.config, index.tensors[name]
    m = _LAYER.search(name)
    e = _EXPERT.match(name[m.end() :]) if m else None
    if e is None or ("quantization_config" in config and "quantization" not in config):
        return _tp_piece(name, index, layout)
    copies = extra.get(int(m.group(1)), set())
    if e["e"] is not None:
        mine = share.e0 <= int(e["e"]) < share.e1 or int(e["e"]) in copies
        return Piece(name=name) if mine or not t.shape else Piece(name=name, axis=0, a=0, b=0)
    if t.shape and t.shape[0] == routed_experts(config):
        a, b = min([share.e0, *copies]), max([share.e1, *(c + 1 for c in copies)])
        return Piece(name=name, axis=0, a=a, b=b)
    return Piece(name=name)


def _in_stage(name: str, config: dict, layout: RankLayout, stage: int, stages: int) -> bool:
    """Whether stage `stage` of `stages` (a PP rank, or a hybrid group) reads `name`."""
    n_layers = config["num_hidden_layers"]
    bounds = split_layers(n_layers, stages, list(layout.layer_split or []) or None)
    start, end = bounds[stage]
    if m := _LAYER.search(name):
        return start <= int(m.group(1)) < end
    if "embed_tokens" in name or name.startswith("lm_head"):
        return stage == 0  # the leader's stage embeds and projects (pipeline.py, hybrid.py)
    if name in ("model.norm.weight", "model.norm.bias"):
        return stage == stages - 1
    return True  # a tensor we cannot place is sent whole rather than missed


def _tp_piece(name: str, index: ModelIndex, layout: RankLayout) -> Piece:
    """The slice tensor.shard / vocab.split_head keep of `name` on this rank; whole where
    the slicing is not a plain range of this one tensor (fused or MLA projections, unknown)."""
    config, t = index.config, index.tensors[name]
    whole = Piece(name=name)
    if "quantization_config" in config and "quantization" not in config:
        return whole  # a hub format mlx-lm converts on load: its stored layout is not ours
    weights = list(layout.tp_weights or [1.0] * layout.world)
    module, kind = name.rsplit(".", 1) if "." in name else (name, "")
    if module == "lm_head" or (
        module == "model.embed_tokens"
        and _splits_embedding()
        and config.get("model_type") in _PLAIN_EMBEDDING
    ):
        if len(t.shape) != 2 or kind == "bias":
            return whole
        a, b = proportional_split(t.shape[0], weights)[layout.rank]  # parallel/vocab.py
        return Piece(name=name, axis=0, a=a, b=b)
    m = _LAYER.search(name)
    if m is None:
        return whole
    prefix = name[: m.end()]  # "model.layers.3."
    features = _split_features(index, prefix, module[m.end() :], weights, layout.rank)
    if features is None:
        return whole
    (a, b), by_rows = features
    quant = _quantization(index, module)
    if quant == "unknown":
        return whole
    if by_rows:  # output features: rows of weight, scales, biases; the bias's last axis
        if kind not in ("weight", "scales", "biases", "bias") or len(t.shape) < 1:
            return whole
        axis = len(t.shape) - 1 if kind == "bias" else len(t.shape) - 2
        return Piece(name=name, axis=axis, a=a, b=b) if axis >= 0 else whole
    if kind not in ("weight", "scales", "biases") or len(t.shape) < 2:
        return whole  # a column-split bias is added once, after the all_sum: whole
    if quant is not None:  # input groups: packed words of weight, groups of scales/biases
        if a % quant.step or b % quant.step:
            return whole
        g = quant.group_size
        a, b = (quant.words(a), quant.words(b)) if kind == "weight" else (a // g, b // g)
    return Piece(name=name, axis=len(t.shape) - 1, a=a, b=b)


# Projections whose output rows (True) or input columns (False) a TP rank keeps, by their
# name inside a layer: attention (q/k/v/o) and every gated MLP, dense, shared or expert.
_ATTENTION = {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
_GLU = {"gate_proj": True, "up_proj": True, "down_proj": False, "w1": True, "w3": True, "w2": False}
_MLP = re.compile(
    r"^(?P<block>(?:mlp|block_sparse_moe)(?:\.(?:switch_mlp|shared_experts?|experts\.\d+))?)"
    r"\.(?P<proj>\w+)$"
)


def _split_features(
    index: ModelIndex, prefix: str, module: str, weights: list[float], rank: int
) -> tuple[tuple[int, int], bool] | None:
    """This rank's output or input feature range [a, b) of the projection `module` of the
    layer at `prefix`, and whether it is a row (output) split; None: it is kept whole."""
    config = index.config
    if module.startswith("self_attn."):
        proj = module.removeprefix("self_attn.")
        if (
            proj not in _ATTENTION
            or f"{prefix}self_attn.kv_a_proj_with_mqa.weight" in index.tensors
        ):
            return None  # MLA attention splits through mlx-lm's own shard(): whole
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        try:
            share = split_heads(heads, kv, weights, _head_unit(index, head_dim))[rank]
        except ShardingError:
            return None  # the rank refuses this split itself, with its own message
        if proj in ("k_proj", "v_proj"):
            return (share.kv0 * head_dim, share.kv1 * head_dim), True
        return (share.q0 * head_dim, share.q1 * head_dim), _ATTENTION[proj]
    m = _MLP.match(module)
    if m is None or m["proj"] not in _GLU:
        return None
    block = m["block"]
    gate_name = "w1" if m["proj"].startswith("w") else "gate_proj"
    if gate_name == "w1" and not block.startswith("block_sparse_moe.experts."):
        return None  # w1/w2/w3 are Mixtral's expert names only (elsewhere they mean others)
    # The channel split _shard_glu takes: the gate's rows, in steps of quantization groups.
    gate = index.tensors.get(f"{prefix}{block}.{gate_name}.weight")
    if gate is None or len(gate.shape) < 2:
        return None
    siblings = [
        f"{prefix}{block}.{p}" for p in (("w1", "w2", "w3") if gate_name == "w1" else
                                         ("gate_proj", "up_proj", "down_proj"))
    ]  # fmt: skip
    quants = [_quantization(index, s) for s in siblings]
    if "unknown" in quants:
        return None
    down = quants[1]  # only the down projection is cut along its (packed) input
    align = down.step if down else 1
    try:
        span = proportional_split(gate.shape[-2], weights, align)[rank]
    except ShardingError:
        return None  # the rank refuses this split itself, with its own message
    return span, _GLU[m["proj"]]


def _quantization(index: ModelIndex, module: str) -> Packing | str | None:
    """How a projection is quantized as config.json states it (any width, affine or mx/nv),
    None for a plain one, "unknown" where the stored shapes do not match the config."""
    if f"{module}.scales" not in index.tensors:
        return None
    q = index.config.get("quantization") or {}
    p = from_config(q.get(module) if isinstance(q.get(module), dict) else q)
    w, s = index.tensors.get(f"{module}.weight"), index.tensors[f"{module}.scales"]
    if p is None or w is None or w.dtype != "U32" or not w.shape or not s.shape:
        return "unknown"
    if w.shape[-1] * 32 % p.bits or w.shape[-1] * 32 // p.bits != s.shape[-1] * p.group_size:
        return "unknown"
    if p.has_biases != (f"{module}.biases" in index.tensors):
        return "unknown"
    return p


def _head_unit(index: ModelIndex, head_dim: int) -> int:
    """Whole query heads per cut, as parallel/tensor.py computes it from the loaded o_projs."""
    steps = []
    for name in index.tensors:
        if name.endswith(".self_attn.o_proj.scales"):
            p = _quantization(index, name.removesuffix(".scales"))
            if isinstance(p, Packing):
                steps.append(p.step)
    return head_unit(head_dim, steps)


def _splits_embedding() -> bool:
    """True where TP ranks keep only their rows of the embedding (parallel/vocab.split_vocab),
    else every rank needs all of it for the lookup."""
    from thunderpool.parallel import vocab

    return hasattr(vocab, "split_vocab")


def shard_key(identity: str, pieces: list[Piece]) -> str:
    text = identity + "\n" + "\n".join(sorted(p.key for p in pieces))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_label(index: ModelIndex) -> str:
    kind = str(index.config.get("model_type", "model"))
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '', kind)}-{index.identity[:12]}"
