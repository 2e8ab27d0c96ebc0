"""The KV connector's block-ownership rule (engine.kv_connector.connector) on real engines of the
shipped model: a page that arrives after its reservation was cancelled or timed out never lands in a
block that has a new owner, and every deadline frees what it bounds."""

from __future__ import annotations

import threading

import pytest
import torch
from disaggregated import import_all, prefill_into

from engine.config import CacheConfig
from engine.engine import Engine
from engine.kv_connector.policy import KVConnectorPolicy
from engine.kv_connector.scheduler_side import KVConnectorScheduler
from engine.offline import generate
from engine.outputs import KVReservation
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _reserve(decode: Engine, request_id: str, prompt: list[int], timeout_s: float = 60.0) -> KVReservation:
    reservation = decode.reserve(request_id, prompt, GREEDY, kv_timeout_s=timeout_s)
    assert isinstance(reservation, KVReservation)
    return reservation


def _pages(engine: Engine, blocks: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [engine.runner.cache.gather_blocks(layer, blocks) for layer in range(engine.model_config.num_layers)]


@pytest.mark.parametrize(("ended_by", "next_id"), [("abort", "same"), ("deadline", "other")],
                         ids=["cancelled-then-same-request-id", "timed-out-then-new-request-id"])
def test_a_late_page_never_lands_in_the_blocks_next_owner(make_engine, tokenizer, ended_by, next_id):
    # Two blocks of 16 tokens each hold a prompt, its 6 new tokens and the slot after them.
    old_prompt = tokenizer.encode("Paged attention keeps the KV cache in fixed-size blocks, so that a request's "
                                  "memory grows a block at a time")[:20]
    new_prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it jumps over "
                                  "the lazy dog once more")[:20]
    assert len(old_prompt) == len(new_prompt) == 20
    [expected] = generate(make_engine(), [new_prompt], GREEDY)
    prefill = make_engine(role="prefill")
    decode = make_engine(role="decode", cache=CacheConfig(num_blocks=2))  # one request's room: blocks are reused
    _, late_pages = prefill_into(prefill, "old", old_prompt, GREEDY)

    old = _reserve(decode, "r", old_prompt, timeout_s=0.0 if ended_by == "deadline" else 60.0)
    if ended_by == "abort":
        assert decode.abort("r")
    else:
        assert decode.has_unfinished()  # the deadline passed: the engine acts on it without its worker
        assert decode.step() == []
    assert decode.stats().num_free_blocks == decode.kv.num_blocks and not decode.scheduler.requests

    new_id = "r" if next_id == "same" else "new"
    new = _reserve(decode, new_id, new_prompt)
    assert set(old.blocks_to_fill) == set(new.blocks_to_fill)  # the old reservation's blocks have a new owner
    first, pages = prefill_into(prefill, "new", new_prompt, GREEDY)
    import_all(decode, new, pages, decode.model_config.num_layers)
    before = _pages(decode, new.block_ids)

    for layer in range(decode.model_config.num_layers):  # the old transfer's pages arrive now
        with pytest.raises(KeyError, match="no live KV reservation"):
            decode.import_kv(old, layer, old.blocks_to_fill, *late_pages.layer(layer, len(old.blocks_to_fill)))
    after = _pages(decode, new.block_ids)
    assert all(torch.equal(b, a) for pair_b, pair_a in zip(before, after, strict=True)
               for b, a in zip(pair_b, pair_a, strict=True))

    tokens = list(decode.start_decode(new_id, first).new_token_ids)
    while decode.has_unfinished():
        for output in decode.step():
            tokens.extend(output.new_token_ids)
    assert tokens == expected.token_ids
    assert decode.stats().num_free_blocks == decode.kv.num_blocks and prefill.kv.usage == 0


def test_a_started_reservation_takes_no_more_pages(make_engine, tokenizer):
    prompt = tokenizer.encode("Once the KV is complete the request decodes")
    decode = make_engine(role="decode")
    reservation = _reserve(decode, "r", prompt)
    first, pages = prefill_into(make_engine(role="prefill"), "r", prompt, GREEDY)
    import_all(decode, reservation, pages, decode.model_config.num_layers)
    decode.start_decode("r", first)
    with pytest.raises(KeyError, match="no live KV reservation"):
        decode.import_kv(reservation, 0, reservation.blocks_to_fill, *pages.layer(0, len(reservation.blocks_to_fill)))
    decode.abort("r")
    assert decode.stats().num_free_blocks == decode.kv.num_blocks


def test_a_start_after_the_deadline_says_it_timed_out(make_engine, tokenizer):
    decode = make_engine(role="decode")
    _reserve(decode, "r", tokenizer.encode("Too late"), timeout_s=0.0)
    assert decode.next_kv_deadline() is not None
    decode.step()
    with pytest.raises(TimeoutError, match="deadline"):
        decode.start_decode("r", 1)
    assert not decode.abort("r") and decode.next_kv_deadline() is None
    assert decode.stats().num_free_blocks == decode.kv.num_blocks


def test_a_hand_off_never_released_is_freed_at_its_keep_deadline(make_engine, tokenizer):
    prefill = make_engine(role="prefill")
    assert prefill.connector.scheduler.policy == KVConnectorPolicy(decodes=False)  # from the role
    prefill.connector.scheduler.policy = KVConnectorPolicy(decodes=False, keep_s=0.0)
    prefill.add_request("lost-peer", tokenizer.encode("Its decode worker is gone"), GREEDY)
    [output] = prefill.step()
    assert output.finish_reason == "handoff" and prefill.stats().num_free_blocks < prefill.kv.num_blocks
    assert prefill.has_unfinished()  # its keep deadline passed: the next step frees its blocks
    assert prefill.step() == []
    assert prefill.stats().num_free_blocks == prefill.kv.num_blocks and not prefill.scheduler.requests
    prefill.release("lost-peer")  # the worker's release, late, finds nothing to free


def test_ending_a_reservation_waits_for_a_write_in_progress():
    connector = KVConnectorScheduler()
    ticket = connector.reserved("r", [3, 4], timeout_s=60.0)
    writing, finish, ended = threading.Event(), threading.Event(), threading.Event()

    def write() -> None:
        with connector.writing("r", ticket, [3]):
            writing.set()
            finish.wait(10)

    writer = threading.Thread(target=write)
    writer.start()
    assert writing.wait(10)
    ender = threading.Thread(target=lambda: (connector.end("r"), ended.set()))
    ender.start()
    assert not ended.wait(0.2)  # the blocks cannot change owner while a page is being written
    finish.set()
    writer.join(10)
    assert ended.wait(10)
    ender.join(10)
    with pytest.raises(KeyError), connector.writing("r", ticket, [3]):
        pass
    ticket = connector.reserved("r", [5], timeout_s=60.0)
    with pytest.raises(ValueError, match="block_ids"), connector.writing("r", ticket, [3]):
        pass
