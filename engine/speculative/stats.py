"""Counts of proposed and accepted draft tokens, as vLLM's spec_decode metrics report them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals over an engine's life. A draft is one request's proposal verified in one step;
    `accepted_per_position[i]` counts drafts whose token i was accepted (so it never increases
    with i, and its first entry over `num_drafts` is the first token's acceptance rate)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Account one verified draft of `num_draft_tokens` tokens, the first `num_accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        """A copy that later steps do not change."""
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))
