"""Importance-based KV eviction under a per-request budget (H2O, SnapKV), a whole block at a time:
which blocks a request gives up, and from which queries their scores come. One rule for the KV
cache manager (what to free), the runner (which queries score) and tests. No torch.

A request holds at most `blocks` blocks once its prompt is computed: the blocks of its last
`recent_tokens` positions (and the one its next token goes to) always, and of the rest those whose
keys received the most attention mass, summed over heads and layers and accumulated over every
query since they were written (H2O's heavy hitters). A prompt is computed in full, as without a
budget; its blocks are first scored by its last `observation_tokens` queries (SnapKV's observation
window), so a long prompt keeps what its end (typically a question) attends to. A freed block is
never read again; keys keep the positions they were computed at.

The observation window is its own, short, knob rather than the recent window: queries over filler
attend mostly near themselves and drown a question's few queries. On the shipped model, at half a
512-token prompt's budget, the planted fact was found 3/10 times scored by the last 128 queries
(the recent window), 9/10 by the last 16 (docs/benchmarks.md, kv_eviction).

Paged caches evict whole blocks, as block-wise variants of H2O do, rather than single tokens: a
block is what the pool hands out, so freeing single tokens would save no memory.

Disaggregated, the prefill worker scores the prompt and picks the kept blocks as the decode worker
would have (`kept`), and ships only those with their scores (`KeptBlocks`); the decode worker
reserves only as many (`kept_count`) and places them at their table indices
(engine.kv_connector.export).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.blocks import blocks_for


@dataclass(frozen=True)
class KVBudget:
    """At most `tokens` tokens of KV a request (rounded down to whole blocks), of which the last
    `recent_tokens` positions are always kept; a prompt's last `observation_tokens` queries score
    its blocks."""

    tokens: int
    recent_tokens: int
    block_size: int
    observation_tokens: int = 16

    def __post_init__(self) -> None:
        if self.observation_tokens < 1:
            raise ValueError(f"kv_budget_observation_tokens: must be at least 1, got {self.observation_tokens}")
        if self.recent_tokens < 1:
            raise ValueError(f"kv_budget_recent_tokens: must be at least 1, got {self.recent_tokens}")
        # The blocks a query's recent window touches, and the block its next token goes to.
        least = (blocks_for(self.recent_tokens + 1, self.block_size) + 1) * self.block_size
        if self.tokens < least:
            raise ValueError(f"kv_budget_tokens: {self.tokens} leaves no block to choose beyond a recent window "
                             f"of {self.recent_tokens} tokens; give at least {least} (block_size {self.block_size})")

    @property
    def blocks(self) -> int:
        """The most blocks a request holds between steps once its prompt is computed."""
        return self.tokens // self.block_size

    def score_from(self, num_known_tokens: int) -> int:
        """The first query position whose attention scores the blocks, in a step computing up to a
        request's `num_known_tokens` (its prompt's end, or a decode step's one query)."""
        return num_known_tokens - self.observation_tokens

    def victims(self, held: Sequence[int], scores: Mapping[int, float], num_computed: int) -> list[int]:
        """The table indices of the blocks to free, lowest score first (older on a tie), so that a
        request holding `held` with `num_computed` tokens computed holds at most `blocks` blocks
        once its next token's slot is allocated. Only blocks wholly before the recent window go."""
        room = 1 if num_computed % self.block_size == 0 else 0  # the next token opens a block
        excess = len(held) + room - self.blocks
        if excess <= 0:
            return []
        protected = max(0, num_computed - self.recent_tokens) // self.block_size
        candidates = sorted((index for index in held if index < protected),
                            key=lambda index: (scores.get(index, 0.0), index))
        return candidates[:excess]

    def kept_count(self, num_blocks: int, num_computed: int) -> int:
        """How many of a request's `num_blocks` blocks (all held, `num_computed` tokens computed)
        survive its first eviction: as many whatever their scores."""
        return num_blocks - len(self.victims(range(num_blocks), {}, num_computed))

    def surely_kept_from(self, num_tokens: int) -> int:
        """The first table index of the blocks a prompt of `num_tokens` tokens (all computed) keeps
        whatever the scores, every later one too: 0 when it keeps every block, else its recent
        window's first (only blocks before it are ever victims)."""
        num_blocks = blocks_for(num_tokens, self.block_size)
        if self.kept_count(num_blocks, num_tokens) == num_blocks:
            return 0
        return max(0, num_tokens - self.recent_tokens) // self.block_size

    def kept(self, held: Sequence[int], scores: Mapping[int, float], num_computed: int) -> KeptBlocks:
        """The blocks of `held` (table indices) that survive `victims`, with their scores."""
        victims = set(self.victims(held, scores, num_computed))
        indices = tuple(index for index in held if index not in victims)
        return KeptBlocks(indices, tuple(scores.get(index, 0.0) for index in indices))


@dataclass(frozen=True)
class KeptBlocks:
    """The blocks a prompt keeps under a budget once computed: their table indices (increasing)
    and their accumulated attention mass, which the request's later evictions add to."""

    indices: tuple[int, ...]
    scores: tuple[float, ...]


def kv_budget(config: EngineConfig, model: ModelConfig) -> KVBudget | None:
    """The budget an engine evicts under (None: none), its recent window half the budget unless
    given (H2O's even split between heavy hitters and recent tokens). ValueError naming the flag
    and the model for a combination not served."""
    cache = config.cache
    if cache.budget_tokens is None:
        return None
    served = _unserved(config, model)
    if served is not None:
        raise ValueError(f"kv_budget_tokens: not served {served}")
    recent = cache.budget_recent_tokens
    return KVBudget(cache.budget_tokens, cache.budget_tokens // 2 if recent is None else recent, cache.block_size,
                    cache.budget_observation_tokens)


def check_scores_for(own: KVBudget | None, asked: KVBudget) -> None:
    """ValueError naming the field unless an engine evicting under `own` can pick a prompt's kept
    blocks for a receiver evicting under `asked`: it must score blocks at all (a budget of its own,
    so its attention scores: `_unserved` held at its start-up), by the same observation window."""
    if own is None:
        raise ValueError("kv_budget: this worker scores no blocks; start it with --kv-budget-tokens (any budget, "
                         "the same --kv-budget-observation-tokens) to compute prompts for decode workers with one")
    if asked.observation_tokens != own.observation_tokens:
        raise ValueError(f"kv_budget.observation_tokens: {asked.observation_tokens} differs from this worker's "
                         f"--kv-budget-observation-tokens {own.observation_tokens}, which its scores come from")
    if asked.block_size != own.block_size:
        raise ValueError(f"kv_budget: blocks of {asked.block_size} tokens differ from this worker's {own.block_size}")


def _unserved(config: EngineConfig, model: ModelConfig) -> str | None:
    """Why a budget cannot run on this engine and model, or None."""
    if model.sliding_window is not None:
        return f"on model {model.name}, which declares its own sliding_window ({model.sliding_window})"
    if config.world_size > 1:
        # Each rank would score only its heads and evict other blocks than the others.
        return f"with a world of {config.world_size} processes (model {model.name}): {config.parallel_sizes}"
    if config.speculative is not None:
        # Rejected drafts' queries would have scored blocks.
        return f"with speculative_config (model {model.name})"
    if config.attention_backend == "triton":
        # Scores come from the torch attention that gathers only held blocks (engine.attention.scored).
        return f"with attention_backend triton (model {model.name}); use auto or torch"
    return None
