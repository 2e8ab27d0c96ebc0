"""The engine's half of speculation: before each step, drafts on every request the step may verify."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.speculative.config import SpeculativeConfig
from engine.speculative.gate import DraftGate, follow_shadow
from engine.speculative.proposer import DraftRequest, Proposer


class Drafter:
    """Asks the proposer for drafts for the decoding requests of a step (see `draft`)."""

    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, gate: DraftGate | None) -> None:
        """`gate` None: every request takes all the drafts it has room for (`gate: "off"`)."""
        self.spec = spec
        self.proposer = proposer
        self.gate = gate

    def observe(self, sequences: int, draft_rows: int, seconds: float) -> None:
        """A step of `sequences` decoding sequences verifying `draft_rows` drafts (and nothing else)
        ran in `seconds`."""
        if self.gate is not None:
            self.gate.observe(sequences, sequences + draft_rows, seconds)

    def draft(self, running: Sequence[Request]) -> None:
        """Set every decoding request's drafts for the coming step: none when `disable_by_batch_size`
        requests or more run, never past max_tokens or the context, less the step's own token, and
        as many as the gate finds pay; a cheap proposer's drafts for the others become their shadows
        (engine.speculative.gate)."""
        for request in running:
            request.draft_token_ids = []
        if not self.spec.speculates(len(running)):
            return
        decoding: list[tuple[Request, int]] = []
        for request in running:
            room = min(request.params.max_tokens - request.num_output_tokens,
                       request.max_model_len - request.num_tokens) - 1
            if request.num_computed_tokens == request.num_tokens - 1 and room > 0:
                decoding.append((request, min(self.spec.num_speculative_tokens, room)))
        if not decoding:
            return
        caps = [cap for _, cap in decoding]
        if self.gate is None:
            counts = caps
        else:
            for request, _ in decoding:
                follow_shadow(request)
            counts = self.gate.counts([request for request, _ in decoding], caps, len(running) - len(decoding))
        wanted = [(request, DraftRequest(request.request_id, request.token_ids, count, request.params.prediction))
                  for (request, _), count in zip(decoding, counts, strict=True) if count > 0]
        verified = len(wanted)
        if self.gate is not None and self.proposer.cheap:
            wanted += [(request, DraftRequest(request.request_id, request.token_ids, cap, request.params.prediction))
                       for (request, cap), count in zip(decoding, counts, strict=True)
                       if count == 0 and not request.shadow_token_ids]
        if wanted:
            drafts = self.proposer.propose_batch([draft for _, draft in wanted])
            for index, ((request, draft), tokens) in enumerate(zip(wanted, drafts, strict=True)):
                if index < verified:
                    kept = list(tokens[: draft.num_tokens])
                    if request.grammar is not None:  # drafts the grammar forbids are never verified
                        kept = kept[: request.grammar.valid_prefix(kept)]
                    request.draft_token_ids, request.shadow_token_ids = kept, []
                else:
                    request.shadow_token_ids, request.shadow_from = list(tokens[: draft.num_tokens]), request.num_tokens
