"""The engine's half of speculation: before each step, drafts on every request the step may verify."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.speculative.config import SpeculativeConfig
from engine.speculative.gate import may_draft
from engine.speculative.proposer import DraftRequest, Proposer


class Drafter:
    """Asks the proposer for drafts for the decoding requests of a step (see `draft`)."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer) -> None:
        self.spec = spec
        self.proposer = proposer

    def draft(self, running: Sequence[Request]) -> None:
        """Set every decoding request's drafts for the coming step: none when `disable_by_batch_size`
        requests or more run, and never past max_tokens or the context, less the step's own token."""
        wanted: list[tuple[Request, DraftRequest]] = []
        speculates = self.spec.speculates(len(running))
        for request in running:
            request.draft_token_ids = []
            if not speculates or request.num_computed_tokens != request.num_tokens - 1 or not may_draft(request):
                continue
            room = min(request.params.max_tokens - request.num_output_tokens,
                       request.max_model_len - request.num_tokens) - 1
            if room > 0:
                wanted.append((request, DraftRequest(request.request_id, request.token_ids,
                                                     min(self.spec.num_speculative_tokens, room))))
        if wanted:
            drafts = self.proposer.propose_batch([draft for _, draft in wanted])
            for (request, draft), tokens in zip(wanted, drafts, strict=True):
                request.draft_token_ids = list(tokens[: draft.num_tokens])
