"""Constrained decoding: a JSON schema becomes a per-row token mask on the leader's logits.

llguidance (Rust, maintained by guidance-ai) computes the mask: it needs no up-front
compilation of the schema into an automaton (outlines-core builds a whole regex index per
schema, seconds for nested ones; xgrammar compiles a grammar too), takes ~50 us to ~1 ms per
token, and hands back a bitmask we unpack with numpy and apply with `mx.where`, on CPU and
GPU alike. The tokenizer side (LLTokenizer, ~0.6 s to build) is made once per tokenizer.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("thunderpool.engine")

# Compact JSON: a flexible-whitespace grammar lets a small model loop on newlines for ever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'  # response_format json_object


class SchemaError(ValueError):
    """A JSON schema that llguidance cannot enforce; the message says why."""


@lru_cache(maxsize=256)
def grammar_of(schema: str) -> str:
    """The llguidance grammar for a JSON-schema text; raises SchemaError if unenforceable."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # the Rust side raises ValueError, or others on odd input
        raise SchemaError(f"the JSON schema cannot be enforced: {e}") from None
    if problem:
        raise SchemaError(f"the JSON schema cannot be enforced: {problem}")
    return grammar


def check_schema(schema: Any) -> str:
    """The canonical text of a schema (a dict) once llguidance accepts it: what SamplingParams
    carries. Raises SchemaError naming the problem."""
    if not isinstance(schema, dict):
        raise SchemaError(f"a JSON schema must be an object, got {type(schema).__name__}")
    text = json.dumps(schema, separators=(",", ":"))  # key order is the output's order
    grammar_of(text)
    return text


class Grammars:
    """One tokenizer's side of llguidance, built on first use and kept; hands out a fresh
    matcher per request (rows never share one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ll = None
        self._lock = threading.Lock()

    @property
    def ll(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
                eos = sorted(getattr(self.tokenizer, "eos_token_ids", None) or []) or None
                self._ll = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        return self._ll

    def matcher(self, schema: str) -> Matcher:
        return Matcher(self.ll, grammar_of(schema))


class Matcher:
    """One row's grammar state: feed it each sampled token, ask it for the next mask."""

    def __init__(self, ll, grammar: str):
        import llguidance

        self.m = llguidance.LLMatcher(ll, grammar, log_level=0)
        self.eos = list(ll.eos_tokens)
        self.words = np.zeros((ll.vocab_size + 31) // 32, dtype=np.int32)
        self.vocab = ll.vocab_size

    def consume(self, token: int) -> None:
        if self.m.is_stopped():
            return  # a burst may run a row a step past its EOS; that token is discarded
        if not self.m.consume_token(token):
            log.warning("constrained row: token %d rejected: %s", token, self.m.get_error())

    def allowed(self, vocab: int) -> np.ndarray:
        """Bool (vocab,): the tokens the grammar allows next (only EOS once it is complete,
        EOS alone if the matcher failed, so the row ends rather than the engine)."""
        ok = np.zeros(vocab, dtype=bool)
        if self.m.is_error():
            ok[self.eos] = True
            return ok
        self.m.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")[: self.vocab]
        n = min(vocab, self.vocab)
        ok[:n] = bits[:n].astype(bool)
        if not ok.any():
            ok[self.eos] = True
        return ok


def apply_mask(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """logits (1, V) with every disallowed token at -inf."""
    return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
