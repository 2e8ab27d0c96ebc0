"""One request's place in its grammar: which tokens may come next, and the tokens it took.

The state is rebuilt wherever the request samples: from the spec and the output tokens generated
so far (`GrammarState.resume`), on a prefill worker (nothing yet), a decode worker (the first token
the prefill worker sampled) or a worker a migrated request resumes on (the tokens already
streamed), so nothing but the spec crosses the wire. A speculative verification fills one mask per
drafted position by stepping through the drafts and rolling back; the drafts a grammar forbids are
cut before they are verified (`valid_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np


class GrammarError(ValueError):
    """A token the grammar does not allow was taken (never after a masked sample)."""


class GrammarState:
    """The matcher of one request (engine.structured.grammars.Grammars.matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32

    @classmethod
    def resume(cls, matcher: llguidance.LLMatcher, vocab_size: int, output_token_ids: Sequence[int]) -> GrammarState:
        """The state after `output_token_ids` (GrammarError if the grammar does not allow them)."""
        state = cls(matcher, vocab_size)
        state.accept(output_token_ids)
        return state

    @property
    def finished(self) -> bool:
        """True once the grammar allows nothing but the end of the sequence."""
        return self._matcher.is_stopped()

    def allowed(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """Bitmasks [len(drafts) + 1, words] of the tokens allowed at each position of a step that
        verifies `drafts` (bit t % 32 of word t // 32); the state is left as it was."""
        masks = np.zeros((len(drafts) + 1, self._words), dtype=np.int32)
        taken = 0
        for row in range(len(drafts) + 1):
            self._matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks[row].nbytes)
            if row < len(drafts):
                if not self._matcher.consume_token(drafts[row]):
                    break  # the rows after a forbidden draft are never kept
                taken += 1
        self._matcher.rollback(taken)
        return masks

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of `drafts`, from the first, the grammar allows in a row."""
        return self._matcher.validate_tokens(list(drafts))

    def accept(self, tokens: Sequence[int]) -> None:
        """Take the request's next tokens (sampled under the masks)."""
        for token in tokens:
            if not self._matcher.consume_token(token):
                raise GrammarError(f"token {token} is not allowed here: {self._matcher.get_error()}")
