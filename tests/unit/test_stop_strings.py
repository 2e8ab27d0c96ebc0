"""Tests for StopStringMatcher: streamed stop-string detection with hold-back."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.stop_strings import StopStringMatcher


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("hello ") == ("hello ", False)
    assert matcher.feed("world") == ("world", False)
    assert matcher.flush() == ""
    assert matcher.matched is None


def test_stop_string_split_across_three_feeds():
    matcher = StopStringMatcher(["<end>"])
    assert matcher.feed("Hi <e") == ("Hi ", False)
    assert matcher.feed("n") == ("", False)
    assert matcher.feed("d> trailing") == ("", True)
    assert matcher.matched == "<end>"


def test_false_start_is_released():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("zab") == ("z", False)
    assert matcher.feed("x") == ("abx", False)
    assert matcher.matched is None


def test_held_prefix_restarts_inside_false_start():
    # "aab": the first "a" is a false start, but "ab" may still become "abc".
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("a") == ("", False)
    assert matcher.feed("ab") == ("a", False)
    assert matcher.feed("c!") == ("", True)


def test_earliest_match_wins_over_list_order():
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo"


def test_match_that_completes_first_wins_even_if_it_starts_later():
    # Streamed character by character, "bcd" is complete before "abcde" could be.
    matcher = StopStringMatcher(["abcde", "bcd"])
    assert matcher.feed("xabcdef") == ("xa", True)
    assert matcher.matched == "bcd"


def test_text_after_stop_is_never_returned():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("one STOP two") == ("one ", True)
    assert matcher.feed("three") == ("", True)
    assert matcher.flush() == ""


def test_flush_returns_held_text():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("answer ##") == ("answer ", False)
    assert matcher.flush() == "##"
    assert matcher.flush() == ""
    assert matcher.matched is None


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Emitted text and match when streaming one character at a time, checked by brute force."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stops if text[:end].endswith(s)]
        if ending_here:
            stop = max(ending_here, key=len)
            return text[: end - len(stop)], stop
    return text, None


@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_result_does_not_depend_on_how_text_is_split(text: str, stops: list[str], cuts: list[int]):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopStringMatcher(stops)
    emitted = ""
    stopped = False
    for lo, hi in pairwise(bounds):
        piece, stopped = matcher.feed(text[lo:hi])
        emitted += piece
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    assert (emitted, matcher.matched) == _reference(text, stops)
