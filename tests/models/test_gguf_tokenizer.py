"""SentencePiece GGUF vocabularies (Llama 2, Mistral, Phi-3, Gemma): the tokenizer we build from
the GGUF metadata against the `sentencepiece` library on the same model, which llama.cpp's SPM
tokenizer reproduces."""

from __future__ import annotations

import io

import pytest

from thunderpool.models.gguf_tokenizer import GGUFVocab, build_tokenizer

spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, general Kenobi.",
    "Numbers like 12345 and 2024 appear in text.",
    "  indented lines\tand tabs\nand newlines\n\nagain",
    "Paris is the capital of France; Berlin of Germany.",
] * 20
TEXTS = [
    "Hello world",
    " Hello world",
    "  leading spaces\tand tabs\n\nnewlines",
    "The quick brown fox jumps over the lazy dog",
    "Ünïcödé — 日本語 🙂 (bytes for all of these)",
    "a1b22c333 x 2024",
    "",
    " ",
    "\n",
]
# llama.cpp's token types, as its converter derives them from the SentencePiece model.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def train(add_dummy_prefix: bool):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        split_digits=False,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_metadata(sp, add_space_prefix: bool) -> dict:
    """What convert_hf_to_gguf.py's _set_vocab_sentencepiece writes for this model."""
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        return BYTE if sp.is_byte(i) else NORMAL

    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.mark.parametrize("prefix", [True, False], ids=["llama-style", "gemma-style"])
def test_sentencepiece_ids_match(prefix):
    sp = train(add_dummy_prefix=prefix)
    tok = build_tokenizer(GGUFVocab.from_metadata(gguf_metadata(sp, prefix)))
    for text in TEXTS:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == want, repr(text)
        assert tok.decode(want) == sp.decode(want), repr(text)
    assert any(sp.is_byte(i) for i in sp.encode(TEXTS[4]))  # byte fallback was exercised
    # add_bos_token: the BOS id leads, as llama.cpp adds it.
    assert tok.encode("Hello").ids[0] == sp.bos_id()


def test_written_files_load_in_transformers(tmp_path):
    """mlx-lm loads the written tokenizer files through transformers: same ids, BOS first."""
    transformers = pytest.importorskip("transformers")
    from thunderpool.models.gguf_tokenizer import write_tokenizer

    sp = train(add_dummy_prefix=True)
    write_tokenizer(GGUFVocab.from_metadata(gguf_metadata(sp, True)), tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS[:5]:
        assert tok(text).input_ids == [sp.bos_id(), *sp.encode(text)], repr(text)
        assert tok.decode(sp.encode(text)) == text
