"""Perplexity over a text longer than the model's context (the fidelity suite's --long-text): the
fixed text (bench/texts/README.md), 13,432 tokens of the shipped model's 8,192-token context,
teacher-forced in chunks, each SEGMENT_TOKENS tokens' perplexity on its own, so that a row that
degrades as it goes on (the paper's "window attention" without sinks) shows where.

fp32 with full KV runs as far as its engine serves: the model's context. A row with a serving window
(StreamingLLM: positions within the cache) may run past it (its max_model_len set to the text's
length) and is scored to the end; a stable row keeps its segments near full KV's.
"""

from __future__ import annotations

import gc
import math
from dataclasses import replace

from bench.common.model_quality import token_nlls
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for

SEGMENT_TOKENS = 1024
CHUNK_TOKENS = 512


def segment_perplexities(config: EngineConfig, ids: list[int], chunk_tokens: int = CHUNK_TOKENS,
                         segment_tokens: int = SEGMENT_TOKENS) -> list[float]:
    """Each segment's perplexity over as much of `ids` as an engine of `config` serves, its KV cache
    holding blocks for all of it (the text is teacher-forced over one table of fresh blocks)."""
    cache = replace(config.cache, num_blocks=blocks_for(len(ids), config.cache.block_size))
    engine = Engine(replace(config, max_model_len=len(ids), cache=cache))
    try:
        nlls = token_nlls(engine, ids[:engine.max_model_len], chunk_tokens)
    finally:
        del engine
        gc.collect()
    return [math.exp(float(nlls[start:start + segment_tokens].mean()))
            for start in range(0, len(nlls), segment_tokens)]


def long_text_table(names: list[str], results: dict[str, list[float]], predictions: int,
                    segment_tokens: int = SEGMENT_TOKENS) -> str:
    """One line per segment (the positions, of the text's `predictions`, whose next token it
    predicts), one column per row; '-' past where a row stops."""
    lines = ["| positions | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for index in range(max(len(r) for r in results.values())):
        cells = [f"{results[name][index]:.2f}" if index < len(results[name]) else "-" for name in names]
        last = min((index + 1) * segment_tokens, predictions) - 1
        lines.append(f"| {index * segment_tokens}-{last} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
