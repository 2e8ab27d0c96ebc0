"""The lower KV tiers without a model: block records, the disk tier, the host tier's owner and
client, and the two together, loading layer by layer (engine.kv_tiers). Real files, real Unix
sockets, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from engine.config import KVTierConfig
from engine.kv_cache.block_hash import hash_block
from engine.kv_tiers.block_record import RecordLayout, open_header, pack_record
from engine.kv_tiers.disk_tier import DiskTier
from engine.kv_tiers.host_tier_client import HostTierClient
from engine.kv_tiers.host_tier_wire import PUT, U64
from engine.kv_tiers.tier_load import TierLoad
from engine.kv_tiers.tiers import KVTiers

PAYLOAD = 100_000  # ten blocks fill the owners' 1 MiB
LAYOUT = RecordLayout(PAYLOAD, 4)
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def block(index: int) -> tuple[bytes, bytes]:
    """A block's chain hash and a payload that differs per block."""
    return hash_block(None, [index]), bytes((index + i) % 256 for i in range(PAYLOAD))


def checked_layers(block_hash: bytes, packed: bytes, layout: RecordLayout = LAYOUT) -> list[bytes | None] | None:
    """Each layer's pages of a record (None where a layer fails its check), None if its header does not
    name `block_hash` in `layout`."""
    header = open_header(block_hash, packed[:layout.header_size], layout)
    if header is None:
        return None
    size, start = layout.layer_size, layout.header_size
    slices = [np.frombuffer(packed[start + i * size:start + (i + 1) * size], np.uint8) for i in range(layout.layers)]
    return [s.tobytes() if len(s) == size and header.check(i, s) else None for i, s in enumerate(slices)]


def read(tier: DiskTier, block_hash: bytes, layout: RecordLayout = LAYOUT) -> bytes | None:
    """A block's pages from the disk tier, read and checked layer by layer as a load does (a layer that
    comes up short or fails its check rejected)."""
    opened = tier.open(block_hash, layout)
    if opened is None:
        return None
    layers = []
    for index in range(layout.layers):
        pages = np.empty(layout.layer_size, np.uint8)
        if not (opened.read_into(memoryview(pages)) and opened.header.check(index, pages)):
            opened.close()
            tier.reject(block_hash)
            return None
        layers.append(pages.tobytes())
    opened.close()
    return b"".join(layers)


def fetched(client: HostTierClient, block_hash: bytes) -> bytes | None:
    """A record as the host tier's owner streams it for a load (its header, then layer by layer), None
    if it has none of LAYOUT's size."""
    stream = client.load([block_hash], LAYOUT)
    assert stream is not None
    if stream.headers[0] is None:
        stream.close()
        return None
    parts = [stream.headers[0]]
    for _ in range(LAYOUT.layers):
        view = memoryview(bytearray(LAYOUT.layer_size))
        assert stream.read_into(view)
        parts.append(bytes(view))
    stream.close()
    return b"".join(parts)


def loaded(load: TierLoad | None, layout: RecordLayout = LAYOUT) -> list[bytes] | None:
    """Each block's pages, read layer by layer from a load; None if it did not open or a layer failed."""
    if load is None:
        return None
    layers = [load.layer(i) for i in range(layout.layers)]
    if any(layer is None for layer in layers):
        return None
    return [b"".join(layer[row].tobytes() for layer in layers) for row in range(len(load.tiers))]


def record(index: int) -> tuple[bytes, bytes]:
    """A block's chain hash and its record."""
    block_hash, payload = block(index)
    return block_hash, pack_record(block_hash, payload, LAYOUT)


class Events:
    """The tiers' reports, as the engine's block events receive them."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {"host": set(), "disk": set()}
        self.loads: list[tuple[str, int]] = []

    def stored(self, tier, hashes) -> None:
        self.held[tier].update(hashes)

    def removed(self, tier, hashes) -> None:
        self.held[tier].difference_update(hashes)

    def record_load(self, tier, blocks, seconds) -> None:
        self.loads.append((tier, blocks))


@pytest.fixture
def owner(tmp_path):
    """A host tier owner process (`tandem kv-host-tier`, 1 MiB) on a socket under tmp_path; `restart()`
    kills it and starts another."""
    path = tmp_path / "host.sock"

    class Owner:
        def __init__(self) -> None:
            self.process: subprocess.Popen | None = None
            self.start()

        def start(self) -> None:
            self.process = subprocess.Popen([sys.executable, "-m", "services.cli", "kv-host-tier", "--socket",
                                             str(path), "--capacity-mib", "1"], env=_ENV)
            deadline = time.monotonic() + 60
            while not _answers(path):
                assert time.monotonic() < deadline and self.process.poll() is None, "the owner did not start"
                time.sleep(0.05)

        def stop(self) -> None:
            self.process.kill()
            self.process.wait()

        def restart(self) -> None:
            self.stop()
            self.start()

    running = Owner()
    yield running
    running.stop()


def _answers(path: Path) -> bool:
    client = HostTierClient(str(path))
    client.has([bytes(32)])
    client.close()
    return client.errors == 0


def test_block_record_checks_hash_length_and_each_layers_bytes() -> None:
    block_hash, payload = block(1)
    packed = pack_record(block_hash, payload, LAYOUT)
    size = PAYLOAD // 4
    assert checked_layers(block_hash, packed) == [payload[i * size:(i + 1) * size] for i in range(4)]
    other_hash, _ = block(2)
    flipped = bytearray(packed)
    flipped[-1] ^= 1
    assert checked_layers(other_hash, packed) is None  # filed under another block's name
    assert open_header(block_hash, packed[:LAYOUT.header_size - 1], LAYOUT) is None  # truncated in the header
    assert checked_layers(block_hash, packed, RecordLayout(PAYLOAD + 4, 4)) is None  # another block size
    assert checked_layers(block_hash, packed, RecordLayout(PAYLOAD, 2)) is None  # another layer count
    assert checked_layers(block_hash, b"TKV1" + packed[4:]) is None  # the older format
    # The header is intact: only the damaged layer fails, and a truncated payload only its last layer.
    assert checked_layers(block_hash, bytes(flipped)) == [payload[:size], payload[size:2 * size],
                                                          payload[2 * size:3 * size], None]
    assert checked_layers(block_hash, packed[:-1])[3] is None


def test_disk_tier_bounds_its_bytes_least_recently_used_first(tmp_path) -> None:
    tier = DiskTier(tmp_path, 3 * LAYOUT.record_size)
    hashes = [block(i)[0] for i in range(4)]
    for i in range(3):
        assert tier.put(*record(i)) == []
    tier.open(hashes[0], LAYOUT).close()  # block 0 is now the most recent
    assert tier.put(*record(3)) == [hashes[1]]
    assert tier.hashes() == [hashes[2], hashes[0], hashes[3]]
    assert tier.leading([hashes[2], hashes[0], hashes[1], hashes[3]]) == 2
    assert sorted(p.name for p in tmp_path.glob("*.kvb")) == sorted(f"{h.hex()}.kvb" for h in tier.hashes())


def test_disk_tier_survives_a_restart_and_drops_half_written_files(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    for i in range(3):
        tier.put(*record(i))
    tier.close()
    (tmp_path / "leftover.kvb.123.tmp").write_bytes(b"half")
    again = DiskTier(tmp_path, 1 << 20)
    assert set(again.hashes()) == {block(i)[0] for i in range(3)}
    assert not list(tmp_path.glob("*.tmp"))
    block_hash, payload = block(1)
    assert read(again, block_hash) == payload


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "swap", "older format"])
def test_a_damaged_block_file_is_a_counted_miss_and_is_dropped(tmp_path, damage) -> None:
    tier = DiskTier(tmp_path, 1 << 20)
    (block_hash, _), (other_hash, other_payload) = block(1), block(2)
    tier.put(*record(1))
    tier.put(*record(2))
    path = tmp_path / f"{block_hash.hex()}.kvb"
    data = path.read_bytes()
    if damage == "flip":
        path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "older format":  # a TKV1 file a previous version left (blake2b, no layer table)
        path.write_bytes(b"TKV1" + data[4:])
    else:  # another block's record under this block's name
        shutil.copy(tmp_path / f"{other_hash.hex()}.kvb", path)
    assert read(tier, block_hash) is None
    assert (tier.stats.corrupt, tier.stats.misses) == (1, 1)
    assert block_hash not in tier and not path.exists()
    assert read(tier, other_hash) == other_payload


def test_a_directory_gone_while_serving_counts_write_errors_and_misses(tmp_path) -> None:
    directory = tmp_path / "tier"
    tier = DiskTier(directory, 1 << 20)
    tier.put(*record(1))
    shutil.rmtree(directory)
    assert tier.put(*record(2)) == []
    assert tier.stats.write_errors == 1 and block(2)[0] not in tier
    assert read(tier, block(1)[0]) is None and tier.stats.misses == 1


def test_a_directory_that_cannot_be_used_is_a_start_up_error(tmp_path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_disk_tier: cannot use directory"):
        DiskTier(a_file / "tier", 1 << 20)
    DiskTier(tmp_path / "tier", 1 << 20)
    with pytest.raises(ValueError, match="in use by another worker"):
        DiskTier(tmp_path / "tier", 1 << 20)


_WRITER = textwrap.dedent("""
    import resource, signal, sys
    from engine.kv_cache.block_hash import hash_block
    from engine.kv_tiers.block_record import RecordLayout, pack_record
    from engine.kv_tiers.disk_tier import DiskTier
    directory, mode = sys.argv[1], sys.argv[2]
    tier = DiskTier(directory, 1 << 30)
    if mode == "full":
        # A file size limit makes the kernel refuse the writes (EFBIG), as a full disk does (ENOSPC).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    for i in range(1_000_000):
        block_hash = hash_block(None, [i])
        tier.put(block_hash, pack_record(block_hash, bytes(300_000), RecordLayout(300_000, 3)))
        if i == 2:
            print(tier.stats.write_errors, len(tier.hashes()), flush=True)
            if mode == "full":
                break
""")


def _writer(directory: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), mode], stdout=subprocess.PIPE, text=True,
                            env=_ENV)


def test_a_full_disk_counts_write_errors_and_stores_nothing(tmp_path) -> None:
    writer = _writer(tmp_path, "full")
    assert writer.communicate(timeout=120)[0].split() == ["3", "0"]
    assert writer.returncode == 0
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.kvb"))


def test_a_worker_killed_mid_write_leaves_only_intact_blocks(tmp_path) -> None:
    writer = _writer(tmp_path, "kill")
    assert writer.stdout.readline().split() == ["0", "3"]
    time.sleep(0.3)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    tier = DiskTier(tmp_path, 1 << 30)
    assert not list(tmp_path.glob("*.tmp"))
    assert len(tier.hashes()) >= 3
    for block_hash in tier.hashes():
        assert read(tier, block_hash, RecordLayout(300_000, 3)) is not None
    assert tier.stats.corrupt == 0


def test_host_tier_owner_stores_evicts_and_serves_many_clients(owner, tmp_path) -> None:
    first, second = HostTierClient(str(tmp_path / "host.sock")), HostTierClient(str(tmp_path / "host.sock"))
    records = dict(record(i) for i in range(11))
    hashes = list(records)
    for block_hash in hashes[:10]:
        assert first.put(block_hash, records[block_hash]) == []
    assert second.has(hashes) == [True] * 10 + [False]
    assert fetched(second, hashes[3]) == records[hashes[3]]
    assert first.put(hashes[10], records[hashes[10]]) == [hashes[0]]  # the least recently used goes
    assert fetched(first, hashes[0]) is None
    assert first.tier_id == second.tier_id != b""


def test_a_client_that_dies_mid_put_stores_nothing(owner, tmp_path) -> None:
    block_hash, packed = record(1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dying:
        dying.connect(str(tmp_path / "host.sock"))
        dying.sendall(bytes([PUT]) + block_hash + U64.pack(len(packed)) + packed[: len(packed) // 2])
    client = HostTierClient(str(tmp_path / "host.sock"))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and client.has([block_hash]) != [False]:
        time.sleep(0.01)
    assert client.has([block_hash]) == [False]
    assert client.put(block_hash, packed) == [] and fetched(client, block_hash) == packed


def test_kv_tiers_fill_both_tiers_and_load_from_memory_first(owner, tmp_path) -> None:
    events = Events()
    config = KVTierConfig(host_socket=str(tmp_path / "host.sock"), disk_dir=str(tmp_path / "disk"))
    tiers = KVTiers(config, LAYOUT, events)
    hashes = [block(i)[0] for i in range(3)]
    for i in range(2):
        tiers.store(*block(i))
    assert tiers.available(hashes) == 2
    assert events.held == {"host": set(hashes[:2]), "disk": set(hashes[:2])}
    with tiers.load(hashes[:2]) as load:
        assert load.tiers == ["host", "host"] and loaded(load) == [block(0)[1], block(1)[1]]
    with tiers.load(hashes) as load:
        assert load is None
    assert tiers.host_tier_id != ""
    tiers.close()


def test_a_damaged_layer_of_a_host_tier_record_drops_it_from_the_owner(owner, tmp_path) -> None:
    events = Events()
    tiers = KVTiers(KVTierConfig(host_socket=str(tmp_path / "host.sock")), LAYOUT, events)
    tiers.store(*block(1))
    block_hash, packed = record(2)
    damaged = bytearray(packed)
    damaged[-1] ^= 1
    client = HostTierClient(str(tmp_path / "host.sock"))
    client.put(block_hash, bytes(damaged))  # another worker's bad write, say
    with tiers.load([block_hash]) as load:
        assert load.tiers == ["host"]
        assert [load.layer(i) is not None for i in range(4)] == [True, True, True, False]
    assert client.has([block_hash, block(1)[0]]) == [False, True]  # gone for every worker of the node
    stats = tiers.stats()["host"]
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 1, 1)
    client.close()
    tiers.close()


def test_a_restarted_owner_is_a_new_empty_tier_and_the_disk_still_answers(owner, tmp_path) -> None:
    events = Events()
    config = KVTierConfig(host_socket=str(tmp_path / "host.sock"), disk_dir=str(tmp_path / "disk"))
    tiers = KVTiers(config, LAYOUT, events)
    tiers.store(*block(1))
    old_id = tiers.host_tier_id
    owner.restart()
    block_hash, payload = block(1)
    with tiers.load([block_hash]) as load:  # the old connection is found closed and remade at once
        assert load.tiers == ["disk"] and loaded(load) == [payload]
    assert tiers.available([block_hash]) == 1
    assert tiers.host_tier_id not in ("", old_id)
    assert events.held["host"] == set()  # what the old owner held was reported gone
    tiers.close()


def test_an_absent_owner_is_a_miss_and_a_count(tmp_path) -> None:
    tiers = KVTiers(KVTierConfig(host_socket=str(tmp_path / "nobody.sock")), LAYOUT, Events())
    tiers.store(*block(1))
    assert tiers.available([block(1)[0]]) == 0
    with tiers.load([block(1)[0]]) as load:
        assert load is None
    assert tiers.stats()["host"].errors >= 1
    tiers.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_disk_load_reads_each_layer_when_asked_and_finds_it_damaged_then(tmp_path, damage) -> None:
    events = Events()
    tiers = KVTiers(KVTierConfig(disk_dir=str(tmp_path / "disk")), LAYOUT, events)
    hashes = [block(i)[0] for i in range(2)]
    for i in range(2):
        tiers.store(*block(i))
    disk = tiers.stats()["disk"]
    path = tmp_path / "disk" / f"{hashes[1].hex()}.kvb"
    with tiers.load(hashes) as load:
        assert tiers.stats()["disk"].bytes_read == disk.bytes_read + 2 * LAYOUT.header_size  # the headers only
        first = load.layer(0)
        assert tiers.stats()["disk"].bytes_read == disk.bytes_read + 2 * (LAYOUT.header_size + LAYOUT.layer_size)
        assert [first[i].tobytes() for i in range(2)] == [block(i)[1][:LAYOUT.layer_size] for i in range(2)]
        # Block 1's file changes in place after its layer 0 was read: its later layers are read now.
        data = path.read_bytes()
        if damage == "flip":
            path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])  # a byte of layer 3
            assert [load.layer(i) is None for i in (1, 2, 3)] == [False, False, True]
        else:
            path.write_bytes(data[:LAYOUT.header_size + 2 * LAYOUT.layer_size + 10])  # cut inside layer 2
            assert [load.layer(i) is None for i in (1, 2)] == [False, True]
    stats = tiers.stats()["disk"]
    assert (stats.hits - disk.hits, stats.misses - disk.misses, stats.corrupt) == (1, 1, 1)
    assert hashes[1] not in events.held["disk"] and not path.exists()
    with tiers.load(hashes[:1]) as load:
        assert loaded(load) == [block(0)[1]]
    tiers.close()


def test_a_host_tier_record_dropped_and_evicted_mid_load_never_mixes_pages(owner, tmp_path) -> None:
    tiers = KVTiers(KVTierConfig(host_socket=str(tmp_path / "host.sock")), LAYOUT, Events())
    block_hash, payload = block(1)
    tiers.store(block_hash, payload)
    other = HostTierClient(str(tmp_path / "host.sock"))
    with tiers.load([block_hash]) as load:
        layers = [load.layer(0)[0].tobytes()]
        # Mid-load, another worker has it dropped, then stores other pages under its name, then the
        # owner evicts everything for newer blocks.
        other.drop(block_hash)
        assert other.has([block_hash]) == [False]
        other.put(block_hash, pack_record(block_hash, block(2)[1], LAYOUT))
        for i in range(3, 14):
            other.put(*record(i))
        assert other.has([block_hash]) == [False]
        layers += [load.layer(i)[0].tobytes() for i in range(1, 4)]
    assert b"".join(layers) == payload  # the record as it was when the load began, whole
    stats = tiers.stats()["host"]
    assert (stats.hits, stats.misses, stats.corrupt) == (1, 0, 0)
    assert stats.bytes_read == U64.size + LAYOUT.record_size
    other.close()
    tiers.close()


def test_a_load_mixes_host_and_disk_blocks_and_counts_what_each_read(owner, tmp_path) -> None:
    events = Events()
    config = KVTierConfig(host_socket=str(tmp_path / "host.sock"), disk_dir=str(tmp_path / "disk"))
    tiers = KVTiers(config, LAYOUT, events)
    hashes, payloads = zip(*(block(i) for i in range(3)), strict=True)
    for i in range(3):
        tiers.store(hashes[i], payloads[i])
    other = HostTierClient(str(tmp_path / "host.sock"))
    other.drop(hashes[1])  # evicted from the node's memory: block 1 comes from disk
    other.drop(hashes[2])
    other.put(hashes[2], record(3)[1])  # block 3's record under block 2's name: block 2 comes from disk
    with tiers.load(hashes) as load:
        assert load.tiers == ["host", "disk", "disk"] and loaded(load) == list(payloads)
    host, disk = tiers.stats()["host"], tiers.stats()["disk"]
    assert (host.hits, host.misses, host.corrupt, disk.hits, disk.corrupt) == (1, 2, 1, 2, 0)
    # The host tier streamed blocks 0 and 2 (read past, its header failing); the disk held 1 and 2.
    assert host.bytes_read == 3 * U64.size + 2 * LAYOUT.record_size
    assert disk.bytes_read == 2 * LAYOUT.record_size
    assert other.has(list(hashes)) == [True, False, False]  # the misfiled record was dropped
    with tiers.load(hashes[:1]) as load:
        load.layer(0)  # abandoned mid-stream: its connection is closed, not left mid-answer
    with tiers.load(hashes[:1]) as load:
        assert load.tiers == ["host"] and loaded(load) == [payloads[0]]
    assert tiers.stats()["host"].errors == 0
    other.close()
    tiers.close()
