"""The goodput suite's multiturn workload, its pure parts: the send order (a conversation's turns in
order, a fixed gap apart, every stretch holding each turn alike give or take one), the working set,
the chat history, and the KV memory each server says it holds."""

from __future__ import annotations

import itertools

import pytest

from bench.common.conversations import history
from bench.common.multiturn import conversations_for, send_order, working_set
from bench.goodput.kv_memory import kv_held


def test_a_conversations_turns_go_in_order_a_fixed_number_of_requests_apart():
    order = send_order(conversations=24, turns=4, slots=8)
    assert len(order) == len(set(order))
    positions: dict[int, list[tuple[int, int]]] = {}
    for index, (conversation, turn) in enumerate(order):
        positions.setdefault(conversation, []).append((turn, index))
    for sent in positions.values():
        turns = [turn for turn, _ in sent]
        assert turns == list(range(turns[0], turns[0] + len(turns)))  # consecutive, none skipped in between
        assert all(b - a == 8 for (_, a), (_, b) in itertools.pairwise(sent))
        # Only a slot's first conversation joins after turn 0 (its earlier turns served before the stream).
    assert {c for c, sent in positions.items() if sent[0][0] > 0} == {1, 2, 3, 5, 6, 7}
    assert all(positions[c][0][0] == c % 4 for c in range(8))


def test_every_stretch_of_slots_requests_holds_each_turn_alike_give_or_take_one():
    order = send_order(conversations=24, turns=4, slots=8)
    for start in range(0, len(order) - 8 + 1):
        counts = [sum(1 for _, turn in order[start:start + 8] if turn == t) for t in range(4)]
        assert counts == [2, 2, 2, 2] if start % 8 == 0 else sorted(counts) in ([2, 2, 2, 2], [1, 2, 2, 3])


def test_the_stream_has_the_requests_asked_for_with_the_fewest_conversations():
    for count in (1, 50, 64, 65, 562):
        conversations = conversations_for(count, turns=4, slots=64)
        assert conversations % 64 == 0
        assert len(send_order(conversations, 4, 64)) >= count
        if conversations > 64:
            assert len(send_order(conversations - 64, 4, 64)) < count


def test_send_order_refuses_a_shape_it_cannot_run():
    with pytest.raises(ValueError, match="multiple of slots"):
        send_order(conversations=10, turns=4, slots=8)
    with pytest.raises(ValueError, match="positive"):
        send_order(conversations=8, turns=0, slots=8)


def test_the_working_set_is_the_least_sum_of_slots_consecutive_requests():
    assert working_set([5, 1, 1, 9, 2], slots=2) == 2
    assert working_set([5, 1, 1, 9, 2], slots=5) == 18
    with pytest.raises(ValueError, match="at least 3"):
        working_set([1, 2], slots=3)


def test_a_turns_history_alternates_user_and_assistant_up_to_the_new_user_message():
    assert history(["a", "b"], ["x"]) == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
                                          {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="one more user message"):
        history(["a"], ["x"])


def test_the_kv_tokens_held_come_from_each_servers_start_up_line():
    lines = ["[worker 1] engine ready: SmolLM2, KV connector: local, tp=1, 120 KV blocks of 16 tokens, "
             "kv_cache=bfloat16, attention=torch",
             "INFO 12-07 [kv_cache_utils.py:2328] CPU KV cache size: 5,632 tokens, Maximum concurrency ...",
             "unrelated"]
    assert kv_held(lines) == {"tokens": 1920 + 5632, "engines": [{"tokens": 1920, "format": "bfloat16"},
                                                                  {"tokens": 5632, "format": "vllm"}]}
    assert kv_held(["no such line"]) == {}
