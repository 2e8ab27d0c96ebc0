"""Prefill -> export -> import -> decode across two engine instances (of the prefill and decode roles, or
both colocated) equals one colocated engine."""

from __future__ import annotations

import pytest
import torch
from disaggregated import CollectedPages, import_all, run_disaggregated
from parity_prompts import parity_prompt_ids

from engine.config import CacheConfig
from engine.kv_connector.export import KVExport
from engine.offline import generate
from engine.outputs import KVReservation, NoKVRoom, TooLargeForKV
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_prefill_export_import_decode_equals_colocated(make_engine, tokenizer, params):
    prompts = parity_prompt_ids(tokenizer)
    colocated = generate(make_engine(), prompts, params)
    prefill = make_engine(role="prefill")
    decode = make_engine(role="decode")
    assert run_disaggregated(prefill, decode, prompts, params) == [c.token_ids for c in colocated]
    # Nothing is left behind on either side once the requests are done.
    assert prefill.kv.usage == 0 and decode.kv.usage == 0
    assert not prefill.scheduler.requests and not decode.scheduler.requests


# fp8: 64 codes and a float32 scale a row (int8 pages travel the same way); int4: 32 bytes of
# two codes each and a float16 scale and minimum per 16 elements.
@pytest.mark.parametrize(("kv_cache_dtype", "row_bytes"), [("fp8", 68), ("int4", 48)])
def test_quantized_pages_carry_their_scales_to_the_decode_engine(make_engine, tokenizer, kv_cache_dtype, row_bytes):
    # A quantized prefill engine's pages hold codes and scales; a decode engine of the same KV dtype
    # continues exactly as one engine with that cache would.
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = parity_prompt_ids(tokenizer)[:3]
    fixed = {"dtype": "float32", "quantization": "none", "kv_cache_dtype": kv_cache_dtype}
    # One prompt at a time on both sides: a quantized cache decodes through the torch backend, whose
    # padded batches sum in an order that depends on the batch, and int4's coarse steps can turn
    # such a last-bit difference into another code (the pages themselves arrive bit-exact).
    colocated_engine = make_engine(**fixed)
    colocated = [generate(colocated_engine, [prompt], params)[0].token_ids for prompt in prompts]
    prefill, decode = make_engine(role="prefill", **fixed), make_engine(role="decode", **fixed)
    pages = prefill.runner.cache.kv_caches[0][0]  # what an export gathers blocks of
    assert pages.dtype == torch.uint8 and pages.shape[1:] == (16, 3, row_bytes)
    assert [run_disaggregated(prefill, decode, [prompt], params)[0] for prompt in prompts] == colocated
    assert decode.kv.usage == 0


def test_decode_side_prefix_hit_ships_only_the_rest(make_engine, tokenizer):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = parity_prompt_ids(tokenizer)[3]  # the ~1,000-token prompt
    prefill = make_engine(role="prefill")
    decode = make_engine(role="decode")
    first_pass = run_disaggregated(prefill, decode, [prompt], params)
    reservation = decode.reserve("again", prompt, params)
    assert isinstance(reservation, KVReservation) and reservation.num_cached_tokens >= 1000
    assert len(reservation.blocks_to_fill) < len(reservation.block_ids)
    decode.abort("again")
    assert run_disaggregated(prefill, decode, [prompt], params) == first_pass
    assert decode.kv.usage == 0


def test_reserve_says_why_it_cannot_take_a_prompt(make_engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    decode = make_engine(role="decode", cache=CacheConfig(num_blocks=4))  # 64 tokens of 16
    assert decode.reserve("too-large", list(range(1, 71)), params) == TooLargeForKV(
        num_prompt_tokens=70, needed_blocks=5, total_blocks=4)
    held = decode.reserve("held", list(range(1, 40)), params)
    assert isinstance(held, KVReservation) and len(held.block_ids) == 3
    assert decode.reserve("no-room", list(range(1, 30)), params) == NoKVRoom(needed_blocks=2, free_blocks=1)
    assert str(NoKVRoom(2, 1)) == "the prompt needs 2 blocks, 1 are free"
    decode.abort("held")
    assert not decode.scheduler.requests and decode.kv.usage == 0


def test_any_engine_hands_off_an_exported_prompt_and_decodes_the_rest(make_engine, tokenizer):
    # Two engines of the colocated role: one computes a prompt for the other while it decodes a
    # request of its own in the same batch, and the other decodes that prompt beside its own.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = parity_prompt_ids(tokenizer)[:3]
    expected = [c.token_ids for c in generate(make_engine(), prompts, params)]
    site_a, site_b = make_engine(), make_engine()
    reservation = site_b.reserve("handed", prompts[0], params)
    assert isinstance(reservation, KVReservation)
    sink = CollectedPages()
    site_a.add_request("own", prompts[1], params)
    site_a.add_request("handed", prompts[0], params, export=KVExport(sink, reservation.num_cached_tokens))
    site_b.add_request("own-b", prompts[2], params)
    tokens: dict[str, list[int]] = {"own": [], "own-b": []}
    first = None
    while site_a.has_unfinished():
        for output in site_a.step():
            if output.request_id == "handed":
                assert output.finish_reason == "handoff" and first is None
                first = output.new_token_ids[0]
                assert site_a.stats().num_free_blocks < site_a.kv.num_blocks - 1  # kept until released
                site_a.release("handed")
            else:
                tokens["own"].extend(output.new_token_ids)
    assert first is not None
    import_all(site_b, reservation, sink, site_b.model_config.num_layers)
    tokens["handed"] = list(site_b.start_decode("handed", first).new_token_ids)
    while site_b.has_unfinished():
        for output in site_b.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert [tokens["handed"], tokens["own"], tokens["own-b"]] == expected
    for engine in (site_a, site_b):
        assert engine.kv.usage == 0 and not engine.scheduler.requests and engine.next_kv_deadline() is None


def test_a_colocated_engine_computes_a_prompt_for_another_at_once_or_refuses_it(make_engine):
    # Two colocated engines each hold a reservation for a prompt the other is to compute, and what
    # is left of each cache is too small for the other's prompt. Queued, each export would wait for
    # blocks held by a reservation that waits on the other's export: neither would ever run, and
    # both reservations would wait out their KV deadline. Refused at once, the decode site frees its
    # reservation and the gateway runs the request elsewhere.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, second = list(range(1, 71)), list(range(100, 170))  # 5 blocks of 16 each, no shared prefix
    site_a, site_b = make_engine(cache=CacheConfig(num_blocks=8)), make_engine(cache=CacheConfig(num_blocks=8))
    for_a = site_a.reserve("first", first, params)  # site_b is to compute it
    for_b = site_b.reserve("second", second, params)  # site_a is to compute it
    assert isinstance(for_a, KVReservation) and isinstance(for_b, KVReservation)
    refused = site_a.add_request("second", second, params, export=KVExport(CollectedPages(), 0))
    assert refused == NoKVRoom(needed_blocks=5, free_blocks=3)
    assert site_b.add_request("first", first, params, export=KVExport(CollectedPages(), 0)) == refused
    # Nothing of the refused requests stays behind: each engine holds only its reservation.
    for engine, reserved in ((site_a, "first"), (site_b, "second")):
        assert list(engine.scheduler.requests) == [reserved] and not engine.scheduler.waiting
        engine.abort(reserved)
    # With room, the export is admitted with every block its prompt needs and hands off.
    sink = CollectedPages()
    assert site_a.add_request("second", second, params, export=KVExport(sink, 0)) is None
    assert site_a.kv.num_free_blocks == 8 - 5
    outputs = [output for _ in range(3) for output in site_a.step()]
    assert [(output.request_id, output.finish_reason) for output in outputs] == [("second", "handoff")]
