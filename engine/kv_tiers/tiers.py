"""A worker's KV tiers below its memory, together: the node's host tier (engine.kv_tiers.host_tier_client)
and its own disk tier (engine.kv_tiers.disk_tier), both keyed by the chain hashes the prefix cache,
the wire and the gateway's index use. No torch: pages arrive and leave as bytes
(engine.kv_connector.tier_mover turns them into blocks).

A block computed on this worker is written to both tiers; one loaded back comes from the host tier
if it has it (memory), else from disk. A load reads in ranges (`load`, engine.kv_tiers.tier_load):
every block's header first (one LOAD round trip to the host tier for all of them, a small read per
file on disk), then one layer of every block at a time as the mover asks for it, so the mover writes
layer 0 after reading a layer's worth of bytes, not the whole records. Lookups run on the engine
thread (one socket round trip for a whole prompt); stores and loads on the mover's thread. What
each tier stores and drops is reported to `events` (the engine's block events, which the gateway's
exact index follows).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.config import KVTierConfig
from engine.kv_tiers.block_record import RecordLayout, open_header, pack_record
from engine.kv_tiers.disk_tier import DiskTier
from engine.kv_tiers.host_tier_client import HostTierClient, RecordStream
from engine.kv_tiers.tier_load import Damaged, LowerTier, TierLoad

log = logging.getLogger(__name__)


class TierEvents(Protocol):
    """Where the tiers report what they hold and how fast they load (the engine's block events)."""

    def stored(self, tier: LowerTier, block_hashes: Sequence[bytes]) -> None: ...

    def removed(self, tier: LowerTier, block_hashes: Sequence[bytes]) -> None: ...

    def record_load(self, tier: LowerTier, blocks: int, seconds: float) -> None: ...


@dataclass(frozen=True)
class TierStats:
    """Counters since start-up and what a tier holds now (Prometheus reads them)."""

    hits: int
    misses: int
    corrupt: int
    errors: int
    bytes_written: int
    bytes_read: int
    stored_blocks: int
    stored_bytes: int
    capacity_bytes: int
    loaded_blocks: int
    load_seconds: float


class KVTiers:
    """The configured lower tiers of one worker, for blocks in `layout`."""

    def __init__(self, config: KVTierConfig, layout: RecordLayout, events: TierEvents) -> None:
        self.layout = layout
        self._events = events
        self._disk = None if config.disk_dir is None else DiskTier(config.disk_dir, config.disk_bytes)
        # Two connections: the engine thread's lookups never wait behind the mover's transfers.
        self._lookups = self._moves = None
        if config.host_socket is not None:
            self._lookups, self._moves = HostTierClient(config.host_socket), HostTierClient(config.host_socket)
        self._host_tier_id = b""
        self._host_held: set[bytes] = set()  # what this worker stored in the host tier and was not evicted
        self._host = {"hits": 0, "misses": 0, "corrupt": 0, "bytes_written": 0, "bytes_read": 0}
        self._loads: dict[LowerTier, tuple[int, float]] = {"host": (0, 0.0), "disk": (0, 0.0)}
        if self._disk is not None:
            events.stored("disk", self._disk.hashes())  # a restarted worker's disk still holds its blocks
        if self._lookups is not None:
            self._lookups.hello()  # the tier id, for the first load report
            self._follow_owner(self._lookups)

    @property
    def host_tier_id(self) -> str:
        """The host tier's id (hex) as last seen, "" without one or before reaching it."""
        return self._host_tier_id.hex()

    # ---- the engine thread ----------------------------------------------------------------------
    def available(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, some lower tier holds."""
        held = self._lookups.has(block_hashes) if self._lookups is not None else [False] * len(block_hashes)
        self._follow_owner(self._lookups)
        count = 0
        for block_hash, in_host in zip(block_hashes, held, strict=True):
            if not (in_host or (self._disk is not None and block_hash in self._disk)):
                break
            count += 1
        return count

    def holds(self, block_hash: bytes) -> bool:
        """Whether every tier already has the block (as far as this worker knows): no copy needed."""
        in_host = self._moves is None or block_hash in self._host_held
        return in_host and (self._disk is None or block_hash in self._disk)

    # ---- the mover's thread ---------------------------------------------------------------------
    def store(self, block_hash: bytes, payload: bytes) -> None:
        """Write a block to every tier that lacks it."""
        if self.holds(block_hash):
            return
        record = pack_record(block_hash, payload, self.layout)  # checksummed once for both tiers
        if self._moves is not None and block_hash not in self._host_held:
            evicted = self._moves.put(block_hash, record)
            self._follow_owner(self._moves)
            if evicted is not None:
                self._host["bytes_written"] += len(record)
                self._host_held.add(block_hash)
                self._host_held.difference_update(evicted)
                self._events.stored("host", [block_hash])
                if evicted:
                    self._events.removed("host", evicted)
        if self._disk is not None and block_hash not in self._disk:
            evicted = self._disk.put(block_hash, record)
            if block_hash in self._disk:  # not when the disk refused the write
                self._events.stored("disk", [block_hash])
            if evicted:
                self._events.removed("disk", evicted)

    @contextlib.contextmanager
    def load(self, block_hashes: Sequence[bytes]) -> Iterator[TierLoad | None]:
        """The blocks' records opened for reading layer by layer, each from the host tier if it has a
        record of it, else from disk, its header checked; None if some block has none (gone since the
        lookup, or damaged). On leaving, a record that failed is counted corrupt and dropped from its
        tier, so no load finds it again."""
        stream = None
        if self._moves is not None:
            stream = self._moves.load(block_hashes, self.layout)
            self._follow_owner(self._moves)
        load, damaged_host = TierLoad(self.layout, stream), []
        try:
            opened = all(self._open(load, stream, position, block_hash, damaged_host)
                         for position, block_hash in enumerate(block_hashes))
            yield load if opened else None
        finally:
            load.close()  # first: the drops below then reuse its connection instead of opening another
            if stream is not None:
                self._host["bytes_read"] += stream.bytes_read
            for block_hash in damaged_host:
                self._drop_host(block_hash)
            if load.damaged is not None:
                self._reject(load.damaged)

    def _open(self, load: TierLoad, stream: RecordStream | None, position: int, block_hash: bytes,
              damaged_host: list[bytes]) -> bool:
        """Add a block to `load` from the first tier with a record of it; False if none has one."""
        if self._moves is not None:
            header = None if stream is None else stream.headers[position]
            opened = None if header is None else open_header(block_hash, header, self.layout)
            if opened is not None:
                self._host["hits"] += 1
                load.add(block_hash, "host", opened)
                return True
            self._host["misses"] += 1
            if stream is not None and stream.held[position]:  # of another layout, or not this block's
                self._host["corrupt"] += 1
                damaged_host.append(block_hash)
        if self._disk is not None:
            held = block_hash in self._disk
            record = self._disk.open(block_hash, self.layout)
            if record is not None:
                load.add(block_hash, "disk", record.header, record)
                return True
            if held:  # it failed its check and was dropped
                self._events.removed("disk", [block_hash])
        return False

    def _reject(self, damaged: Damaged) -> None:
        """A block's layer came up short or failed its check: a miss after all, counted corrupt and
        dropped from its tier."""
        log.warning("KV tiers: block %s from the %s tier failed layer %d's check; dropped",
                    damaged.block_hash.hex()[:16], damaged.tier, damaged.layer)
        if damaged.tier == "host":
            self._host["hits"] -= 1
            self._host["misses"] += 1
            self._host["corrupt"] += 1
            self._drop_host(damaged.block_hash)
        elif self._disk is not None:
            self._disk.reject(damaged.block_hash)
            self._events.removed("disk", [damaged.block_hash])

    def _drop_host(self, block_hash: bytes) -> None:
        if self._moves is not None:
            self._moves.drop(block_hash)
        if block_hash in self._host_held:
            self._host_held.discard(block_hash)
            self._events.removed("host", [block_hash])

    def record_load(self, tier: LowerTier, blocks: int, seconds: float) -> None:
        """A measured load-back, for the router's estimate of a lower tier's cost."""
        total_blocks, total_seconds = self._loads[tier]
        self._loads[tier] = (total_blocks + blocks, total_seconds + seconds)
        self._events.record_load(tier, blocks, seconds)

    def _follow_owner(self, client: HostTierClient | None) -> None:
        """Forget what a previous host tier owner held once a new one answers (it restarted empty)."""
        if client is None or not client.tier_id or client.tier_id == self._host_tier_id:
            return
        if self._host_held:
            self._events.removed("host", sorted(self._host_held))
            self._host_held.clear()
        self._host_tier_id = client.tier_id

    # ---- metrics ----------------------------------------------------------------------------------
    def stats(self) -> dict[LowerTier, TierStats]:
        """Each configured tier's counters and contents."""
        out: dict[LowerTier, TierStats] = {}
        if self._lookups is not None and self._moves is not None:
            host = self._host
            out["host"] = TierStats(host["hits"], host["misses"], host["corrupt"],
                                    self._lookups.errors + self._moves.errors, host["bytes_written"],
                                    host["bytes_read"], len(self._host_held), 0, 0, *self._loads["host"])
        if self._disk is not None:
            disk = self._disk.stats
            out["disk"] = TierStats(disk.hits, disk.misses, disk.corrupt, disk.write_errors, disk.bytes_written,
                                    disk.bytes_read, disk.stored_blocks, disk.stored_bytes, self._disk.capacity_bytes,
                                    *self._loads["disk"])
        return out

    def close(self) -> None:
        """Close the host tier connections and release the disk tier's directory."""
        for client in (self._lookups, self._moves):
            if client is not None:
                client.close()
        if self._disk is not None:
            self._disk.close()
