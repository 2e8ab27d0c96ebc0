"""Prompt-lookup drafting: continue the request the way it continued the same n-gram before.

Works on token ids alone (no torch, no model): input-grounded outputs (rewrites, extractions,
code edits) copy spans of their prompt, and once an output enters such a span the tokens that
followed it there are a good guess for the tokens that follow now.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from engine.speculative.proposer import DraftRequest

_ITEM = array("I").itemsize  # bytes per token id in the search buffer


class NgramProposer:
    """Drafts from the longest suffix n-gram (of `min_n` to `max_n` tokens) seen earlier in the
    request's own tokens, continuing after its most recent earlier occurrence."""

    cheap = True

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts: from the output its client predicted first (its edit of a text
        continues as the prediction does), else from its own tokens."""
        drafts = []
        for request in requests:
            predicted = self.propose(request.token_ids, request.num_tokens, request.predicted)
            drafts.append(predicted or self.propose(request.token_ids, request.num_tokens))
        return drafts

    def propose(self, token_ids: Sequence[int], num_tokens: int, source: Sequence[int] = ()) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids`, continuing the latest earlier
        occurrence of its longest suffix n-gram in `token_ids` (or in `source` where given); empty
        when none recurs."""
        length = len(token_ids)
        if num_tokens <= 0 or length < self.min_n + 1:
            return []
        # bytes.rfind searches in C; a token id is one aligned 4-byte item.
        data = array("I", token_ids).tobytes()
        searched = source or token_ids
        haystack = array("I", searched).tobytes() if source else data
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # An occurrence must end before the searched tokens' last, so that at least one follows it.
            start = self._latest(haystack, data[(length - n) * _ITEM :], (len(searched) - 1) * _ITEM)
            if start is not None:
                follow = start + n
                return list(searched[follow : follow + num_tokens])
        return []

    @staticmethod
    def _latest(data: bytes, pattern: bytes, end: int) -> int | None:
        """Token index of the latest occurrence of `pattern` in `data` that ends by byte `end`, or None."""
        while True:
            found = data.rfind(pattern, 0, end)
            if found < 0:
                return None
            if found % _ITEM == 0:
                return found // _ITEM
            end = found + len(pattern) - 1  # a match straddling items: look further back
