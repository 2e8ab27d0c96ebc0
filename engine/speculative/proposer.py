"""What the engine asks of a proposer: drafts for a batch of decoding requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class DraftRequest:
    """One decoding request to draft for: its tokens so far, how many drafts it may take, and the
    output its client predicted (OpenAI's `prediction`; a proposer may draft from it)."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int
    predicted: Sequence[int] = ()


class Proposer(Protocol):
    """Drafts tokens; the target verifies them (engine.speculative.verify), so a proposer is never
    wrong, only more or less often accepted. A `cheap` one proposes in microseconds, so the gate also
    asks it for requests that verify nothing, to learn their acceptance from the tokens that follow."""

    cheap: ClassVar[bool]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts (at most its num_tokens; none is fine), in order."""
        ...
