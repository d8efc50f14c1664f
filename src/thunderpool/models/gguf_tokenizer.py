"""Build a Hugging Face `tokenizer.json` + `tokenizer_config.json` from GGUF tokenizer metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`, pre-tokenizer from llama.cpp's
`tokenizer.ggml.pre` names) and SentencePiece ones (`"llama"`: Llama 2, Mistral, Mixtral,
Phi-3, Gemma) are handled so that ids match llama.cpp's own tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from thunderpool.errors import ModelError
from thunderpool.models.gguf_pretok import SPLITS

# llama.cpp token types (llama_token_type); CONTROL tokens are special, USER_DEFINED are added.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Split patterns of the tokenizers these GGUF `pre` names were converted from.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

_PRE_GPT2 = ("default", "gpt2", "gpt-2")
_PRE_DIGITS = ("smollm", "starcoder", "refact")
_PRE_QWEN2 = ("qwen2",)
_PRE_LLAMA3 = ("llama3", "llama-bpe", "llama-v3")
SUPPORTED_PRE = _PRE_GPT2 + _PRE_DIGITS + _PRE_QWEN2 + _PRE_LLAMA3 + tuple(SPLITS)


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata (`tokenizer.*` keys)."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    scores: Sequence[float]
    add_space_prefix: bool
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> GGUFVocab:
        p = "tokenizer.ggml."
        tokens = meta.get(p + "tokens")
        if not tokens:
            raise ModelError("GGUF file has no tokenizer.ggml.tokens; it cannot be used as a model")
        return cls(
            model=str(meta.get(p + "model", "")),
            pre=str(meta.get(p + "pre", "default")),
            tokens=tokens,
            token_types=meta.get(p + "token_type") or [1] * len(tokens),
            merges=meta.get(p + "merges") or [],
            scores=meta.get(p + "scores") or [],
            add_space_prefix=bool(meta.get(p + "add_space_prefix", True)),
            bos_id=meta.get(p + "bos_token_id"),
            eos_id=meta.get(p + "eos_token_id"),
            unk_id=meta.get(p + "unknown_token_id"),
            pad_id=meta.get(p + "padding_token_id"),
            add_bos=bool(meta.get(p + "add_bos_token", False)),
            add_eos=bool(meta.get(p + "add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    def token(self, idx: int | None) -> str | None:
        return None if idx is None or not 0 <= idx < len(self.tokens) else self.tokens[idx]


def _pre_tokenizer(name: str) -> tuple[pre.PreTokenizer, normalizers.Normalizer | None, bool]:
    """(pre-tokenizer, normalizer, ignore_merges) for a llama.cpp `tokenizer.ggml.pre` name."""
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    if name in _PRE_GPT2:
        return pre.ByteLevel(add_prefix_space=False, use_regex=True), None, False
    if name in _PRE_DIGITS:
        # llama.cpp splits every digit on its own before the GPT-2 regex for these vocabularies.
        digits = pre.Digits(individual_digits=True)
        gpt2 = pre.ByteLevel(add_prefix_space=False, use_regex=True)
        return pre.Sequence([digits, gpt2]), None, False
    if name in _PRE_QWEN2:
        split = pre.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre.Sequence([split, byte_level]), normalizers.NFC(), False
    if name in _PRE_LLAMA3:
        split = pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre.Sequence([split, byte_level]), None, True
    if name in SPLITS:
        splits = [pre.Split(Regex(r), behavior="isolated") for r in SPLITS[name]]
        return pre.Sequence([*splits, byte_level]), None, False
    raise ModelError(
        f"GGUF tokenizer pre-tokenizer {name!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_PRE)}. Use the model's Hugging Face repo instead of the GGUF file"
    )


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF vocabulary."""
    if vocab.model == "llama":
        tok = _sentencepiece(vocab)
    elif vocab.model == "gpt2":
        tok = _byte_level_bpe(vocab)
    else:
        raise ModelError(
            f"GGUF tokenizer model {vocab.model!r} is not supported (only 'gpt2' byte-level BPE "
            "and 'llama' SentencePiece); pass the model's Hugging Face safetensors directory "
            "instead of the GGUF file"
        )
    added = [
        AddedToken(t, special=(kind == _CONTROL), normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    tok.post_processor = _post_processor(vocab)
    return tok


def _sentencepiece(vocab: GGUFVocab) -> Tokenizer:
    """llama.cpp's SPM tokenizer as BPE: it merges the adjacent pair whose union scores highest,
    so every split of a piece into two pieces is a merge ranked by the union's score; characters
    outside the vocabulary fall back to <0xXX> byte tokens."""
    if len(vocab.scores) != len(vocab.tokens):
        raise ModelError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
    normal = {}
    for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind == _NORMAL:
            normal.setdefault(t, i)
    ranked = []
    for t, i in normal.items():
        for cut in range(1, len(t)):
            if t[:cut] in normal and t[cut:] in normal:
                ranked.append((-vocab.scores[i], i, cut, t))
    ranked.sort()
    merges = [(t[:cut], t[cut:]) for _, _, cut, t in ranked]
    ids = {}
    for i, t in enumerate(vocab.tokens):
        ids.setdefault(t, i)
    unk = vocab.token(vocab.unk_id) or "<unk>"
    model = models.BPE(ids, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    # llama.cpp prefixes a space to the text and to the text after each special token; the
    # normalizer runs on each stretch between added tokens, so Prepend does the same.
    steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    pre_tok, normalizer, ignore_merges = _pre_tokenizer(vocab.pre)
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    tok = Tokenizer(models.BPE(ids, merges, fuse_unk=False, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tok
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    return tok


def _post_processor(vocab: GGUFVocab) -> processors.PostProcessor:
    """Adds BOS/EOS around a sequence when the GGUF asks for it (e.g. Llama 3 adds BOS)."""
    bos = vocab.token(vocab.bos_id) if vocab.add_bos else None
    eos = vocab.token(vocab.eos_id) if vocab.add_eos else None
    single = [x for x in (bos, "$A:0", eos) if x]
    pair = single + [x for x in (bos, "$B:1", eos) if x]
    specials = [(t, ids) for t, ids in ((bos, vocab.bos_id), (eos, vocab.eos_id)) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def write_tokenizer(vocab: GGUFVocab, out_dir: Path, max_length: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    special = {
        name: t
        for name, idx in (
            ("bos_token", vocab.bos_id),
            ("eos_token", vocab.eos_id),
            ("unk_token", vocab.unk_id),
            ("pad_token", vocab.pad_id),
        )
        if (t := vocab.token(idx)) is not None
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if max_length:
        config["model_max_length"] = max_length
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
