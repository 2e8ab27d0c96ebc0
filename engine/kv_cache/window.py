"""Sliding-window attention: which earlier tokens a query sees, and so which KV blocks a request
still needs. One rule for the attention backends (what to read) and the KV cache manager (what to
free). No torch.

A query at position p sees the keys in (p - size, p] (Mistral's window, as transformers masks it:
`size` keys, itself included) and the first `sink_tokens` keys (StreamingLLM's attention sinks; 0
for a model's own window). A model's own window keeps every key at the position it was computed at
(the model was trained so). The serving option is StreamingLLM's (`cache_positions`): positions are
those within the cache, not in the text, so a request may outgrow the model's context
(engine.attention.streaming).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.blocks import blocks_for


@dataclass(frozen=True)
class KVWindow:
    """The last `size` positions up to each query, plus the first `sink_tokens` (whole blocks);
    with `cache_positions`, keys are cached before the rotary embedding and every query and key is
    rotated at its position within the cache (StreamingLLM)."""

    size: int
    sink_tokens: int = 0
    cache_positions: bool = False

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"sliding_window: must be positive, got {self.size}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens: must not be negative, got {self.sink_tokens}")

    @property
    def policy(self) -> str:
        """The window as a name, for the identity of the blocks computed under it."""
        # Unrotated keys are other bytes for the same tokens: never mixed with rotated ones.
        keys = ",keys=unrotated" if self.cache_positions else ""
        return f"window={self.size},sinks={self.sink_tokens}{keys}"

    def shift(self, position: int) -> int:
        """How far the cache position of the query at text position `position` (and of the window's
        keys it sees) is below the text's: the positions evicted between the sinks and its window."""
        return self.first_needed(position) - self.sink_tokens if self.cache_positions else 0

    def first_needed(self, position: int) -> int:
        """The first key position past the sinks that a query at `position` or later sees."""
        return max(self.sink_tokens, position - self.size + 1)

    def visible(self, key: int, query: int) -> bool:
        """Whether the query at position `query` sees the key at position `key`."""
        return key <= query and (key > query - self.size or key < self.sink_tokens)

    def unneeded_blocks(self, num_computed: int, block_size: int) -> range:
        """Indices of the blocks no query at `num_computed` or later sees: every position in them is
        past the sinks and before the window. The sinks' blocks are always kept."""
        return range(self.sink_tokens // block_size, self.first_needed(num_computed) // block_size)

    def max_held_blocks(self, block_size: int, chunk_tokens: int) -> int:
        """The most blocks a request holds at once when its prompt is computed in chunks of at most
        `chunk_tokens`: the sinks, the window behind a chunk's first query, and the chunk."""
        return self.sink_tokens // block_size + blocks_for(self.size - 1 + chunk_tokens, block_size) + 1


def kv_window(config: EngineConfig, model: ModelConfig) -> KVWindow | None:
    """The window an engine attends with: the model's own (`sliding_window` in its config) or the
    serving option (--kv-sliding-window, --kv-sink-tokens rounded up to whole blocks); None for
    full attention. ValueError naming the option and the model for a combination not served."""
    cache = config.cache
    if cache.sliding_window is None:
        return None if model.sliding_window is None else KVWindow(model.sliding_window)
    if model.sliding_window is not None:
        raise ValueError(f"kv_sliding_window: model {model.name} declares its own sliding_window "
                         f"({model.sliding_window}); the option is for full-attention models")
    # Whole blocks of sinks: a block is freed or kept as a whole.
    sinks = blocks_for(cache.sink_tokens, cache.block_size) * cache.block_size
    window = KVWindow(cache.sliding_window, sinks, cache_positions=True)
    # A query sits at most at cache position sinks + size - 1: within the context it was trained on.
    if sinks + cache.sliding_window > model.max_position_embeddings:
        raise ValueError(f"kv_sliding_window: {cache.sliding_window} plus {sinks} sink tokens exceed model "
                         f"{model.name}'s context of {model.max_position_embeddings} positions")
    return window


def max_model_len(config: EngineConfig, model: ModelConfig, window: KVWindow | None) -> int:
    """The most tokens (prompt and output) a request may hold: --max-model-len (default: the model's
    context), at most the context unless positions are the cache's (StreamingLLM), where no query
    sees a position beyond the window's."""
    context = model.max_position_embeddings
    if window is not None and window.cache_positions:
        return config.max_model_len or context
    return min(config.max_model_len or context, context)


def check_window_served(config: EngineConfig, model: ModelConfig, window: KVWindow | None) -> None:
    """ValueError naming the option and the model where a windowed engine would run a path that
    attends over whole contexts."""
    if window is None:
        return
    what = (f"model {model.name}'s sliding_window ({window.size})" if config.cache.sliding_window is None
            else f"kv_sliding_window ({window.size})")
    if config.prefill_context_parallel_size > 1:
        # Its ranks attend over all-gathered slices of the prompt, not through the window.
        raise ValueError(f"prefill_context_parallel_size: {config.prefill_context_parallel_size} is not served "
                         f"with {what}")
