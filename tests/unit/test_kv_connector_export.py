"""Which pages the engine hands a prefill request's sink after each layer (no model: the chunks are
built by hand and the gather records what it was asked for)."""

from __future__ import annotations

import torch

from engine.kv_cache.kv_budget import KVBudget
from engine.kv_connector.export import KVExport, KVExports, LayerPages
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk

BLOCK = 4
LAYERS = 2


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None, int]] = []  # (layer, first destination block, blocks)

    def layer_done(self, layer: int, pages: LayerPages | None) -> None:
        self.calls.append((layer, None, 0) if pages is None else (layer, pages.first_block, pages.k.shape[0]))


def _chunk(request: Request, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(request, start, num_tokens, block_table=tuple(range(8)))


def _step(exports: KVExports, chunk: ScheduledChunk, asked: list[tuple[int, int, int]]) -> None:
    """One step of `chunk` through every layer; `asked` records the blocks each layer gathered."""
    ranges = exports.ranges([chunk])
    blocks = sum(max(0, r.end - r.first) for r in ranges)
    for layer in range(LAYERS):
        asked.extend((layer, r.first, r.end) for r in ranges if r.end > r.first)
        pages = torch.zeros(blocks, BLOCK, 1, 2)
        exports.layer_done(layer, ranges, (pages, pages.clone()) if blocks else None)


def test_chunks_send_the_blocks_they_wrote_again_when_partly_filled_and_skip_the_receivers_prefix():
    request = Request("r", list(range(22)), SamplingParams(), max_model_len=64)
    exports, sink, asked = KVExports(BLOCK, LAYERS), _Sink(), []
    # The receiver holds the first 5 tokens' whole block (1 block); this engine computes from token 8
    # on (its own prefix-cache hit covers blocks 0-1), in chunks of 6 and 8 tokens.
    exports.add("r", KVExport(sink, receiver_cached_tokens=5), request.num_tokens)
    _step(exports, _chunk(request, 8, 6), asked)  # tokens 8..13: blocks 2-3, and block 1 never sent
    _step(exports, _chunk(request, 14, 8), asked)  # tokens 14..21: block 3 again (now full), 4, 5
    assert asked == [(0, 1, 4), (1, 1, 4), (0, 3, 6), (1, 3, 6)]
    assert sink.calls == [(0, 0, 3), (1, 0, 3), (0, 2, 3), (1, 2, 3)]


def test_a_chunk_inside_the_receivers_prefix_reports_its_layers_without_pages():
    request = Request("r", list(range(20)), SamplingParams(), max_model_len=64)
    exports, sink, asked = KVExports(BLOCK, LAYERS), _Sink(), []
    exports.add("r", KVExport(sink, receiver_cached_tokens=16), request.num_tokens)
    _step(exports, _chunk(request, 0, 8), asked)
    assert asked == [] and sink.calls == [(0, None, 0), (1, None, 0)]


def test_a_dropped_request_gets_no_more_pages():
    request = Request("r", list(range(8)), SamplingParams(), max_model_len=64)
    exports, sink, asked = KVExports(BLOCK, LAYERS), _Sink(), []
    exports.add("r", KVExport(sink), request.num_tokens)
    assert exports
    exports.drop("r")
    assert not exports
    _step(exports, _chunk(request, 0, 8), asked)
    assert asked == [] and sink.calls == []


def test_under_a_budget_the_recent_window_goes_as_computed_to_the_receivers_last_blocks_and_the_rest_waits():
    # 30 tokens, 8 blocks; a budget of 5 blocks keeps the recent window's (tokens 24..29: blocks 6, 7)
    # whatever the scores, and 3 of blocks 0-5 once scored: the receiver reserved 5 blocks.
    request = Request("r", list(range(30)), SamplingParams(), max_model_len=64)
    budget = KVBudget(tokens=20, recent_tokens=6, block_size=BLOCK)
    exports, sink, asked = KVExports(BLOCK, LAYERS), _Sink(), []
    exports.add("r", KVExport(sink, budget=budget), request.num_tokens)
    _step(exports, _chunk(request, 0, 16), asked)  # blocks 0-3: held
    _step(exports, _chunk(request, 16, 14), asked)  # blocks 4-7: 6 and 7 go, to the receiver's 3 and 4
    assert asked == [(0, 6, 8), (1, 6, 8)]
    assert sink.calls == [(0, None, 0), (1, None, 0), (0, 3, 2), (1, 3, 2)]
    # The step that computed the prompt's end hands the rest on: from block 6 on, all went.
    assert exports.take_budgeted(["r", "other"]) == [("r", sink, budget, 6)]
    assert not exports


def test_under_a_budget_a_prompt_it_holds_whole_goes_as_computed():
    request = Request("r", list(range(18)), SamplingParams(), max_model_len=64)  # 5 blocks, all kept
    exports, sink, asked = KVExports(BLOCK, LAYERS), _Sink(), []
    exports.add("r", KVExport(sink, budget=KVBudget(tokens=20, recent_tokens=6, block_size=BLOCK)),
                request.num_tokens)
    _step(exports, _chunk(request, 0, 18), asked)
    assert sink.calls == [(0, 0, 5), (1, 0, 5)]
