"""Running an engine's requests to the end, for the tests that compare outputs."""

from __future__ import annotations

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.resume import Resumed
from engine.sampling_params import SamplingParams


def run_requests(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
                 resumed: dict[str, Resumed] | None = None) -> dict[str, list[RequestOutput]]:
    """Every request's outputs, all submitted together; the KV bookkeeping is checked every step,
    and every block is free at the end."""
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, (resumed or {}).get(rid))
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].append(output)
        engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return outputs


def output_tokens(outputs: list[RequestOutput]) -> list[int]:
    """The token ids a request's outputs carried, in order."""
    return [t for o in outputs for t in o.new_token_ids]
