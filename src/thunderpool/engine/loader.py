"""Build a model lazily, cut or shard it for this rank, then read only this rank's tensors.

mlx-lm builds the model with lazily loaded weights; dropping layers (PP) or slicing projections
(TP) before evaluation means no rank ever materialises the whole model. Evaluating one layer at
a time bounds the transient memory of slicing to one layer's full tensors.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_config, load_model

from thunderpool.engine import kv_quant
from thunderpool.engine.compiled import wanted
from thunderpool.engine.runner import Runner
from thunderpool.errors import ModelError
from thunderpool.models import published, shape
from thunderpool.parallel import experts, native, pipeline, tensor, vocab
from thunderpool.parallel.anatomy import anatomy
from thunderpool.parallel.layout import Layout
from thunderpool.parallel.native import NativeStage
from thunderpool.parallel.packing import config_head_unit
from thunderpool.parallel.pipeline import PipelineStage, split_layers
from thunderpool.parallel.stored_rows import StoredRows


@dataclass(frozen=True, slots=True)
class LoadStats:
    rank: int
    param_bytes: int
    peak_rss_bytes: int
    seconds: float
    layers: tuple[int, int]
    method: str
    experts: tuple[int, int] | None = None  # EP: the routed experts [e0, e1) this rank holds

    def as_event(self) -> dict:
        """The fields of a rank's "loaded" event for the launcher."""
        extra = {"experts": list(self.experts)} if self.experts is not None else {}
        return {
            **extra,
            "rank": self.rank,
            "param_bytes": self.param_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "seconds": self.seconds,
            "layers": list(self.layers),
            "method": self.method,
        }


def on_metal() -> bool:
    """Whether this process computes on a Mac's GPU, whose buffers MLX counts, not /proc."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def peak_rss_bytes() -> int:
    """Peak resident set size of this process; on Metal, MLX's peak memory (the shard, KV and
    activations Metal holds), which the RSS does not show.

    On Linux ru_maxrss starts at the forking parent's RSS (it survives exec), so a rank
    started by a large launcher would report the launcher's size; VmHWM is this process's own.
    """
    if on_metal():
        return int(mx.get_peak_memory())
    try:
        status = Path("/proc/self/status").read_text()
        line = next(ln for ln in status.splitlines() if ln.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, IndexError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def check_safetensors(path: Path) -> None:
    """Fail fast on a truncated or corrupt file instead of crashing mid-load."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in {size} bytes")
            header = json.loads(f.read(n))
        end = max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise ModelError(
            f"{path} is not a valid safetensors file ({e}); re-download or re-import it"
        ) from e
    if 8 + n + end > size:
        raise ModelError(
            f"{path} is truncated: its header needs {8 + n + end} bytes but the file has {size}; "
            "re-download or re-import the model"
        )


def read_config(model_dir: Path) -> dict:
    """config.json (with generation_config's eos), plus the fields mlx-lm reads under older
    names than current transformers writes (models/published.py)."""
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir} has no config.json; pass an MLX/HF model directory")
    try:
        config = load_config(model_dir)
    except json.JSONDecodeError as e:
        raise ModelError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from e
    if (fields := published.model_fields(config)) is not None:
        config |= published.normalised(config, fields, str(model_dir / "config.json"))
    return config


# Written last by cluster/weights/transfer.py into a shard fetched over the fabric: the shard holds
# only one rank's tensors, some of them pre-sliced rows or columns ("slices").
SHARD_MANIFEST = "thunderpool-shard.json"


def build_lazy(model_dir: Path) -> tuple[nn.Module, dict]:
    """The full model with lazily loaded (not yet read) weights."""
    config = read_config(model_dir)
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ModelError(f"{model_dir} has no model*.safetensors weight files")
    for f in files:
        check_safetensors(f)
    manifest = model_dir / SHARD_MANIFEST
    try:
        if manifest.is_file():
            slices = json.loads(manifest.read_text()).get("slices", {})
            classes = _without_mtp(_padding(slices, model_dir))
            return load_model(
                model_dir, lazy=True, strict=False, model_config=config, get_model_classes=classes
            )
        classes = _without_mtp()
        return load_model(
            model_dir, lazy=True, strict=True, model_config=config, get_model_classes=classes
        )
    except TypeError as e:  # a ModelArgs field config.json lacks under any name we know
        raise ModelError(f"cannot build the model in {model_dir} from its config.json: {e}") from e
    except ValueError as e:
        if "not supported" in str(e):
            raise ModelError(
                f"model_type '{config.get('model_type')}' in {model_dir / 'config.json'} is not "
                "supported by mlx-lm; use a supported architecture (llama, qwen2, qwen3, "
                "qwen3_moe, mistral, ...) or upgrade mlx-lm"
            ) from e
        raise ModelError(f"cannot build the model in {model_dir}: {e}") from e


def _sanitizing(get_classes, prepare):
    """mlx-lm's model classes (from `get_classes`), whose sanitize() first runs
    `prepare(config)` on the stored weights; `prepare(config)` None keeps the class as it is."""

    def classes(config: dict):
        model_cls, args_cls = get_classes(config)
        if (first := prepare(config)) is None:
            return model_cls, args_cls

        def sanitize(self, weights: dict) -> dict:
            weights = first(weights)
            base = getattr(model_cls, "sanitize", None)
            return base(self, weights) if base is not None else weights

        wrapped = type(model_cls.__name__, (model_cls,), {"sanitize": sanitize})
        wrapped.__module__ = model_cls.__module__  # families are named by their module
        return wrapped, args_cls

    return classes


def _without_mtp(get_classes=_get_classes):
    """mlx-lm's model classes, whose sanitize() also drops the multi-token-prediction layers
    stored after the model's own (model.layers.{n}, ...): deepseek_v3's drops only layer 61,
    whatever the layer count. The leader's MTP draft reads them itself (engine/mtp.py)."""

    def prepare(config: dict):
        n, extra = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
        if not (n and extra):
            return None
        drop = tuple(f"model.layers.{n + i}." for i in range(int(extra)))
        return lambda weights: {k: v for k, v in weights.items() if not k.startswith(drop)}

    return _sanitizing(get_classes, prepare)


def _padding(slices: dict, model_dir: Path):
    """mlx-lm's model classes, whose sanitize() first pads each pre-sliced stored tensor
    back to its full shape at its offset (lazily): the usual shard() then cuts out exactly
    the rows or columns that were fetched, whatever sanitize() renames or stacks (experts)."""
    return _sanitizing(_get_classes, lambda config: lambda w: _unslice(w, slices, model_dir))


def _unslice(weights: dict, slices: dict, model_dir: Path) -> dict:
    out = dict(weights)
    for name, s in slices.items():
        x, full = out.get(name), tuple(s["shape"])
        pads = [(0, 0)] * len(full)
        pads[s["axis"]] = (s["a"], full[s["axis"]] - s["b"])
        if (
            x is None
            or x.ndim != len(full)
            or any(d + lo + hi != f for d, (lo, hi), f in zip(x.shape, pads, full, strict=True))
        ):
            raise ModelError(f"shard {model_dir} holds a slice of {name} this model cannot take")
        out[name] = mx.pad(x, pads)
    return out


def unloaded_modules(model: nn.Module, model_dir: Path) -> dict[int, tuple[nn.Module, str]]:
    """Modules of a partial shard whose weights it lacks (id -> (module, name)): a rank must
    drop them all before evaluating, else it would compute with initial, not loaded, weights.
    Holding the module keeps its id from being reused by a new one."""
    if not (model_dir / SHARD_MANIFEST).is_file():
        return {}
    weights: dict = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))  # lazy: names only, nothing is read
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    modules = dict(model.named_modules())
    missing = {}
    for name, _ in tree_flatten(model.parameters()):
        if name not in weights and (owner := modules.get(name.rsplit(".", 1)[0])) is not None:
            missing[id(owner)] = (owner, name)
    return missing


def load_shard(
    model_dir: Path,
    group: mx.distributed.Group,
    layout: Layout,
    progress: Callable[[float], None] | None = None,
) -> tuple[Runner, dict, LoadStats]:
    """Build, cut or shard, and load this rank's part of the model."""
    start = time.perf_counter()
    model, config = build_lazy(model_dir)
    kv_quant.check(model, layout.kv_bits, layout.kv_group_size)
    unloaded = unloaded_modules(model, model_dir)
    n_layers = len(model.layers)
    bounds, stage, method, share = (0, n_layers), None, "single", None
    if layout.parallel == "hybrid":
        from thunderpool.parallel import hybrid

        stage = hybrid.load_stage(model, group, layout, StoredRows.of(model_dir).rows)
        bounds, method = stage.bounds[stage.rank], "hybrid"
    elif group.size() > 1 and layout.parallel == "pp" and native.hands_more(anatomy(model).decoder):
        native.check(model, group.size(), list(layout.layer_split or []) or None)
        stage = NativeStage(model, group)  # mlx-lm's own pipeline(): the family's hand-off
        bounds, method = (stage.start, stage.end), "pp-mlx-lm"
    elif group.size() > 1 and layout.parallel == "pp":
        split = split_layers(n_layers, group.size(), list(layout.layer_split or []) or None)
        stage = PipelineStage(model, group, split)
        bounds, method = split[group.rank()], "pp"
    elif group.size() > 1 and layout.parallel == "ep":
        weights = list(layout.tp_weights or []) or None
        counts = list(layout.expert_split or []) or None
        stored = StoredRows.of(model_dir)
        replicas = layout.expert_replicas
        share = experts.shard(model, group, weights, counts, read=stored.rows, replicas=replicas)
        method = "ep"
        vocab.split_vocab(model, group, weights, stored.rows)
    elif group.size() > 1:
        weights = list(layout.tp_weights or []) or None
        method = tensor.shard(model, group, weights)
        # The vocabulary rows are read from the files: the full table never enters memory.
        vocab.split_vocab(model, group, weights, StoredRows.of(model_dir).rows)
    for _, module in model.named_modules():
        if unloaded.get(id(module), (None,))[0] is module:
            raise ModelError(
                f"shard {model_dir} lacks {unloaded[id(module)][1]}, which rank {group.rank()} "
                "needs; it was fetched for another layout: remove it (`thunderpool cache rm`)"
            )
    try:
        for i, layer in enumerate(model.layers):
            mx.eval(layer.parameters() if layer is not None else [])
            if progress is not None:
                progress((i + 1) / (len(model.layers) + 1))
        mx.eval(model.parameters())
        mx.clear_cache()  # return the freed full-size source tensors to the system
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"cannot read the weights in {model_dir}: {e}") from e
    param_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    stats = LoadStats(
        rank=stage.topo.me if method == "hybrid" else group.rank(),  # hybrid: the global rank
        param_bytes=param_bytes,
        peak_rss_bytes=peak_rss_bytes(),
        seconds=time.perf_counter() - start,
        layers=bounds,
        method=method,
        experts=(share.e0, share.e1) if share is not None else None,
    )
    # EP reads each MoE layer's routes on the host, which a traced graph cannot; other
    # layouts (hybrid) stay eager until a test proves their compiled step equal.
    compiled = wanted(layout.compile) and layout.parallel in ("tp", "pp")
    runner = Runner(model, group, stage, compiled, layout.kv_bits, layout.kv_group_size)
    runner.every_position = layout.every_position
    return runner, config, stats


def preflight(model_dir: Path, world_size: int, layout: Layout) -> dict:
    """Check in seconds, before any rank starts, that this layout can be built for the model."""
    model, config = build_lazy(model_dir)
    kv_quant.check(model, layout.kv_bits, layout.kv_group_size)
    if layout.parallel == "hybrid":
        from thunderpool.parallel import hybrid

        hybrid.check(model, layout.groups or (), layout.tp_weights, layout.layer_split)
    elif world_size > 1 and layout.parallel == "pp":
        split = list(layout.layer_split or []) or None
        if native.hands_more(anatomy(model).decoder):
            native.check(model, world_size, split)
        else:
            pipeline.check(model, world_size, split)
    elif world_size > 1 and layout.parallel == "ep":
        counts = list(layout.expert_split or []) or None
        weights = list(layout.tp_weights or []) or None
        experts.check(model, world_size, weights, counts, layout.expert_replicas)
    elif world_size > 1:
        tensor.check(model, world_size, list(layout.tp_weights or []) or None)
    return config


def describe_layout(config: dict, layout: Layout, world: int) -> dict:
    """Which layers and heads each rank holds, for the dashboard and /v1/cluster."""
    n_layers = shape.n_layers(config)
    if world == 1:
        return {
            "parallel": "single",
            "ranks": [{"rank": 0, "layers": [0, n_layers], "heads": None}],
        }
    if layout.parallel == "hybrid":
        from thunderpool.parallel.hybrid import describe

        return describe(config, layout)
    if layout.parallel == "pp":
        bounds = split_layers(n_layers, world, list(layout.layer_split or []) or None)
        ranks = [{"rank": r, "layers": list(b), "heads": None} for r, b in enumerate(bounds)]
        return {"parallel": "pp", "ranks": ranks}
    heads, kv = shape.heads(config, 0), shape.kv_heads(config)
    weights = list(layout.tp_weights or [1.0] * world)
    if not heads:  # attention we do not read as heads (linear attention, fused): layers only
        ranks = [{"rank": r, "layers": [0, n_layers], "heads": None} for r in range(world)]
        return {"parallel": layout.parallel, "ranks": ranks}
    shares = tensor.split_heads(heads, kv, weights, config_head_unit(config))
    ranks = [
        {"rank": r, "layers": [0, n_layers], "heads": {"q": [s.q0, s.q1], "kv": [s.kv0, s.kv1]}}
        for r, s in enumerate(shares)
    ]
    if layout.parallel == "ep" and (n := _routed_experts(config)):
        weights = list(layout.tp_weights or [1.0] * world)
        counts = list(layout.expert_split or []) or None
        for r, share in zip(ranks, experts.split_experts(n, weights, counts), strict=True):
            r["experts"] = [share.e0, share.e1]
        return {"parallel": "ep", "ranks": ranks}
    return {"parallel": "tp", "ranks": ranks}


# config.json's routed-expert count, by family.
def _routed_experts(config: dict) -> int:
    return shape.experts(config)
