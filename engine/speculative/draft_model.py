"""Drafting with a second model: its greedy continuation of each request, from its own paged KV cache.

The draft is an Engine of its own (the colocated role, its own formats and KV blocks, prefix caching
on). Each round every decoding request joins it with all its tokens as the prompt and the drafts it
may take as max_tokens, greedily; the draft runs until all are done, and they finish, freeing their
blocks, whose full ones stay in its prefix cache: the next round recomputes only the last partly
filled block and the tokens verified since. So a decode worker computes the draft's prompt KV itself
(the first round of a request computes its whole prompt through the draft) and nothing more crosses
the wire than without speculation. Greedy drafts are point masses, which the accept rule
(engine.speculative.verify) needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams
from engine.speculative.config import FLAG, SpeculativeConfig
from engine.speculative.proposer import DraftRequest

if TYPE_CHECKING:
    from engine.engine import Engine

# The draft holds a request's blocks only during a round, so a quarter of the target's budget serves.
DRAFT_CACHE_SHARE = 4


def draft_engine_config(spec: SpeculativeConfig, target: EngineConfig) -> EngineConfig:
    """The draft's engine: the target's file unless `spec.model` names another, in the formats `auto`
    chooses on this hardware (for a self-draft of a float target: its own 4-bit blocks)."""
    cache = target.cache
    if cache.num_blocks is None and cache.memory_bytes is not None:
        cache = replace(cache, memory_bytes=max(cache.memory_bytes // DRAFT_CACHE_SHARE, 1 << 20))
    return EngineConfig(model=spec.model or target.model, device=target.device,
                        attention_backend=target.attention_backend, max_model_len=target.max_model_len,
                        quantization=spec.quantization, cache=CacheConfig(
                            block_size=cache.block_size, num_blocks=cache.num_blocks,
                            memory_bytes=cache.memory_bytes, enable_prefix_caching=True),
                        scheduler=target.scheduler)


def check_vocabulary(draft: Engine, target: Engine, spec: SpeculativeConfig) -> None:
    """ValueError naming the flag unless the draft has the target's vocabulary, token for token."""
    if draft.model_config.vocab_size != target.model_config.vocab_size or \
            not draft.tokenizer.same_vocabulary(target.tokenizer):
        raise ValueError(f"{FLAG}: model: {spec.model or 'the target'}'s vocabulary "
                         f"({draft.model_config.vocab_size} tokens) is not the target's "
                         f"({target.model_config.vocab_size}), so its drafts could not be verified")


class DraftModelProposer:
    """Greedy drafts from the `draft` engine (see the module)."""

    def __init__(self, draft: Engine) -> None:
        self.draft = draft

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts; none for one the draft cannot take (too long for its cache)."""
        tokens: dict[str, list[int]] = {}
        for request in requests:
            if request.num_tokens <= 0:
                continue
            params = SamplingParams(max_tokens=request.num_tokens, temperature=0.0, ignore_eos=True)
            try:
                self.draft.add_request(request.request_id, request.token_ids, params)
            except ValueError:
                continue
            tokens[request.request_id] = []
        while self.draft.has_unfinished():
            for output in self.draft.step():
                tokens[output.request_id].extend(output.new_token_ids)
        return [tokens.get(request.request_id, []) for request in requests]
