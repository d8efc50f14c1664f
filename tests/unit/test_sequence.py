"""Streaming text: stop strings cut the text exactly and never leak a partial stop string."""

from __future__ import annotations

from thunderpool.engine.sequence import TextStream


class CharDetokenizer:
    """One character per token id (chr), enough to drive TextStream."""

    def reset(self):
        self.text, self.tokens = "", []

    def add_token(self, token):
        self.tokens.append(token)
        self.text += chr(token)

    def finalize(self):
        pass


class CharTokenizer:
    def __init__(self):
        self.detokenizer = CharDetokenizer()


def stream(text: str, stop=()) -> tuple[list[str], bool]:
    ts = TextStream(CharTokenizer(), tuple(stop))
    out = []
    for ch in text:
        out.append(ts.add(ord(ch)))
        if ts.stopped:
            break
    out.append(ts.finish())
    return out, ts.stopped


def test_no_stop_streams_everything():
    out, stopped = stream("hello world")
    assert "".join(out) == "hello world" and not stopped
    assert out[:3] == ["h", "e", "l"]


def test_stop_string_cuts_before_it_and_holds_back_prefixes():
    out, stopped = stream("abc END def", stop=["END"])
    assert stopped and "".join(out) == "abc "
    # While "E" and "EN" could still start "END", they are held back.
    assert "E" not in "".join(out)


def test_false_prefix_is_released():
    out, stopped = stream("an ENigma", stop=["END"])
    assert not stopped and "".join(out) == "an ENigma"


def test_earliest_of_several_stop_strings_wins():
    out, stopped = stream("one. two\nthree", stop=["\n", "."])
    assert stopped and "".join(out) == "one"
