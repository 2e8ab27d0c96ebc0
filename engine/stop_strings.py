"""Detection of stop strings in streamed, incrementally decoded text."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds stop strings in streamed text, even when a stop string spans several tokens.

    The match reported is the first stop string to complete in the stream (if several complete at the
    same character, the longest), so the result does not depend on how the text was split into feeds.
    """

    def __init__(self, stop: Sequence[str]):
        if not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stop)
        # Every proper prefix of a stop string: a suffix of the text equal to one may still become a match.
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Append newly decoded text; return (text safe to emit now, stopped). Text that could be the
        start of a stop string is held back until it is decided. On a match, return everything before
        the stop string (the stop string itself is not emitted, as vLLM does by default) and True.
        After a match, further feeds return ("", True)."""
        if self._matched is not None:
            return "", True
        pending = self._held + text
        if not self._stops:
            self._held = ""
            return pending, False
        match = self._first_completed(pending)
        if match is not None:
            start, self._matched = match
            self._held = ""
            return pending[:start], True
        keep_from = len(pending) - self._held_suffix_length(pending)
        self._held = pending[keep_from:]
        return pending[:keep_from], False

    def hold(self, text: str) -> None:
        """Continue a stream whose text was emitted elsewhere up to `text`, which is still to come:
        it is held and decided with the next feed (a resumed request)."""
        self._held = text

    def flush(self) -> str:
        """At the end of generation (no stop hit), return any held-back text."""
        held, self._held = self._held, ""
        return held

    @property
    def matched(self) -> str | None:
        """The stop string that matched, if any."""
        return self._matched

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in `text`; ties go to the longest."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
