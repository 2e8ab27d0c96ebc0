"""Driving one request path of the disaggregated design by hand, inside one process: the decode
engine reserves, the prefill engine computes the prompt, every layer's pages are copied across,
the decode engine decodes. Shared by the engine tests of both roles."""

from __future__ import annotations

from engine.engine import Engine
from engine.outputs import KVReservation
from engine.sampling_params import SamplingParams


def run_disaggregated(
    prefill: Engine, decode: Engine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Drive the request path by hand: reserve on D, prefill on P, ship every layer, decode on D."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        request_id = f"r{i}"
        reservation = decode.reserve(request_id, prompt, params)
        assert isinstance(reservation, KVReservation)
        prefill.add_request(request_id, prompt, params)
        first = None
        while first is None:
            for output in prefill.step():
                assert output.request_id == request_id and output.finished
                first = output
        assert first.finish_reason in ("handoff", "stop", "length")
        skip = reservation.num_cached_tokens // reservation.block_size
        for layer in range(prefill.model_config.num_layers):
            k, v = prefill.export_kv(request_id, layer, first_block=skip)
            decode.import_kv(request_id, layer, reservation.blocks_to_fill, k, v)
        prefill.release(request_id)
        started = decode.start_decode(request_id, first.new_token_ids[0])
        tokens[request_id] = list(started.new_token_ids)
    while decode.has_unfinished():
        for output in decode.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]
