"""Drafting with a second model: its greedy continuation of each request, from its own paged KV cache.

The draft is a model runner with its own KV blocks and scheduler (its own formats, prefix caching
on), not an engine: it has no text, no role and no requests of its own between rounds. Each round
every decoding request joins it with all its tokens as the prompt and the drafts it may take as
max_tokens, greedily; the draft runs until all are done, and they finish, freeing their blocks,
whose full ones stay in its prefix cache: the next round recomputes only the last partly filled
block and the tokens verified since. So a decode worker computes the draft's prompt KV itself (the
first round of a request computes its whole prompt through the draft) and nothing more crosses
the wire than without speculation. Greedy drafts are point masses, which the accept rule
(engine.speculative.verify) needs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine_model import load_engine_model
from engine.kv_cache.blocks import blocks_for
from engine.kv_cache.manager import KVCacheManager
from engine.parallel.layout import TensorParallelLayout
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative.config import FLAG, SpeculativeConfig
from engine.speculative.proposer import DraftRequest
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The draft holds a request's blocks only during a round, so a quarter of the target's budget serves.
DRAFT_CACHE_SHARE = 4


def draft_engine_config(spec: SpeculativeConfig, target: EngineConfig) -> EngineConfig:
    """The draft's formats and cache: the target's file unless `spec.model` names another, in the
    formats `auto` chooses on this hardware (for a self-draft of a float target: its own 4-bit blocks)."""
    cache = target.cache
    if cache.num_blocks is None and cache.memory_bytes is not None:
        cache = replace(cache, memory_bytes=max(cache.memory_bytes // DRAFT_CACHE_SHARE, 1 << 20))
    return EngineConfig(model=spec.model or target.model, device=target.device,
                        attention_backend=target.attention_backend, max_model_len=target.max_model_len,
                        quantization=spec.quantization, cache=CacheConfig(
                            block_size=cache.block_size, num_blocks=cache.num_blocks,
                            memory_bytes=cache.memory_bytes, enable_prefix_caching=True),
                        scheduler=target.scheduler)


class DraftModel:
    """The draft's model runner, KV blocks and scheduler (see the module)."""

    def __init__(self, spec: SpeculativeConfig, target: EngineConfig) -> None:
        """Load the draft `spec` names for a target configured by `target`. ValueError naming the flag
        for layers the draft does not have."""
        self.spec = spec
        config = draft_engine_config(spec, target)
        device = torch.device(config.device)
        loaded = load_engine_model(config, None, TensorParallelLayout(1, 0), None, device)
        self.formats = loaded.formats
        self.vocab_size = loaded.config.vocab_size
        self.tokenizer = Tokenizer.from_path(loaded.source)
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.kv = KVCacheManager(loaded.cache.num_blocks, config.cache.block_size, enable_prefix_caching=True,
                                 window=loaded.window)
        # Drafts ignore EOS (the target decides where a request ends), so no token ends a draft early.
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(loaded.model, loaded.cache, Sampler(self.vocab_size, ()), device)
        if spec.draft_layers is not None:
            try:
                self.runner.keep_first_layers(spec.draft_layers)
            except ValueError as error:
                raise ValueError(f"{FLAG}: {error}") from None
        log.info("draft model ready: %s, formats: %s, %d KV blocks", loaded.config.name, self.formats.describe(),
                 self.kv.num_blocks)

    def check_vocabulary(self, target_tokenizer: Tokenizer, target_vocab_size: int) -> None:
        """ValueError naming the flag unless the draft has the target's vocabulary, token for token."""
        if self.vocab_size != target_vocab_size or not self.tokenizer.same_vocabulary(target_tokenizer):
            raise ValueError(f"{FLAG}: model: {self.spec.model or 'the target'}'s vocabulary "
                             f"({self.vocab_size} tokens) is not the target's "
                             f"({target_vocab_size}), so its drafts could not be verified")

    def greedy(self, prompts: dict[str, list[int]], num_tokens: dict[str, int]) -> dict[str, list[int]]:
        """Each prompt's greedy continuation of `num_tokens[id]` tokens, run as one batch; none for a
        prompt the draft cannot take (too long for its context or its cache)."""
        requests = []
        for request_id, prompt in prompts.items():
            params = SamplingParams(max_tokens=num_tokens[request_id], temperature=0.0, ignore_eos=True)
            if self._fits(len(prompt), params.max_tokens):
                requests.append(Request(request_id, list(prompt), params, self.max_model_len))
                self.scheduler.add(requests[-1])
        while self.scheduler.has_work():
            out = self.scheduler.schedule()
            sampled = self.runner.execute(out)
            self.scheduler.update(out, {rid: [token for token, _ in tokens] for rid, tokens in sampled.items()})
        return {request.request_id: list(request.output_token_ids) for request in requests}

    def _fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a prompt and its drafts fit the draft's context, and every known token plus the
        next one's slot its cache."""
        return (prompt_tokens + max_tokens <= self.max_model_len
                and blocks_for(prompt_tokens + 1, self.kv.block_size) <= self.kv.num_blocks)


class DraftModelProposer:
    """Greedy drafts from a draft model (see the module)."""

    cheap = False  # a run of the draft model

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Each request's drafts; none for one the draft cannot take (too long for its cache)."""
        wanted = [request for request in requests if request.num_tokens > 0]
        tokens = self.draft.greedy({r.request_id: list(r.token_ids) for r in wanted},
                                   {r.request_id: r.num_tokens for r in wanted})
        return [tokens.get(request.request_id, []) for request in requests]
