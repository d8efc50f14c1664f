"""GGUF import: config, tokenizer, weights and logits against transformers' own GGUF loader."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.errors import ModelError
from thunderpool.models.gguf import import_gguf, q4_1_to_mlx, unpermute_rope
from thunderpool.models.source import default_gguf_path

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world",
    "<|im_start|>user\nWhat is 12345+678?<|im_end|>\n",
    "  leading spaces\tand tabs\n\nnewlines",
    "Ünïcödé — 日本語 🙂",
    "a1b22c333 x 2024",
    "<repo_name>foo<file_sep>bar<|endoftext|>",
]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (its n_head after the kv swap)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    try:
        return default_gguf_path()
    except ModelError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smol_dir(smol_gguf, tmp_path_factory) -> Path:
    return import_gguf(smol_gguf, tmp_path_factory.mktemp("import") / "smol", progress=False)


@pytest.fixture(scope="session")
def hf_model(smollm2_transformers):
    return smollm2_transformers[0]


def test_config_matches_smollm2(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    weights = mx.load(str(smol_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.embed_tokens.weight"].dtype == mx.float32
    assert len([k for k in weights if k.startswith("model.layers.29.")]) == 9


@pytest.mark.reference
def test_tokenizer_matches_transformers_gguf(smol_dir, smollm2_transformers):
    transformers = pytest.importorskip("transformers")
    ref = smollm2_transformers[1]
    ours = transformers.AutoTokenizer.from_pretrained(smol_dir)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    assert ours("<|im_start|>").input_ids == [1]
    ours_chat = ours.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ref_chat = ref.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert ours_chat == ref_chat
    assert ours_chat.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    specials = (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token)
    assert specials == (ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")


def test_mlx_lm_loads_tokenizer_without_torch(smol_dir):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from mlx_lm import load\n"
        f"model, tok = load({str(smol_dir)!r})\n"
        "print(tok.encode('Hello world'), sorted(tok.eos_token_ids))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[19556, 905] [2]"


@pytest.mark.reference
def test_weights_equal_transformers(smol_dir, hf_model):
    ours = mx.load(str(smol_dir / "model.safetensors"))
    ref = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for layer in (0, 17, 29):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            np.testing.assert_array_equal(np.array(ours[name]), ref[name])
    worst = max(float(np.abs(np.array(ours[k]) - ref[k]).max()) for k in ours)
    assert worst <= 1e-6


@pytest.mark.reference
def test_logits_match_transformers(smol_dir, hf_model):
    import torch
    from mlx_lm import load

    model, tok = load(str(smol_dir))
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    ours = np.array(model(mx.array([ids]))[0])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    # Measured: max abs diff 1.2e-4 over logits of magnitude ~38 (float32 summation order).
    scale = float(np.abs(ref).max())
    assert float(np.abs(ours - ref).max()) < 1e-4 * scale
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_q4_is_lossless(smol_dir, smol_gguf, tmp_path):
    import gguf
    from gguf.quants import dequantize
    from mlx_lm import load

    reader = gguf.GGUFReader(smol_gguf)
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    w, scales, biases = q4_1_to_mlx(np.asarray(t.data))
    got = mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(got), dequantize(np.asarray(t.data), t.tensor_type))

    q4_dir = import_gguf(smol_gguf, tmp_path / "q4", dtype="q4", progress=False)
    # The file's one Q8_0 tensor (the tied embedding) stays 8-bit, exactly, and says so.
    assert json.loads((q4_dir / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    q4, tok = load(str(q4_dir))
    f32, _ = load(str(smol_dir))
    assert type(q4.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    ids = mx.array([tok.encode("The quick brown fox jumps over the lazy dog because")])
    a, b = np.array(f32(ids)), np.array(q4(ids))
    # Measured: identical on this CPU; the weights dequantize bit-exactly.
    assert float(np.abs(a - b).max()) < 1e-4


@pytest.mark.parametrize("n_rows,n_head", [(576, 9), (192, 3), (8, 1)])
def test_unpermute_inverts_llama_cpp_permute(n_rows, n_head):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_rows, 5)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)  # the test would pass vacuously otherwise
    np.testing.assert_array_equal(unpermute_rope(permuted, n_head), w)
    bias = rng.standard_normal(n_rows).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope(llama_cpp_permute(bias, n_head), n_head), bias)


# --- synthetic GGUF files -------------------------------------------------------------------

D, FF, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2


def _byte_vocab() -> tuple[list[str], list[int], list[str]]:
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens += ["he", "ll", "hell", "Ġw", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, [1] * (len(tokens) - 3) + [3, 3, 3], merges


def write_tiny_gguf(path: Path, arch: str, qtype=None) -> dict[str, np.ndarray]:
    """A tiny random model in GGUF form; returns its HF-layout weights (before any permutation)."""
    import gguf

    rng = np.random.default_rng(1)
    tokens, types, merges = _byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    hd = D // HEADS
    hf: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], permute_heads: int = 0):
        value = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        hf[hf_name] = value
        stored = llama_cpp_permute(value, permute_heads) if permute_heads else value
        if qtype is not None and len(shape) == 2:
            from gguf.quants import quantize

            w.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, stored)

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), D))
    add("output_norm.weight", "model.norm.weight", (D,))
    add("output.weight", "lm_head.weight", (len(tokens), D))
    rope = arch == "llama"
    for i in range(LAYERS):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", (D,))
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (D,))
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (D, D), HEADS * rope)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (KV_HEADS * hd, D), KV_HEADS * rope)
        add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (KV_HEADS * hd, D))
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (D, D))
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (FF, D))
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (FF, D))
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (D, FF))
        if arch == "qwen2":
            add(b + "attn_q.bias", h + "self_attn.q_proj.bias", (D,))
            add(b + "attn_k.bias", h + "self_attn.k_proj.bias", (KV_HEADS * hd,))
            add(b + "attn_v.bias", h + "self_attn.v_proj.bias", (KV_HEADS * hd,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_weights_round_trip(arch, tmp_path):
    src = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(src, arch)
    out = import_gguf(src, tmp_path / "out", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["tie_word_embeddings"]) == (arch, False)
    assert cfg["attention_bias"] == (arch == "qwen2")
    got = mx.load(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(np.array(got[name]), value, err_msg=name)


def test_synthetic_qwen2_logits_match_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mlx_lm import load

    src = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(src, "qwen2")
    model, tok = load(str(import_gguf(src, tmp_path / "out", progress=False)))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=src.name, dtype=torch.float32
    ).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    text = "hello world, hell's 123 bells<|im_end|>"
    ids = tok.encode(text)
    assert ids == ref_tok(text).input_ids
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_dtypes(dtype, tmp_path):
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "llama")
    out = import_gguf(src, tmp_path / "out", dtype=dtype, progress=False)
    got = mx.load(str(out / "model.safetensors"))
    q = got["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == getattr(mx, dtype)
    ref = mx.array(expected["model.layers.1.self_attn.q_proj.weight"]).astype(q.dtype)
    np.testing.assert_array_equal(np.array(q.astype(mx.float32)), np.array(ref.astype(mx.float32)))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype


# --- errors ---------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match="nope.gguf does not exist"):
        import_gguf(missing, tmp_path / "out", progress=False)


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelError, match=r"model\.gguf is not a GGUF file"):
        import_gguf(bogus, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=r"'falcon'.*supported: llama, qwen2, qwen3"):
        import_gguf(path, tmp_path / "out", progress=False)


def test_unsupported_quantization(tmp_path, monkeypatch):
    import gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtype=gguf.GGMLQuantizationType.Q4_0)
    import gguf.quants

    real = gguf.quants.dequantize

    def no_q4_0(data, qtype):
        if qtype == gguf.GGMLQuantizationType.Q4_0:
            raise NotImplementedError("Q4_0")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", no_q4_0)
    with pytest.raises(ModelError, match=r"token_embd\.weight.*Q4_0"):
        import_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_dtype_and_nonempty_out_dir(tmp_path):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama")
    with pytest.raises(ModelError, match="'int8'"):
        import_gguf(src, tmp_path / "out", dtype="int8", progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(ModelError, match="busy already exists"):
        import_gguf(src, tmp_path / "busy", progress=False)


def test_interrupted_import_leaves_nothing(tmp_path, monkeypatch):
    import thunderpool.models.gguf as mod

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mod, "_write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
