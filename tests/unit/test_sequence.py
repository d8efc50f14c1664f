"""Streaming text: stop strings cut the text exactly and never leak a partial stop string."""

from __future__ import annotations

import pytest

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
    eos_token_ids = [ord("$")]

    def __init__(self):
        self.detokenizer = CharDetokenizer()


def stream(text: str, stop=(), min_tokens: int = 0) -> tuple[list[str], bool]:
    ts = TextStream(CharTokenizer(), tuple(stop), min_tokens)
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


@pytest.mark.parametrize(
    "min_tokens,want",
    [
        (0, "ab"),  # the first "X" stops it
        (3, "ab"),  # "X" is the 3rd token: looked for from the 3rd token on (vLLM)
        (4, "abXcd"),  # no stop string before the 4th token's text
        (6, "abXcd"),  # the second "X" is the 6th
        (7, "abXcdXef"),
    ],
)
def test_min_tokens_defers_stop_strings(min_tokens, want):
    out, _ = stream("abXcdXef", stop=["X"], min_tokens=min_tokens)
    assert "".join(out) == want


def test_an_end_token_under_ignore_eos_shows_no_text():
    out, stopped = stream("ab$cd")
    assert "".join(out) == "abcd" and not stopped


def test_earliest_of_several_stop_strings_wins():
    out, stopped = stream("one. two\nthree", stop=["\n", "."])
    assert stopped and "".join(out) == "one"


# --- timing and throughput at the text edge ---------------------------------------------------


class Clock:
    """A scripted clock: `now` moves only when the test says so."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_edge_reports_queue_ttft_gaps_and_elapsed_from_its_clock():
    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.engine.scheduler import Emitted
    from thunderpool.engine.sequence import Counters, TextEdge

    clock = Clock()
    counters = Counters(clock=clock)
    deltas = []
    edge = TextEdge(None, SamplingParams(max_tokens=3), deltas.append, lambda sid: None, counters)
    for at, ev in [
        (100.5, Emitted(0, 7, None, 12, 1, queued_s=0.125)),
        (100.75, Emitted(0, 8, None, 12, 2)),
        (101.0, Emitted(0, 9, "length", 12, 3)),
    ]:
        clock.now = at
        edge(ev)
    timing = [(d.queued_s, d.ttft_s, d.gap_s, d.elapsed_s) for d in deltas]
    assert timing == [(0.125, 0.5, None, None), (None, None, 0.25, None), (None, None, 0.25, 1.0)]
    assert (counters.requests_total, counters.prompt_tokens_total) == (1, 12)
    assert (counters.tokens_generated_total, counters.ttft_seconds) == (3, 0.5)
    counters.prompted(20, cached=15)  # what the prefix cache reports for a hit
    assert (counters.prefix_cache_hit_tokens_total, counters.prompt_tokens_total) == (15, 32)


def steps(counters, times, rows=1):
    for t in times:
        for _ in range(rows):
            counters.generated(t)


def test_decode_tps_is_true_at_a_slow_step_rate():
    from thunderpool.engine.sequence import Counters

    c = Counters()
    steps(c, [0.0, 7.0, 14.0, 21.0])  # one token every 7 s: under two steps per 5 s window
    assert c.decode_tps(now=21.0) == pytest.approx(1 / 7)
    assert c.decode_tps(now=25.0) == pytest.approx(1 / 7)  # within one usual gap
    # Silence beyond the usual gap counts: 1 token over 7 s + 7 s of extra silence.
    assert c.decode_tps(now=35.0) == pytest.approx(1 / 14)
    assert c.decode_tps(now=50.0) == 0.0  # silent for over 4 gaps: idle


def test_decode_tps_counts_batch_rows_and_stops_after_the_window():
    from thunderpool.engine.sequence import Counters

    c = Counters()
    steps(c, [i * 0.1 for i in range(51)], rows=4)  # 4 rows at 10 steps/s for 5 s
    assert c.decode_tps(now=5.05) == pytest.approx(40.0)
    assert c.decode_tps(now=5.0) == pytest.approx(40.0)
    assert c.decode_tps(now=16.0) == 0.0  # the window's length of silence
    assert Counters().decode_tps(now=1.0) == 0.0
