"""KVEvents: the event log with its sequence numbers, a stream's cursor, snapshots for streams that
start or fall behind, the per-tier sets, the load times; and the device pool reporting through it."""

from __future__ import annotations

import threading

import pytest

from engine.kv_cache.block_hash import prompt_block_hashes
from engine.kv_cache.kv_events import BlockEvent, KVEvents
from engine.kv_cache.manager import KVCacheManager

H = [bytes([i]) * 32 for i in range(8)]


def _held(batch_events: tuple[BlockEvent, ...]) -> dict[str, set[bytes]]:
    """What a receiver knows after applying these events to nothing."""
    held: dict[str, set[bytes]] = {}
    for event in batch_events:
        tier = held.setdefault(event.tier, set())
        (tier.update if event.stored else tier.difference_update)(event.block_hashes)
    return held


def test_a_starting_stream_gets_a_snapshot_then_only_what_follows() -> None:
    events = KVEvents()
    events.stored("device", H[:3])
    events.removed("device", [H[1]])
    events.stored("host", [H[1]])
    first = events.read(None)
    assert first.reset
    assert _held(first.events) == {"device": {H[0], H[2]}, "host": {H[1]}}
    assert events.read(first.cursor).events == ()  # nothing new
    events.stored("disk", [H[4]])
    events.removed("host", [H[1]])
    second = events.read(first.cursor)
    assert not second.reset
    assert [(e.tier, e.stored, e.block_hashes) for e in second.events] == [
        ("disk", True, (H[4],)), ("host", False, (H[1],))]
    assert [e.seq for e in second.events] == [3, 4] and second.cursor == 5 == events.next_seq


def test_two_streams_read_from_their_own_cursors() -> None:
    events = KVEvents()
    a = events.read(None).cursor
    events.stored("device", [H[0]])
    b = events.read(None).cursor  # started later: its snapshot holds H0 already
    events.stored("device", [H[1]])
    assert [e.block_hashes for e in events.read(a).events] == [(H[0],), (H[1],)]
    assert [e.block_hashes for e in events.read(b).events] == [(H[1],)]


def test_a_stream_that_fell_out_of_the_bounded_log_gets_a_snapshot() -> None:
    events = KVEvents(max_events=2)
    cursor = events.read(None).cursor
    for block in H[:3]:
        events.stored("device", [block])
    behind = events.read(cursor)
    assert behind.reset and _held(behind.events) == {"device": set(H[:3])}
    assert not events.read(behind.cursor).reset
    assert events.read(10**6).reset  # a cursor from another KVEvents (a restarted engine)


def test_held_sets_follow_the_events_and_empty_reports_are_not_logged() -> None:
    events = KVEvents()
    events.stored("host", H[:2])
    events.stored("host", [])
    events.removed("host", [H[0], H[5]])  # a block never stored is dropped without complaint
    assert events.held("host") == {H[1]}
    assert events.next_seq == 2
    with pytest.raises(ValueError, match="tier"):
        events.stored("gpu", [H[0]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_events"):
        KVEvents(max_events=0)


def test_load_seconds_per_block_are_a_recent_mean_per_measured_tier() -> None:
    events = KVEvents()
    assert events.load_s_per_block() == {}
    events.record_load("host", 4, 0.002)
    events.record_load("host", 6, 0.008)
    events.record_load("disk", 2, 0.010)
    assert events.load_s_per_block() == pytest.approx({"host": 0.001, "disk": 0.005})
    for _ in range(100):  # older samples age out
        events.record_load("host", 1, 0.0005)
    assert events.load_s_per_block()["host"] == pytest.approx(0.0005)
    with pytest.raises(ValueError, match="record_load"):
        events.record_load("disk", 0, 1.0)


def test_tiers_report_from_their_own_threads() -> None:
    events = KVEvents()
    blocks = [[bytes([t, i]) * 16 for i in range(200)] for t in range(4)]

    def report(hashes: list[bytes]) -> None:
        for block in hashes:
            events.stored("host", [block])

    threads = [threading.Thread(target=report, args=(hashes,)) for hashes in blocks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert events.next_seq == 800 and events.held("host") == {b for hashes in blocks for b in hashes}


def test_the_device_pool_reports_blocks_it_names_and_reclaims() -> None:
    events = KVEvents()
    kv = KVCacheManager(num_blocks=4, block_size=4, salt=b"model", events=events)
    prompt = list(range(12))
    assert kv.allocate_slots("a", 12)
    kv.cache_blocks("a", prompt, 12)
    hashes = prompt_block_hashes(prompt, 4, b"model")
    assert events.held("device") == set(hashes)
    kv.free("a")  # evictable, still cached: nothing removed
    assert events.held("device") == set(hashes)
    assert kv.allocate_slots("b", 16)  # the one free block, then the three cached ones reclaimed
    assert events.held("device") == set()
    removed = [e for e in events.read(0).events if not e.stored]
    assert {h for e in removed for h in e.block_hashes} == set(hashes)
    kv.check_invariants()


def test_a_duplicate_block_is_not_reported_twice() -> None:
    events = KVEvents()
    kv = KVCacheManager(num_blocks=4, block_size=4, events=events)
    for request in ("a", "b"):  # computed twice at once: the first copy keeps the hash
        assert kv.allocate_slots(request, 4)
        kv.cache_blocks(request, [1, 2, 3, 4], 4)
    assert events.next_seq == 1
