"""Driving one request path of the disaggregated design by hand, inside one process: the decode
engine reserves, the prefill engine computes the prompt and hands each layer's pages to a sink as
it writes them (as a prefill worker's push does), the pages are imported, the decode engine decodes.
Shared by the engine tests of both roles."""

from __future__ import annotations

import torch

from engine.engine import Engine
from engine.kv_cache.kv_budget import KeptBlocks, KVBudget
from engine.kv_connector.export import KVExport, LayerPages
from engine.outputs import KVReservation
from engine.resume import Resumed
from engine.sampling_params import SamplingParams


class CollectedPages:
    """A KV sink that keeps every page it is handed, by layer and destination block (a block sent
    again, fuller, replaces what came before, as it does at a receiver)."""

    def __init__(self) -> None:
        self._pages: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.nbytes = 0  # of every page handed over
        self.kept_blocks: KeptBlocks | None = None  # under a budget, what the prompt kept
        self.blocks_before_kept = 0  # pages of a block and layer handed over before the kept blocks were named

    def kept(self, kept: KeptBlocks) -> None:
        self.kept_blocks = kept

    def layer_done(self, layer: int, pages: LayerPages | None) -> None:
        if pages is not None:
            self.nbytes += pages.nbytes
            self.blocks_before_kept += pages.k.shape[0] if self.kept_blocks is None else 0
            for index in range(pages.k.shape[0]):
                self._pages.setdefault(layer, {})[pages.first_block + index] = (pages.k[index], pages.v[index])

    def layer(self, layer: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of destination blocks [0, blocks); KeyError if one never came."""
        got = self._pages[layer]
        return (torch.stack([got[index][0] for index in range(blocks)]),
                torch.stack([got[index][1] for index in range(blocks)]))


def prefill_into(prefill: Engine, request_id: str, prompt: list[int], params: SamplingParams,
                 receiver_cached_tokens: int = 0, resumed: Resumed | None = None,
                 budget: KVBudget | None = None) -> tuple[int, CollectedPages]:
    """Compute a prompt (with `resumed`, and the output already delivered) on `prefill` with its pages
    exported (under the receiver's `budget`: only the kept blocks): the first token, and the pages;
    the prefill engine holds nothing after."""
    sink = CollectedPages()
    prefill.add_request(request_id, prompt, params, resumed, KVExport(sink, receiver_cached_tokens, budget))
    first = None
    while first is None:
        for output in prefill.step():
            assert output.request_id == request_id and output.finished
            first = output
    assert first.finish_reason in ("handoff", "stop", "length")
    prefill.release(request_id)
    return first.new_token_ids[0], sink


def import_all(decode: Engine, reservation: KVReservation, pages: CollectedPages, num_layers: int) -> None:
    """Write every layer's collected pages into the reservation's blocks to fill."""
    blocks = reservation.blocks_to_fill
    for layer in range(num_layers):
        decode.import_kv(reservation, layer, blocks, *pages.layer(layer, len(blocks)))


def run_disaggregated(
    prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Drive the request path by hand: reserve on D, prefill on P, ship every layer, decode on D."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        request_id = f"r{i}"
        reservation = decode.reserve(request_id, prompt, params)
        assert isinstance(reservation, KVReservation)
        first, pages = prefill_into(prefill, request_id, prompt, params, reservation.num_cached_tokens)
        import_all(decode, reservation, pages, prefill.model_config.num_layers)
        started = decode.start_decode(request_id, first)
        tokens[request_id] = list(started.new_token_ids)
    while decode.has_unfinished():
        for output in decode.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]
