"""Which layers one stage of a pipeline-parallel engine holds, and a step cut into micro-batches.

`--pipeline-parallel-size P` gives each of P stage processes a contiguous range of the decoder
layers (the first stages one more where P does not divide them), the first stage the embedding and
the last the final norm and the LM head (a tied embedding: both). A stage holds only its layers'
weights and KV blocks (every stage holds the same block ids, as tensor-parallel ranks do).

A step's sequences are cut into up to P micro-batches of about equal tokens, whole sequences each:
stage s computes micro-batch i + 1 while stage s + 1 computes micro-batch i, so a step costs about
one stage's share of it times (P + M - 1) / M instead of P stages one after the other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import ModelConfig, PipelineStage
from engine.model.quantized import Weight

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineLayout:
    """Stage `stage` of `size` stages."""

    size: int = 1
    stage: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"pipeline_parallel_size: must be at least 1, got {self.size}")
        if not 0 <= self.stage < self.size:
            raise ValueError(f"stage: must be in [0, {self.size}), got {self.stage}")

    def check(self, config: ModelConfig) -> None:
        """ValueError naming the numbers when this many stages cannot split `config`'s layers."""
        if self.size > config.num_layers:
            raise ValueError(f"pipeline_parallel_size {self.size} exceeds the {config.num_layers} layers of "
                             f"{config.name}: every stage needs at least one")

    def layers(self, config: ModelConfig, stage: int | None = None) -> range:
        """The layers stage `stage` (default: this one) holds."""
        stage = self.stage if stage is None else stage
        share, extra = divmod(config.num_layers, self.size)
        start = stage * share + min(stage, extra)
        return range(start, start + share + (stage < extra))

    def stage_of(self, config: ModelConfig, layer: int) -> int:
        """The stage holding layer `layer`."""
        return next(stage for stage in range(self.size) if layer in self.layers(config, stage))

    def stage_config(self, config: ModelConfig) -> ModelConfig:
        """The shape of this stage's part of the whole model `config` (checked first)."""
        self.check(config)
        if self.size == 1:
            return config
        held = self.layers(config)
        return replace(config, num_layers=len(held), stage=PipelineStage(held.start, config.num_layers))

    def budget_layers(self, config: ModelConfig) -> int:
        """The most layers a stage holds: every stage sizes its KV blocks by it, so all hold as many."""
        return len(self.layers(config, 0))

    def keep(self, config: ModelConfig, name: str, weight: Weight) -> Weight | None:
        """`weight` if this stage holds the tensor `name`, else None (engine.model.quantized.KeepWeight)."""
        if self.size == 1:
            return weight
        stage = self.stage_config(config)
        layer = _LAYER.match(name)
        if layer is not None:
            held = int(layer.group(1)) in self.layers(config)
        elif name == "model.embed_tokens.weight":
            held = stage.first_stage or (stage.last_stage and config.tie_word_embeddings)
        else:  # the final norm and the LM head
            held = stage.last_stage
        return weight if held else None


@dataclass(frozen=True)
class MicroBatch:
    """Some whole sequences of a step (their indices in it): their token rows of the step, their
    attention metadata, and the rows (of the micro-batch) whose logits are sampled."""

    rows: range
    meta: AttentionMetadata
    sample_rows: list[int]
    sequences: range


def micro_batches(meta: AttentionMetadata, sample_rows: list[int], count: int) -> list[MicroBatch]:
    """The step cut into at most `count` micro-batches of whole sequences, in order, of about equal
    tokens (every stage cuts a step the same way: this is a function of the step alone)."""
    starts = meta.query_start_loc.tolist()
    total, groups, first = starts[-1], [], 0
    for index in range(1, meta.num_seqs + 1):
        target = total * (len(groups) + 1) / count
        if index == meta.num_seqs or (starts[index] >= target and len(groups) < count - 1):
            groups.append(range(first, index))
            first = index
    return [_micro_batch(meta, sample_rows, sequences, starts) for sequences in groups]


def _micro_batch(meta: AttentionMetadata, sample_rows: list[int], sequences: range, starts: list[int]) -> MicroBatch:
    rows = range(starts[sequences.start], starts[sequences.stop])
    query_start = torch.tensor(starts[sequences.start:sequences.stop + 1], dtype=meta.query_start_loc.dtype,
                               device=meta.query_start_loc.device) - rows.start
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows.start:rows.stop],
        query_start_loc=query_start,
        seq_lens=meta.seq_lens[sequences.start:sequences.stop],
        block_tables=meta.block_tables[sequences.start:sequences.stop],
        query_lens_list=meta.query_lens_list[sequences.start:sequences.stop],
        seq_lens_list=meta.seq_lens_list[sequences.start:sequences.stop],
    )
    return MicroBatch(rows, sub, [row - rows.start for row in sample_rows if row in rows], sequences)
