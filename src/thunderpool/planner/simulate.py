"""`thunderpool simulate`: the planner on a described cluster instead of a live one.

A cluster comes from presets (presets.py); a model from a config.json, a model directory or a
bundled config (configs/*.json, for models too large to download), optionally with a
quantization suffix (`glm-5:mxfp8`, `qwen3-235b-a22b:q8`). `validate()` replays the published
results listed in presets.toml against the same model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.placement import Plan, place
from thunderpool.planner.presets import Cluster, parse_cluster, presets
from thunderpool.planner.spec import ModelSpec, model_spec, model_spec_from_config

QUANT = re.compile(
    r"^(?:q([2-8])(?:g(32|64|128))?|mxfp4|nvfp4|mxfp8|mixed_([2-4])_([46])|bf16|fp16|fp32)$"
)
# The microscaling formats' (bits, group): mlx_lm.convert --q-mode's defaults.
_MX = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def bundled() -> list[str]:
    """Names of the configs shipped for models too large to download."""
    folder = resources.files("thunderpool.planner").joinpath("configs")
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_model(text: str) -> ModelSpec:
    """A ModelSpec from `NAME[:QUANT]`: a config.json, a model dir or a bundled config name."""
    name, _, quant = text.partition(":")
    path = Path(name).expanduser()
    if path.is_dir():
        if any(path.glob("*.safetensors")) and not quant:
            return model_spec(path)
        path = path / "config.json"
    if path.is_file():
        config = _read_json(path)
    elif name in bundled():
        folder = resources.files("thunderpool.planner").joinpath("configs")
        config = json.loads(folder.joinpath(f"{name}.json").read_text())
    else:
        raise ThunderpoolError(
            f"no model {name!r}: not a config.json, a model directory or a bundled config; "
            f"use a path or one of {', '.join(bundled())} (optionally with :q4, :q8, :mxfp8...)"
        )
    config, dtype = quantized(config, quant)
    return model_spec_from_config(config, dtype_bytes=dtype)


def quantized(config: dict, quant: str) -> tuple[dict, float]:
    """The config as stored with `quant` (MLX quantization), and its float width in bytes."""
    dtype = _DTYPE_BYTES.get(config.get("torch_dtype", "bfloat16"), 2.0)
    if not quant:
        return config, dtype
    m = QUANT.match(quant.lower())
    if not m:
        raise ThunderpoolError(
            f"unknown quantization {quant!r}; use q2..q8 (affine, group 64), q4g32 (q2..q8 at "
            f"group 32, 64 or 128), mxfp4, nvfp4, mxfp8, {', '.join(_RECIPES)} (mlx-lm's "
            "mixed recipes), bf16, fp16 or fp32"
        )
    plain = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    plain.pop("expert_dtype", None)
    quant = quant.lower()
    if quant in ("bf16", "fp16", "fp32"):
        return plain, 4.0 if quant == "fp32" else 2.0
    if quant in _MX:
        q = {"bits": _MX[quant][0], "group_size": _MX[quant][1], "mode": quant}
    elif quant.startswith("mixed"):
        if quant not in _RECIPES:
            raise ThunderpoolError(f"unknown mixed recipe {quant!r}; use {', '.join(_RECIPES)}")
        low, high = int(m.group(3)), int(m.group(4))
        q = {"bits": low, "group_size": 64, "recipe": [low, high]}
    else:
        q = {"bits": int(m.group(1)), "group_size": int(m.group(2) or 64)}
    return {**plain, "quantization": q}, 2.0


def simulate(
    spec: ModelSpec,
    cluster: Cluster,
    context: int = 4096,
    concurrency: int = 1,
    prompt_tokens: int | None = None,
    compiled: bool = False,
) -> list[Plan]:
    """Every plan that fits the described cluster, fastest predicted decode first; decode
    steps eager, or (`compiled`) compiled where our engine compiles them (its default)."""
    nodes, links = cluster.specs()
    return place(
        spec,
        nodes,
        links,
        context_tokens=context,
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        compiled=compiled,
    )


@dataclass(frozen=True, slots=True)
class Check:
    """A published result against our prediction for the same layout."""

    what: str
    published_decode: float | None
    predicted_decode: float | None
    published_prefill: float | None
    predicted_prefill: float | None
    fitted: bool
    source: str

    @property
    def decode_error(self) -> float | None:
        if self.published_decode is None or self.predicted_decode is None:
            return None
        return self.predicted_decode / self.published_decode - 1

    @property
    def prefill_error(self) -> float | None:
        if self.published_prefill is None or self.predicted_prefill is None:
            return None
        return self.predicted_prefill / self.published_prefill - 1


def validate() -> list[Check]:
    """Predict every published result of presets.toml with the layout it was measured on,
    decoding eagerly as the tools that published them (mlx-lm, exo) do."""
    rows = []
    for p in presets()["published"]:
        cluster = parse_cluster(p["cluster"])
        spec = load_model(p["model"])
        prompt = p["prompt"]
        plans = simulate(spec, cluster, context=prompt + 256, prompt_tokens=prompt)
        kind = p.get("layout", "single" if len(cluster.nodes) == 1 else "tp")
        same = [x for x in plans if x.kind == kind and len(x.nodes) == len(cluster.nodes)]
        if not same:
            raise ThunderpoolError(f"{p['what']}: no {kind} plan over all nodes fits")
        pred = same[0].prediction
        rows.append(
            Check(
                what=p["what"],
                published_decode=p.get("decode"),
                predicted_decode=pred.decode_tps if "decode" in p else None,
                published_prefill=p.get("prefill"),
                predicted_prefill=pred.prefill_tps if "prefill" in p else None,
                fitted=p.get("fitted", False),
                source=p["source"],
            )
        )
    return rows


def distinct(plans: list[Plan], cluster: Cluster) -> list[Plan]:
    """Plans that differ other than by swapping nodes of the same preset (shown once)."""
    preset = {n.name: n.preset or n.name for n in cluster.nodes}
    seen, out = set(), []
    for p in plans:
        key = (p.kind, p.layer_split, tuple(tuple(preset[n] for n in s.nodes) for s in p.stages))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ThunderpoolError(f"{path} is not valid JSON ({e}); pass an HF config.json") from None
