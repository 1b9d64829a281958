"""Tests for policies.stops.StopMatcher: stop strings over streamed text.

Streamed semantics (what the tests pin down): a stop is reported by the
`feed` call whose chunk completes the first stop occurrence (the occurrence
with the smallest *end*), and the text is cut at the earliest-*starting* stop
occurrence that is complete in the text received so far. So for overlapping
stops the cut can depend on the chunking (["abcd", "bc"] on "abcd": fed whole
it cuts at 0 on "abcd", fed char by char "bc" completes first and it cuts at
1), but in every case the emitted text is a prefix of the input, never
contains a stop string, and the stop that was reported follows it directly.
When the earliest-starting occurrence also ends first (no overlap) the cut is
exactly `min(text.find(stop))`, whatever the chunking.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.stops import StopMatcher


def run(stops: list[str], chunks: list[str]) -> tuple[str, str | None, int | None]:
    """Feed chunks until a stop is reported, then flush if none was.

    Returns (emitted text, stop, index of the chunk that reported the stop)."""
    matcher = StopMatcher(stops)
    emitted = []
    for i, chunk in enumerate(chunks):
        text, stop = matcher.feed(chunk)
        emitted.append(text)
        if stop is not None:
            assert matcher.flush() == ""
            return "".join(emitted), stop, i
    emitted.append(matcher.flush())
    return "".join(emitted), None, None


# -- examples --------------------------------------------------------------------


def test_stop_in_one_chunk():
    matcher = StopMatcher(["</stop>"])
    assert matcher.feed("Hello</stop> world") == ("Hello", "</stop>")
    assert matcher.flush() == ""


def test_stop_at_the_very_start():
    assert StopMatcher(["###"]).feed("###tail") == ("", "###")


def test_stop_split_across_chunks():
    matcher = StopMatcher(["</stop>"])
    assert matcher.feed("Hello</s") == ("Hello", None)
    assert matcher.feed("top> world") == ("", "</stop>")


def test_stop_split_over_many_chunks():
    matcher = StopMatcher(["STOP"])
    outputs = [matcher.feed(c) for c in ["ok S", "T", "O", "P!"]]
    assert outputs == [("ok ", None), ("", None), ("", None), ("", "STOP")]


def test_earlier_occurring_stop_wins_regardless_of_list_order():
    text = "a\n\nbEND"
    assert StopMatcher(["END", "\n\n"]).feed(text) == ("a", "\n\n")
    assert StopMatcher(["\n\n", "END"]).feed(text) == ("a", "\n\n")


def test_no_stops_passes_everything_through():
    matcher = StopMatcher([])
    assert matcher.feed("abc</s") == ("abc</s", None)
    assert matcher.feed("top>") == ("top>", None)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored():
    matcher = StopMatcher(["", ""])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_held_partial_prefix_released_by_non_matching_chunk():
    matcher = StopMatcher(["<end>"])
    assert matcher.feed("ab<e") == ("ab", None)
    assert matcher.feed("x") == ("<ex", None)
    assert matcher.flush() == ""


def test_flush_returns_held_text_once():
    matcher = StopMatcher(["<end>"])
    assert matcher.feed("ab<en") == ("ab", None)
    assert matcher.flush() == "<en"
    assert matcher.flush() == ""


def test_longest_possible_prefix_is_held():
    matcher = StopMatcher(["aab"])
    assert matcher.feed("aaa") == ("a", None)
    assert matcher.feed("b") == ("", "aab")


def test_partial_prefixes_of_different_stops():
    matcher = StopMatcher(["xyz", "yq"])
    assert matcher.feed("axy") == ("a", None)
    assert matcher.feed("q") == ("x", "yq")


def test_unicode_stop():
    matcher = StopMatcher(["\u00e9\U0001f600"])
    assert matcher.feed("caf\u00e9") == ("caf", None)
    assert matcher.feed("\U0001f600!") == ("", "\u00e9\U0001f600")


def test_overlapping_stops_whole_text_cuts_at_earliest_start():
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == ("", "abcd")


def test_overlapping_stops_streamed_reports_first_completed():
    # "bc" is complete before "abcd" is: the stream stops there.
    assert run(["abcd", "bc"], list("abcd")) == ("a", "bc", 2)


# -- properties ------------------------------------------------------------------

ALPHABET = "ab<>/\n \u00e9\U0001f600\u0301"


@st.composite
def cases(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=40))
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            end = draw(st.integers(start + 1, min(len(text), start + 6)))
            stops.append(text[start:end])
        else:
            stops.append(draw(st.text(alphabet=ALPHABET, min_size=1, max_size=5)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    return text, stops, chunks


def occurrences(text: str, stops: list[str]) -> list[tuple[int, int]]:
    """(start, end) of every occurrence of every stop in text, overlapping included."""
    return [(p, p + len(s)) for s in stops for p in range(len(text)) if text.startswith(s, p)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_streamed_output_is_a_stop_free_prefix(case):
    text, stops, chunks = case
    emitted, stop, _ = run(stops, chunks)
    assert text.startswith(emitted)
    assert not any(s in emitted for s in stops)
    found = occurrences(text, stops)
    if not found:
        assert stop is None
        assert emitted == text
    else:
        assert stop in stops
        assert text.startswith(stop, len(emitted))
        if min(found) == min(found, key=lambda o: (o[1], o[0])):
            # The earliest-starting occurrence also ends first: no overlap ambiguity.
            assert emitted == text[: min(text.find(s) for s in stops if s in text)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_stop_reported_by_the_chunk_that_completes_it(case):
    text, stops, chunks = case
    emitted, stop, index = run(stops, chunks)
    found = occurrences(text, stops)
    if not found:
        assert index is None
        return
    first_end = min(end for _, end in found)
    ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
    expected_index = next(i for i, end in enumerate(ends) if end >= first_end)
    seen = ends[expected_index]
    assert index == expected_index
    assert len(emitted) == min(start for start, end in found if end <= seen)
    assert len(emitted) + len(stop) <= seen


@settings(max_examples=200, deadline=None)
@given(cases())
def test_single_chunk_cuts_at_first_occurrence(case):
    text, stops, _ = case
    emitted, stop, _ = run(stops, [text])
    positions = [text.find(s) for s in stops if s in text]
    if positions:
        assert emitted == text[: min(positions)]
        assert text.startswith(stop, min(positions))
    else:
        assert (emitted, stop) == (text, None)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40), st.lists(st.integers(0, 40), max_size=10))
def test_no_stops_is_identity_for_any_chunking(text, cuts):
    bounds = [0, *sorted(c for c in set(cuts) if c <= len(text)), len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopMatcher([])
    assert [matcher.feed(c) for c in chunks] == [(c, None) for c in chunks]
    assert matcher.flush() == ""
