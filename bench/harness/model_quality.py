"""How close a variant of the served model stays to the original: the measures cpu_weights and
int8_prefill share.

Prompts and perplexity windows come from this repository's own documents (no download); the
perplexity is teacher-forced, so it does not depend on where greedy decoding happens to fork.
"""

from __future__ import annotations

import math

import torch

from bench.harness.paths import REPO
from engine.attention.metadata import AttentionMetadata
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for

SCORED_DOCUMENTS = ("README.md", "docs/architecture.md")


def document_windows(engine: Engine, count: int, tokens: int,
                     documents: tuple[str, ...] = SCORED_DOCUMENTS) -> list[list[int]]:
    """`count` windows of `tokens` token ids, evenly spaced over the documents' text."""
    text = "".join((REPO / document).read_text() for document in documents)
    ids = engine.tokenizer.encode(text)
    stride = (len(ids) - tokens) // max(count - 1, 1)
    return [ids[i * stride:i * stride + tokens] for i in range(count)]


def perplexity(engine: Engine, windows: list[list[int]]) -> float:
    """exp(mean next-token NLL) over the windows, each one forward pass over fresh cache blocks."""
    model, cache = engine.runner.model, engine.runner.cache
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids in windows:
            tokens = len(ids)
            blocks = blocks_for(tokens, cache.block_size)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(tokens), query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
                seq_lens=torch.tensor([tokens], dtype=torch.int32),
                block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                query_lens_list=(tokens,), seq_lens_list=(tokens,))
            hidden = model.forward(torch.tensor(ids), torch.arange(tokens), cache.kv_caches, meta)
            logits = model.compute_logits(hidden[:-1])
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
            count += tokens - 1
    return math.exp(total / count)


def first_difference(reference: list[int], other: list[int]) -> int:
    """Index of the first token where two greedy outputs differ (their length if none)."""
    return next((i for i, (a, b) in enumerate(zip(reference, other, strict=True)) if a != b), len(reference))
