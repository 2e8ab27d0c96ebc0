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
        """Each request's drafts, from its own tokens alone."""
        return [self.propose(request.token_ids, request.num_tokens) for request in requests]

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids`; empty when no n-gram recurs."""
        length = len(token_ids)
        if num_tokens <= 0 or length < self.min_n + 1:
            return []
        # bytes.rfind searches in C; a token id is one aligned 4-byte item.
        data = array("I", token_ids).tobytes()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest_earlier(data, length, n)
            if start is not None:
                follow = start + n
                return list(token_ids[follow : follow + num_tokens])
        return []

    @staticmethod
    def _latest_earlier(data: bytes, length: int, n: int) -> int | None:
        """Token index of the latest occurrence of the last `n` tokens that ends before the last
        token (so at least one token follows it), or None."""
        pattern = data[(length - n) * _ITEM :]
        end = (length - 1) * _ITEM  # an occurrence must end by here
        while True:
            found = data.rfind(pattern, 0, end)
            if found < 0:
                return None
            if found % _ITEM == 0:
                return found // _ITEM
            end = found + len(pattern) - 1  # a match straddling items: look further back
