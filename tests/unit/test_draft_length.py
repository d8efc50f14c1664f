"""Per-row draft lengths from measured acceptance (engine/draft_length.py): k until a row's
first verify, k while its drafts hold, fewer as they fail (the place's odds of acceptance under
MIN_ODDS), never below 1, and back up as they hold again; rows are kept apart."""

from __future__ import annotations

from thunderpool.engine.draft_length import MIN_ODDS, DraftLengths


def test_lengths_follow_each_rows_acceptance():
    lengths = DraftLengths()
    assert lengths.length(1, 4) == 4  # nothing measured yet
    for _ in range(5):
        lengths.observe(1, 4, 4)  # every draft kept
        lengths.observe(2, 4, 0)  # every draft rejected
    assert lengths.length(1, 4) == 4 and lengths.length(2, 4) == 1
    for _ in range(10):
        lengths.observe(2, 1, 1)  # row 2's one draft now holds
    assert lengths.length(2, 4) == 4
    lengths.drop(2)
    assert lengths.length(2, 4) == 4 and lengths.length(1, 2) == 2


def test_a_half_accepted_row_drafts_while_the_odds_stay_above_the_floor():
    lengths = DraftLengths()
    for _ in range(20):
        lengths.observe(7, 2, 1)  # one of two kept, then a rejection: acceptance 0.5
    want = max(n for n in range(1, 5) if n == 1 or 0.5**n >= MIN_ODDS)
    assert lengths.length(7, 4) == want == 2
    lengths.observe(7, 0, 0)  # a row that drafted nothing teaches nothing
    assert lengths.length(7, 4) == 2
