"""BlockIndex: each worker's blocks by tier from its events, the prompt's run of held blocks by the
fastest tier holding each, resets, forgetting, and host tiers shared by id."""

from __future__ import annotations

from services.gateway.block_index import BlockIndex, TierEvent

H = [bytes([i]) * 32 for i in range(6)]


def test_a_prefix_run_takes_each_block_from_the_fastest_tier_and_ends_at_the_first_gap() -> None:
    index = BlockIndex()
    index.apply("w", "", [TierEvent("disk", True, H[:4]), TierEvent("device", True, [H[0]]),
                          TierEvent("host", True, [H[1], H[2]]), TierEvent("host", False, [H[2]])], reset=True)
    hit = index.prefix("w", H)
    assert hit.blocks == {"device": 1, "host": 1, "disk": 2}
    assert hit.device_blocks == 1 and hit.lower_blocks == {"host": 1, "disk": 2}
    assert index.prefix("w", [H[5], *H[:4]]).blocks == {}  # the first block missing: nothing
    assert index.prefix("other", H).blocks == {}
    assert index.size == 6 and index.counts("w") == {"device": 1, "host": 1, "disk": 4}
    assert index.counts("other") == {}


def test_events_accumulate_a_reset_replaces_and_forget_drops() -> None:
    index = BlockIndex()
    index.apply("w", "", [TierEvent("device", True, H[:2])], reset=True)
    index.apply("w", "", [TierEvent("device", True, [H[2]]), TierEvent("device", False, [H[0]])], reset=False)
    assert index.prefix("w", H[1:]).device_blocks == 2
    index.apply("w", "", [TierEvent("device", True, [H[4]])], reset=True)
    assert index.prefix("w", H[1:]).blocks == {} and index.size == 1
    index.forget("w")
    assert index.size == 0


def test_a_shared_host_tier_lends_its_blocks_to_every_worker_attached_to_it() -> None:
    index = BlockIndex()
    index.apply("a", "node-1", [TierEvent("host", True, H[:2]), TierEvent("disk", True, [H[2]])], reset=True)
    index.apply("b", "node-1", [], reset=True)
    index.apply("c", "", [TierEvent("host", True, [H[3]])], reset=True)
    assert index.prefix("b", H).blocks == {"host": 2}  # a's disk is a's own
    assert index.prefix("c", H).blocks == {}
    assert index.prefix("c", H[3:]).blocks == {"host": 1}  # no shared tier: its own host blocks
    index.forget("a")  # the blocks a reported go with it
    assert index.prefix("b", H).blocks == {}
