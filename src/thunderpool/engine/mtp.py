"""Multi-token prediction (MTP) drafts: the model's own next-next-token layer, on the leader.

DeepSeek V3 (and GLM-4.5, the same layout) store `num_nextn_predict_layers` MTP layers after
the model's own, as model.layers.{n}.*: enorm, hnorm, eh_proj, one full decoder layer,
shared_head.norm, shared_head.head and embed_tokens (copies of the model's). At position i the
layer reads the target's final hidden state h_i and the next token t_{i+1}, and predicts t_{i+2}:

    h'_i = layer(eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]))    logits_i = head(norm(h'_i))

The concatenation is embedding first, as the checkpoints are trained (DeepSeek's report writes
the pair the other way round; vLLM, SGLang and Megatron concatenate embedding first). h_i is the
target's hidden state AFTER its final norm, the tensor its own head reads: DeepSeek's modeling
code hands exactly that to the MTP layer, as vLLM and SGLang do.

Chained drafts (k > 1) reuse the first MTP layer on its own output: draft j+1 reads
(norm(h'), d_j) at the next position, the normed hidden the head scored (vLLM and SGLang recycle
the same). Those chained entries leave the layer's KV cache after each verify; the accepted
positions are then fed again with the target's own hidden states (Runner.keep_hidden).
Positions whose target hidden state the leader never saw (a prefix-cache hit's head) feed a
zero hidden state: the drafts get worse, the output stays exact (the target verifies every
draft). Under PP the last stage hands the leader every prefill position (Layout.every_position).
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import MODEL_REMAPPING, _get_classes

from thunderpool.engine.drafter import DEFAULT_K, draw, trim
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError
from thunderpool.models import shape

# Families whose MTP layer is a decoder layer of the model's own class, by its class name.
LAYER_CLASSES = {"deepseek_v3": "DeepseekV3DecoderLayer", "glm4_moe": "DecoderLayer"}
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # the rest: the block
CHUNK = 512  # catch-up positions per forward
CONSOLIDATE = 64  # pending hidden chunks per sequence before they are joined into one array


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, vocab, bias=False)


class MTPLayer(nn.Module):
    """One MTP layer: (tokens t_{i+1} (B, L), hidden h_i (B, L, D)) -> h'_i (B, L, D)."""

    def __init__(self, block: nn.Module, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden, vocab, eps)

    def __call__(self, tokens: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        e = self.enorm(self.embed_tokens(tokens))
        x = self.eh_proj(mx.concatenate([e, self.hnorm(hidden.astype(e.dtype))], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return self.block(x, mask, cache)

    def normed(self, h: mx.array) -> mx.array:
        return self.shared_head.norm(h)


class MTPDrafter:
    """The Drafter interface of speculate.py (extend, drop, propose, settle) over an MTP layer,
    fed the target's hidden states by the executor (`observe`, since Runner.keep_hidden)."""

    wants_hidden = True  # Executor sets Runner.keep_hidden and calls observe()

    def __init__(self, layer: MTPLayer, k: int = DEFAULT_K, vocab: int | None = None):
        if k < 1:
            raise ThunderpoolError(f"--spec-k {k} must be at least 1")
        self.layer, self.k, self.vocab = layer, k, vocab
        self.hidden_size = layer.eh_proj.weight.shape[0]
        self.seqs: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}  # positions i whose pair (h_i, t_{i+1}) is in the cache
        self.pending: dict[int, list[mx.array]] = {}  # target hidden states from position fed
        self.known: dict[int, int] = {}  # positions whose hidden state was observed
        self.chained: dict[int, int] = {}  # drafted entries after `fed` in the cache
        self.caches: dict[int, list[KVCache]] = {}
        self.rngs: dict[int, np.random.Generator] = {}

    def extend(self, sid: int, tokens: list[int]) -> None:
        self.seqs.setdefault(sid, []).extend(tokens)

    def drop(self, sid: int) -> None:
        for d in (self.seqs, self.fed, self.pending, self.known, self.chained, self.caches):
            d.pop(sid, None)
        self.rngs.pop(sid, None)

    def observe(self, sid: int, hidden: mx.array, tail: bool = False) -> None:
        """The target's final hidden states (L, D) of the sequence's next L positions, or with
        `tail` of its last L tokens (a prefill chunk); positions skipped get zeros."""
        known, L = self.known.get(sid, 0), hidden.shape[0]
        chunks = self.pending.setdefault(sid, [])
        start = len(self.seqs.get(sid, ())) - L if tail else known
        if start > known:  # a prefix-cache hit's head: never seen
            chunks.append(mx.zeros((start - known, hidden.shape[-1]), hidden.dtype))
        elif start < known:  # already observed (not expected)
            hidden = hidden[known - start :]
        chunks.append(hidden)
        if len(chunks) > CONSOLIDATE:
            self.pending[sid] = [mx.concatenate(chunks)]
        self.known[sid] = max(known, start + L)

    def _take(self, sid: int, n: int) -> mx.array:
        """The next n pending hidden states (n, D), zeros where none was observed."""
        chunks = self.pending.get(sid, [])
        have = mx.concatenate(chunks) if chunks else mx.zeros((0, self.hidden_size))
        if have.shape[0] < n:
            have = mx.concatenate([have, mx.zeros((n - have.shape[0], self.hidden_size))])
            self.known[sid] = self.fed.get(sid, 0) + n
        self.pending[sid] = [have[n:]] if have.shape[0] > n else []
        return have[:n]

    def _logits(self, h: mx.array) -> mx.array:
        out = self.layer.shared_head.head(self.layer.normed(h))[0, -1]
        return out[: self.vocab] if self.vocab is not None else out

    def propose(self, sid: int, n: int, params: SamplingParams) -> tuple[list[int], np.ndarray]:
        """n draft tokens after the sequence's last token, and their distributions (n, V)
        (empty when greedy). The cache then holds the sequence's pairs plus n-1 chained ones."""
        seq, cache = self.seqs[sid], self.caches.setdefault(sid, [KVCache()])
        fed, need = self.fed.get(sid, 0), len(seq) - 1  # pairs (h_i, t_{i+1}), i < need
        assert fed < need, "the sequence's last token is always new to the draft"
        hidden, tokens = self._take(sid, need - fed), seq[fed + 1 : need + 1]
        for start in range(0, need - fed, CHUNK):  # catch up a long prompt in chunks
            h = self.layer(
                mx.array([tokens[start : start + CHUNK]]),
                hidden[None, start : start + CHUNK],
                cache[0],
            )
            if start + CHUNK < need - fed:
                mx.eval(h)
        self.fed[sid], h = need, h[:, -1:]
        drafts, qs = [], []
        for i in range(n):
            d, q = draw(self._logits(h), params, self.rngs, sid)
            qs += [] if q is None else [q]
            drafts.append(d)
            if i < n - 1:  # chain: the head's normed hidden and this draft, one position on
                h = self.layer(mx.array([[d]]), self.layer.normed(h), cache[0])
        self.chained[sid] = n - 1
        return drafts, np.stack(qs) if qs else np.zeros((0, 0))

    def settle(self, sid: int, n: int, accepted: int) -> None:
        """Drop the chained entries: the accepted positions come back as the target's own
        hidden states (observe) and are fed at the next propose."""
        trim(self.caches[sid], self.chained.pop(sid, 0))


def load_mtp_drafter(model_dir: Path, k: int = DEFAULT_K) -> MTPDrafter:
    """The model's first MTP layer, whole on this rank, read from the model's own files."""
    from thunderpool.engine.loader import read_config

    config = read_config(model_dir)
    layer = load_mtp_layer(model_dir, config)
    return MTPDrafter(layer, k, shape.vocab(config))


def check_mtp(config: dict, model_dir: Path) -> str:
    """The family whose MTP layer `config` describes, or a ThunderpoolError naming the fix."""
    kind = str(config.get("model_type"))
    family = MODEL_REMAPPING.get(kind, kind)
    if family not in LAYER_CLASSES:
        raise ThunderpoolError(
            f"--draft-model mtp drafts with the model's own multi-token-prediction layer, which "
            f"thunderpool reads for {', '.join(sorted(LAYER_CLASSES))}; {model_dir} is {kind}: "
            "use --draft-model DIR (a small model of the same tokenizer) instead"
        )
    if int(config.get("num_nextn_predict_layers") or 0) < 1:
        raise ThunderpoolError(
            f"{model_dir} has no multi-token-prediction layer (config.json: "
            f"num_nextn_predict_layers={config.get('num_nextn_predict_layers')}); use "
            "--draft-model DIR (a small model of the same tokenizer) instead"
        )
    return family


def check_mtp_files(model_dir: Path, config: dict) -> None:
    """Before any rank starts: the family has an MTP layer and the files hold it (headers only)."""
    check_mtp(config, model_dir)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    for f in sorted(model_dir.glob("model*.safetensors")):
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if any(name.startswith(prefix) for name in json.loads(fh.read(size))):
                return
    raise _no_weights(model_dir, config, prefix)


def _no_weights(model_dir: Path, config: dict, prefix: str) -> ThunderpoolError:
    return ThunderpoolError(
        f"{model_dir} declares num_nextn_predict_layers={config['num_nextn_predict_layers']} "
        f"but its weights hold no {prefix}* tensors (mlx-lm conversions drop the MTP "
        "layer); point --model at the original checkpoint, or use --draft-model DIR"
    )


def load_mtp_layer(model_dir: Path, config: dict) -> MTPLayer:
    family = check_mtp(config, model_dir)
    n = shape.n_layers(config)
    prefix, shared = f"model.layers.{n}.", {}
    weights: dict[str, mx.array] = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        for name, w in mx.load(str(f)).items():  # lazy: only what is kept is read
            if name.startswith(prefix):
                weights["model.layers.0." + name[len(prefix) :]] = w
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                shared[name] = w
    if not weights:
        raise _no_weights(model_dir, config, prefix)
    model_cls, args_cls = _get_classes(config)
    args = args_cls.from_dict(config)
    # The family's sanitize (fp8 dequantising, expert stacking, MLA's kv_b_proj split), run on
    # the MTP layer renamed as layer 0; it reads nothing but self.args.
    weights = model_cls.sanitize(SimpleNamespace(args=args), weights)
    weights = {_local(name.removeprefix("model.layers.0.")): w for name, w in weights.items()}
    weights.setdefault("embed_tokens.weight", shared.get("model.embed_tokens.weight"))
    head = shared.get("lm_head.weight", weights["embed_tokens.weight"])  # tied: the embedding
    weights.setdefault("shared_head.head.weight", head)
    block_cls = getattr(importlib.import_module(model_cls.__module__), LAYER_CLASSES[family])
    layer = MTPLayer(block_cls(args, n), args.hidden_size, args.vocab_size, args.rms_norm_eps)
    if (q := config.get("quantization")) is not None:
        nn.quantize(
            layer,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", "affine"),
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights,
        )
    try:
        layer.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ThunderpoolError(f"cannot load the MTP layer {prefix}* of {model_dir}: {e}") from e
    mx.eval(layer.parameters())
    return layer


def _local(name: str) -> str:
    return name if name.startswith(OWN) else "block." + name
