"""How close a variant of the served model stays to the original: the measures the fidelity,
gptq_awq and weight_formats suites share.

The weight_formats suite takes its prompts and windows from this repository's own documents
(`document_windows`); the fidelity suite from a fixed public-domain text committed with the
bench (`FIXED_TEXT`, bench/texts/README.md), so that its figures do not move when a document changes.
The perplexity is teacher-forced, so it does not depend on where greedy decoding happens to fork.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from bench.common.paths import BENCH_DIR
from engine.attention.metadata import AttentionMetadata
from engine.engine import Engine
from engine.kv_cache.blocks import blocks_for
from harness.paths import REPO

SCORED_DOCUMENTS = ("README.md", "docs/architecture.md")
FIXED_TEXT = BENCH_DIR / "texts" / "jargon-file-4.4.7-chapters-1-9.txt"


def spans(ids: Sequence[int], count: int, tokens: int, centred: bool = False) -> list[list[int]]:
    """`count` spans of `tokens` ids evenly spaced over `ids`: the first at its start and the last at
    its end, or (`centred`) each in the middle of one of `count` equal parts, which puts them between
    the spans of the first kind."""
    if len(ids) < tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one span of {tokens}")
    if centred:
        stride = (len(ids) - tokens) // count
        return [list(ids[i * stride + stride // 2:i * stride + stride // 2 + tokens]) for i in range(count)]
    stride = (len(ids) - tokens) // max(count - 1, 1)
    return [list(ids[i * stride:i * stride + tokens]) for i in range(count)]


def document_windows(engine: Engine, count: int, tokens: int,
                     documents: tuple[str, ...] = SCORED_DOCUMENTS) -> list[list[int]]:
    """`count` windows of `tokens` token ids, evenly spaced over the documents' text."""
    return spans(engine.tokenizer.encode("".join((REPO / document).read_text() for document in documents)),
                 count, tokens)


def next_token_nlls(logits: torch.Tensor, next_ids: Sequence[int]) -> torch.Tensor:
    """The negative log-likelihoods −log softmax(logits[i])[next_ids[i]] [len(next_ids)], in float64:
    row i of `logits` is the model's prediction of next_ids[i]. Computed in fp32 whatever the logits' dtype."""
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(list(next_ids)), reduction="none").double()


def perplexity_of(nll_sum: float, tokens: int) -> float:
    """exp of the mean negative log-likelihood of `tokens` predictions whose NLLs sum to `nll_sum`."""
    if tokens <= 0:
        raise ValueError(f"perplexity of {tokens} predictions")
    return math.exp(nll_sum / tokens)


def perplexity(engine: Engine, windows: list[list[int]], chunk_tokens: int | None = None) -> float:
    """exp(mean next-token NLL) over the windows, each computed over fresh cache blocks, in one forward
    pass or (`chunk_tokens`) in chunks of that many tokens, each of which reads the chunks before it
    from the KV cache, as a decode step does: a quantized KV cache then shows in the figure whatever
    an attention backend does with the keys of the chunk it is computing."""
    nlls = [token_nlls(engine, ids, chunk_tokens) for ids in windows]
    return perplexity_of(sum(float(n.sum()) for n in nlls), sum(len(n) for n in nlls))


def token_nlls(engine: Engine, ids: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
    """Each next-token NLL [len(ids) - 1] (float64) of one text teacher-forced over fresh cache blocks
    from block 0 on, in chunks as `perplexity` says."""
    model, cache = engine.runner.model, engine.runner.cache
    tokens = len(ids)
    step = chunk_tokens or tokens
    table = torch.arange(blocks_for(tokens, cache.block_size), dtype=torch.int32)[None]
    nlls = []
    with torch.inference_mode():
        for start in range(0, tokens - 1, step):
            end = min(start + step, tokens)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, end),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table,
                query_lens_list=(end - start,), seq_lens_list=(end,))
            hidden = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), cache.kv_caches, meta)
            targets = ids[start + 1:end + 1]  # the text's last position has nothing to predict
            nlls.append(next_token_nlls(model.compute_logits(hidden[:len(targets)]), targets))
    return torch.cat(nlls)


def first_difference(reference: list[int], other: list[int]) -> int:
    """Index of the first token where two greedy outputs differ (their length if none)."""
    return next((i for i, (a, b) in enumerate(zip(reference, other, strict=True)) if a != b), len(reference))
