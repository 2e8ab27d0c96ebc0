"""Sliding-window attention: which earlier tokens a query sees, and so which KV blocks a request
still needs. One rule for the attention backends (what to read) and the KV cache manager (what to
free). No torch.

A query at position p sees the keys in (p - size, p] (Mistral's window, as transformers masks it:
`size` keys, itself included) and the first `sink_tokens` keys (StreamingLLM's attention sinks; 0
for a model's own window). Keys keep the positions they were computed at: no key is re-rotated.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.blocks import blocks_for


@dataclass(frozen=True)
class KVWindow:
    """The last `size` positions up to each query, plus the first `sink_tokens` (whole blocks)."""

    size: int
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"sliding_window: must be positive, got {self.size}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens: must not be negative, got {self.sink_tokens}")

    @property
    def policy(self) -> str:
        """The window as a name, for the identity of the blocks computed under it."""
        return f"window={self.size},sinks={self.sink_tokens}"

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
    return KVWindow(cache.sliding_window, sinks)


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
