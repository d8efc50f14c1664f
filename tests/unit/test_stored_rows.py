"""Row ranges read straight from safetensors files equal the lazily loaded tensor's rows,
for every stored dtype the vocabulary uses; a tensor changed on load is sliced instead."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.parallel.stored_rows import StoredRows


@pytest.fixture
def stored(tmp_path):
    mx.random.seed(0)
    embed = mx.random.normal((300, 64))
    q, scales, biases = mx.quantize(embed, group_size=32, bits=4)
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed.astype(mx.bfloat16),
        "half.weight": embed.astype(mx.float16),
        "language_model.model.norm.weight": mx.ones((64,), mx.float16),
        "q.weight": q,
        "q.scales": scales,
        "q.biases": biases,
    }
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), tensors)
    return StoredRows([path]), mx.load(str(path)), path


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "half.weight",
        "q.weight",
        "q.scales",
        "q.biases",
    ],
)
@pytest.mark.parametrize(("a", "b"), [(0, 101), (101, 201), (201, 300)])
def test_rows_read_from_the_file_equal_the_lazy_rows(stored, name, a, b):
    rows, lazy, _ = stored
    assert rows._find(name, lazy[name]) is not None  # read from the file, not sliced
    got = rows.rows(name, lazy[name], a, b)
    assert got.dtype == lazy[name].dtype and got.shape == (b - a, *lazy[name].shape[1:])
    assert mx.array_equal(got, lazy[name][a:b]).item()


def test_a_prefixed_stored_name_is_found(stored):
    rows, lazy, _ = stored
    norm = lazy["language_model.model.norm.weight"]
    assert rows._find("model.norm.weight", norm) is not None


def test_a_tensor_changed_on_load_is_sliced_not_read(stored):
    """A sanitize() that scales or casts a weight keeps its name and shape: reading the file
    would lose the change, so the lazy array is sliced instead."""
    rows, lazy, _ = stored
    w = lazy["model.embed_tokens.weight"]
    for changed in (w * 2.0, w.astype(mx.float16), w.astype(mx.float16).astype(mx.float32)):
        assert rows._find("model.embed_tokens.weight", changed) is None
        np.testing.assert_array_equal(
            np.array(rows.rows("model.embed_tokens.weight", changed, 5, 9)), np.array(changed[5:9])
        )
    # A different tensor of the same shape under another name is not taken for it.
    assert rows._find("model.embed_tokens.weight", lazy["lm_head.weight"]) is None


def test_a_file_cut_after_its_header_was_read_is_a_clear_error(stored, tmp_path):
    from thunderpool.errors import ModelError

    _, lazy, path = stored
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes())
    rows = StoredRows([cut])
    os.truncate(cut, rows._find("q.biases", lazy["q.biases"]).offset + 10)
    with pytest.raises(ModelError, match="ends inside q.biases"):
        rows.rows("q.biases", lazy["q.biases"], 0, 300)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_the_loader_reads_the_vocabulary_from_the_file(tiny_models, kind):
    """On mlx-lm's own lazy build (sanitize included) every vocabulary tensor is found in the
    file, so TP ranks read only their rows: the full table never enters memory."""
    from thunderpool.engine.loader import build_lazy

    model, _ = build_lazy(tiny_models[kind])
    rows = StoredRows.of(tiny_models[kind])
    tables = {"model.embed_tokens": model.model.embed_tokens}
    if "lm_head" in model:
        tables["lm_head"] = model.lm_head
    assert len(tables) == (1 if kind == "qwen3" else 2)  # qwen3's head is tied
    for name, module in tables.items():
        lazy = module["weight"]
        assert rows._find(f"{name}.weight", lazy) is not None, name
        assert mx.array_equal(rows.rows(f"{name}.weight", lazy, 100, 256), lazy[100:256]).item()
