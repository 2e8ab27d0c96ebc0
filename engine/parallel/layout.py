"""Which part of a model one rank of a tensor-parallel worker holds.

Megatron's split of a Llama block: the query heads, and with them the columns of the QKV product
and the rows of the output projection, go to the ranks in contiguous ranges; so do the MLP's
intermediate features (gate/up columns, down rows) and the vocabulary (embedding rows, LM head
rows). The KV heads split like the query heads while there are at least as many as ranks; with
more ranks than KV heads each KV head is replicated on size / num_kv_heads ranks (as vLLM does), so
that every rank holds the one KV head its query heads read. Heads split evenly; the intermediate
features and the vocabulary need not: ranks take shares that differ by one granule (a whole group
of 32 intermediate features, so that integer groups of 32 are never cut; one token of vocabulary),
which lets the shipped model (1,536 features, 49,152 tokens) run at 9 ranks as its 9 heads allow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import ModelConfig

FEATURE_GRANULE = 32  # intermediate features per indivisible unit of a split: GGUF's and GPTQ's usual group


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank` of `size` ranks."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {self.rank}")

    def check(self, config: ModelConfig) -> None:
        """ValueError naming the numbers when this size cannot split `config`'s model."""
        size = self.size
        if size == 1:
            return
        problems = []
        if config.num_heads % size:
            problems.append(f"the {config.num_heads} query heads")
        if config.num_kv_heads % size and size % config.num_kv_heads:
            problems.append(f"the {config.num_kv_heads} KV heads (nor is it a multiple of them, to replicate them)")
        if config.intermediate_size % FEATURE_GRANULE or config.intermediate_size // FEATURE_GRANULE < size:
            problems.append(f"the {config.intermediate_size} intermediate features into groups of {FEATURE_GRANULE}")
        if config.vocab_size < size:
            problems.append(f"the vocabulary of {config.vocab_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size {size} does not divide {', '.join(problems)} of "
                             f"{config.name}")

    def _range(self, total: int, granule: int = 1) -> range:
        """This rank's share of `total` in whole granules; the first ranks take one more granule
        when they do not divide evenly."""
        granules, extra = divmod(total // granule, self.size)
        start = self.rank * granules + min(self.rank, extra)
        count = granules + (self.rank < extra)
        return range(start * granule, (start + count) * granule)

    def query_heads(self, config: ModelConfig) -> range:
        """The query heads this rank computes."""
        return self._range(config.num_heads)

    def kv_heads(self, config: ModelConfig) -> range:
        """The KV heads this rank holds: its share, or the one head its query heads read when the
        heads are replicated."""
        if self.size <= config.num_kv_heads:
            return self._range(config.num_kv_heads)
        head = self.rank * config.num_kv_heads // self.size
        return range(head, head + 1)

    def intermediate(self, config: ModelConfig) -> range:
        """The MLP's intermediate features this rank computes."""
        return self._range(config.intermediate_size, FEATURE_GRANULE)

    def vocabulary(self, config: ModelConfig) -> range:
        """The token ids whose embedding rows and logits this rank holds."""
        return self._range(config.vocab_size)

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of the model (checked first)."""
        self.check(config)
        return replace(config, num_heads=len(self.query_heads(config)), num_kv_heads=len(self.kv_heads(config)),
                       intermediate_size=len(self.intermediate(config)), vocab_size=len(self.vocabulary(config)))
