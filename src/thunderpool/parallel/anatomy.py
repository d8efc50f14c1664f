"""Where an mlx-lm model keeps its parts, found from the model itself, not from its family.

mlx-lm's models agree on little beyond `Model.layers`: the decoder that owns the layer list is
`model.model`, `model.language_model.model` (multimodal wrappers), `model.transformer`,
`model.backbone`; embeddings and final norms go by a dozen names; and `Model.__call__` may do
more after the decoder (logit scaling, soft-capping, a tied head). So the hidden states come
from the decoder found here, and the logits from the model's own `__call__` with that decoder
replaced by a stand-in returning the given hidden states: whatever the family does after its
decoder, the head does too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError

# Names of a decoder's final norm, in the order families use them.
NORMS = ("norm", "ln_f", "norm_f", "final_layernorm", "final_layer_norm", "output_norm")


class _Given(nn.Module):
    """Stands in for the decoder during one head call: returns `h`, lends the real decoder's
    attributes (a tied head reads its embedding)."""

    def __init__(self, h: mx.array, decoder: nn.Module):
        super().__init__()
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_decoder", decoder)

    def __getattr__(self, name: str):
        return getattr(object.__getattribute__(self, "_decoder"), name)

    def __call__(self, *args, **kwargs) -> mx.array:
        return object.__getattribute__(self, "_h")


def table(module: nn.Module) -> nn.Module | None:
    """The first embedding table in `module` (itself, or one it holds)."""
    for _, m in module.named_modules():
        if isinstance(m, nn.Embedding | nn.QuantizedEmbedding):
            return m
    return None


def width(embedding: nn.Module) -> tuple[int, int]:
    """(vocabulary, hidden) of an embedding or the table it holds."""
    t = table(embedding)
    dims = getattr(t, "dims", None)
    rows = getattr(t, "num_embeddings", None)
    shape = t.weight.shape
    return rows or shape[0], dims or shape[-1]


@dataclass(frozen=True)
class Anatomy:
    """A model's decoder (the module that runs the layers), where it hangs, and its parts."""

    parent: nn.Module  # the module holding the decoder as attribute `attr`
    attr: str
    layers_attr: str  # the decoder's attribute holding the layer list
    path: str  # e.g. "model", "language_model.model": for messages

    @property
    def decoder(self) -> nn.Module:
        return self.parent[self.attr]

    @property
    def standard(self) -> bool:
        """model.model with embed_tokens, layers and norm: the layout the fast paths know."""
        d = self.decoder
        return self.path == "model" and all(n in d for n in ("embed_tokens", "layers", "norm"))

    def embedding(self) -> tuple[str, nn.Module] | None:
        """The decoder's token embedding: its first child that is or holds an nn.Embedding
        (LongCat's n-gram embedding wraps its table; a per-layer input table, like Gemma
        3n's, comes after it)."""
        for name, child in self.decoder.items():
            if isinstance(child, nn.Module) and table(child) is not None:
                return name, child
        return None

    def norm(self) -> str | None:
        """The final norm: the module the decoder's forward returns the output of (lfm2 calls
        it embedding_norm), else the first of the usual names."""
        returned = _returned_module(self.decoder)
        if returned is not None and isinstance(self.decoder.get(returned), nn.Module):
            return returned
        return next((n for n in NORMS if isinstance(self.decoder.get(n), nn.Module)), None)

    def head_inside(self) -> str | None:
        """A projection onto the vocabulary inside the decoder itself (GPT-NeoX's embed_out):
        then the decoder's output is logits, not a hidden state."""
        vocab = width(self.embedding()[1])[0] if self.embedding() is not None else 0
        for name, child in self.decoder.items():
            if not isinstance(child, nn.Module) or table(child) is not None:
                continue
            w = child.get("weight")
            if isinstance(w, mx.array) and w.ndim == 2 and w.shape[0] == vocab:
                return name
        return None

    def head_gathers(self, model: nn.Module) -> bool:
        """Whether the head gathers its logits over a group (mlx-lm's shard() split the head
        of Qwen 3.5): then every rank of the group must project."""
        return any(getattr(m, "sharding_group", None) is not None for m in (model, self.parent))

    def hidden(self, tokens: mx.array, cache=None) -> mx.array:
        """The decoder's output (after its final norm) for `tokens`."""
        return self.decoder(tokens, cache=cache)

    def head(self, model: nn.Module, h: mx.array) -> mx.array:
        """Logits of hidden states `h` (B, L, D): the model's own __call__ after its decoder."""
        decoder = self.decoder
        self.parent[self.attr] = _Given(h, decoder)
        try:
            out = model(mx.zeros(h.shape[:2], mx.int32), cache=None)
        finally:
            self.parent[self.attr] = decoder
        return out[0] if isinstance(out, tuple) else out


def _returned_module(decoder: nn.Module) -> str | None:
    """X where the decoder's forward ends `return self.X(...)`, read from its source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(decoder).__call__)))
    except (OSError, TypeError, SyntaxError):
        return None
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    if len(returns) != 1 or not isinstance(call := returns[0].value, ast.Call):
        return None
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id == "self" else None
    return None


def anatomy(model: nn.Module) -> Anatomy:
    """Find the decoder of an mlx-lm model: the module whose list holds `model.layers`
    (going up while that module holds nothing else, e.g. PLaMo's layer block)."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ShardingError(
            f"{type(model).__module__} has no layer list (Model.layers); it cannot be cut "
            "or split: use --nodes 1"
        )
    modules = dict(model.named_modules())
    found = None
    for name, module in modules.items():
        for key, value in module.items():
            # Any place: mlx-lm's own pipeline() leaves None for another stage's layers.
            if isinstance(value, list) and any(v is layers[0] for v in value):
                found = (name, key)
                break
        if found:
            break
    if found is None:
        raise ShardingError(f"{type(model).__module__}: its layers are not in a module's list")
    path, layers_attr = found
    while path and not any(isinstance(c, nn.Module) for c in modules[path].values()):
        path, _, up = path.rpartition(".")
        layers_attr = f"{up}.{layers_attr}"
    if not path:
        raise ShardingError(f"{type(model).__module__}: no decoder module holds its layers")
    parent_path, _, attr = path.rpartition(".")
    parent = modules[parent_path] if parent_path else model
    return Anatomy(parent, attr, layers_attr, path)
