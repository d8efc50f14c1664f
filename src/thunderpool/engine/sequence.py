"""Streaming text of one sequence: detokenize as tokens arrive; hold back and cut at stops."""

from __future__ import annotations


class TextStream:
    """Feeds tokens to a streaming detokenizer; `add` returns only text that is final."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0
        self.stopped = False

    def add(self, token: int) -> str:
        self.detok.add_token(token)
        return self._advance(self.detok.text, final=False)

    def finish(self) -> str:
        """Flush what was held back (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        self.detok.finalize()
        return self._advance(self.detok.text, final=True)

    def _advance(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = min((i for s in self.stop if (i := text.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif final:
            end = len(text)
        else:
            end = len(text) - self._held(text)
        out = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of text that could start a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
