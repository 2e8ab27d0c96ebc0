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

A mixture of experts splits like the MLP it replaces: each expert's intermediate features (and the
shared expert's) go to the ranks in shares, and the router is replicated. With expert parallelism
(vLLM's `--enable-expert-parallel` without data parallelism: EP size = TP size) each rank instead
holds a contiguous range of whole experts, an equal share of them; attention stays tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.config import EngineConfig, ModelConfig

FEATURE_GRANULE = 32  # intermediate features per indivisible unit of a split: GGUF's and GPTQ's usual group


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank` of `size` ranks; with `expert_parallel`, the experts split whole over the ranks."""

    size: int = 1
    rank: int = 0
    expert_parallel: bool = False

    @classmethod
    def of(cls, config: EngineConfig, rank: int) -> TensorParallelLayout:
        """Rank `rank`'s layout of the engine `config` describes."""
        return cls(config.tensor_parallel_size, rank, config.enable_expert_parallel)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {self.rank}")

    def check(self, config: ModelConfig) -> None:
        """ValueError naming the numbers when this size cannot split `config`'s model."""
        size = self.size
        moe = config.moe
        if self.expert_parallel and moe is None:
            raise ValueError(f"enable_expert_parallel: {config.name} ({config.architecture}) is a dense model; it has "
                             "no experts to split")
        if size == 1:
            return
        problems = []
        if config.num_heads % size:
            problems.append(f"the {config.num_heads} query heads")
        if config.num_kv_heads % size and size % config.num_kv_heads:
            problems.append(f"the {config.num_kv_heads} KV heads (nor is it a multiple of them, to replicate them)")
        if moe is None:
            problems += self._feature_problems(config.intermediate_size, "intermediate features")
        elif self.expert_parallel:
            if moe.num_experts % size:
                problems.append(f"the {moe.num_experts} experts (expert parallelism gives every rank an equal share)")
        else:
            problems += self._feature_problems(moe.intermediate_size, "intermediate features of each expert")
        if moe is not None and moe.shared_intermediate_size:
            problems += self._feature_problems(moe.shared_intermediate_size,
                                               "intermediate features of the shared expert")
        if config.vocab_size < size:
            problems.append(f"the vocabulary of {config.vocab_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size {size} does not divide {', '.join(problems)} of "
                             f"{config.name}")

    def _feature_problems(self, features: int, what: str) -> list[str]:
        if features % FEATURE_GRANULE or features // FEATURE_GRANULE < self.size:
            return [f"the {features} {what} into groups of {FEATURE_GRANULE}"]
        return []

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

    def experts(self, config: ModelConfig) -> range:
        """The experts this rank holds: its share under expert parallelism, else all of them."""
        assert config.moe is not None
        if not self.expert_parallel:
            return range(config.moe.num_experts)
        return self._range(config.moe.num_experts)

    def expert_intermediate(self, config: ModelConfig) -> range:
        """Each held expert's intermediate features this rank computes: all of them under expert
        parallelism, else its share."""
        assert config.moe is not None
        features = config.moe.intermediate_size
        return range(features) if self.expert_parallel else self._range(features, FEATURE_GRANULE)

    def shared_intermediate(self, config: ModelConfig) -> range:
        """The shared expert's intermediate features this rank computes."""
        assert config.moe is not None
        return self._range(config.moe.shared_intermediate_size, FEATURE_GRANULE)

    def vocabulary(self, config: ModelConfig) -> range:
        """The token ids whose embedding rows and logits this rank holds."""
        return self._range(config.vocab_size)

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The shape of this rank's part of the model (checked first)."""
        self.check(config)
        moe = config.moe
        if moe is not None:
            experts = self.experts(config)
            moe = replace(moe, experts_held=(experts.start, experts.stop),
                          intermediate_size=len(self.expert_intermediate(config)),
                          shared_intermediate_size=len(self.shared_intermediate(config)))
        intermediate = config.intermediate_size if config.moe is not None else len(self.intermediate(config))
        return replace(config, num_heads=len(self.query_heads(config)), num_kv_heads=len(self.kv_heads(config)),
                       intermediate_size=intermediate, vocab_size=len(self.vocabulary(config)), moe=moe)
