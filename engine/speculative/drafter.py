"""The engine's half of speculation: before each step, drafts on every request the step may verify."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.request import Request
from engine.speculative.config import FLAG, SpeculativeConfig
from engine.speculative.draft_model import DraftModelProposer, check_vocabulary, draft_engine_config
from engine.speculative.gate import may_draft
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftRequest, Proposer

if TYPE_CHECKING:
    from engine.engine import Engine


class Drafter:
    """Asks the proposer for drafts for the decoding requests of a step (see `draft`)."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer) -> None:
        self.spec = spec
        self.proposer = proposer

    @classmethod
    def build(cls, spec: SpeculativeConfig, target: Engine) -> Drafter:
        """The proposer `spec` names; a draft model is loaded as an engine of the target's class.
        ValueError naming the flag for a draft that cannot serve this target."""
        if spec.method == "ngram":
            return cls(spec, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
        draft = type(target)(draft_engine_config(spec, target.config))
        check_vocabulary(draft, target, spec)
        if spec.draft_layers is not None:
            try:
                draft.runner.keep_first_layers(spec.draft_layers)
            except ValueError as error:
                raise ValueError(f"{FLAG}: {error}") from None
        return cls(spec, DraftModelProposer(draft))

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
