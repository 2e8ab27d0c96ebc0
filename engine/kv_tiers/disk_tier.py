"""The disk tier: one file per block in a configured directory, bounded in bytes, evicted least
recently used first, surviving restarts. No torch.

Files are written whole under a temporary name and renamed into place, so a reader sees a complete
file or none; a worker killed mid-write leaves only a temporary file, removed at the next start.
Whatever else goes wrong with the disk (full, read-only, a damaged or truncated file) costs a miss
and a count in `DiskTierStats`, never an answer: records are checked on read
(engine.kv_tiers.block_record) and a bad one is deleted.

A load reads a file in ranges, not whole: `open` reads and checks its header and keeps the file
open; the load then reads one layer's slice at a time as it needs it (`DiskRecord.read_into`), in
file order, so each read continues where the previous one ended. A file rewritten in place or
truncated under a load shows as bytes that fail their layer's check or a read that comes up short:
the load's caller counts it corrupt (`reject`). One renamed over it changes nothing for the load,
which reads the file it opened to its end.

One worker owns a directory (an exclusive lock file): two processes sharing one would each count
the other's files against its own bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.kv_tiers.block_record import RecordHeader, RecordLayout, open_header

log = logging.getLogger(__name__)

_SUFFIX = ".kvb"
_TEMPORARY = ".tmp"
_LOCK = ".lock"


@dataclass
class DiskTierStats:
    """What the disk tier did since start-up (counters) and holds now."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # records that failed their check on read (each also a miss)
    write_errors: int = 0  # writes the disk refused (full, read-only, gone)
    bytes_written: int = 0
    bytes_read: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0


class DiskTier:
    """Blocks as files under `directory`, at most `capacity_bytes` of them."""

    def __init__(self, directory: str | Path, capacity_bytes: int) -> None:
        """ValueError naming the option when the directory cannot be used at all (not creatable, or
        another process holds it); a directory that becomes unwritable later only counts errors."""
        if capacity_bytes <= 0:
            raise ValueError(f"kv_disk_tier_mib: must be positive, got {capacity_bytes} bytes")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.stats = DiskTierStats()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recent first
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(self.directory / _LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as error:
            raise ValueError(f"kv_disk_tier: cannot use directory {str(self.directory)!r}: {error}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ValueError(f"kv_disk_tier: directory {str(self.directory)!r} is in use by another worker") from None
        self._scan()

    def _scan(self) -> None:
        """Index the blocks a previous run left, oldest access first; drop its half-written files."""
        found = []
        for path in self.directory.iterdir():
            if path.name.endswith(_TEMPORARY):
                path.unlink(missing_ok=True)
            elif path.suffix == _SUFFIX:
                try:
                    block_hash = bytes.fromhex(path.stem)
                    stat = path.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
        self.stats.stored_blocks, self.stats.stored_bytes = len(self._files), sum(self._files.values())
        self._evict()

    def hashes(self) -> list[bytes]:
        """Every block held, least recently used first."""
        return list(self._files)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def leading(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, the tier holds."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._files:
                break
            count += 1
        return count

    def put(self, block_hash: bytes, record: bytes) -> list[bytes]:
        """Store a block's record (engine.kv_tiers.block_record; a no-op if held); the hashes evicted
        to make room."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return []
        path = self._path(block_hash)
        temporary = path.with_name(f"{path.name}.{os.getpid()}{_TEMPORARY}")
        try:
            with open(temporary, "wb") as file:
                file.write(record)
            os.replace(temporary, path)
        except OSError as error:
            self.stats.write_errors += 1
            log.warning("KV disk tier: writing a block to %s failed: %s", self.directory, error)
            temporary.unlink(missing_ok=True)
            return []
        self._files[block_hash] = len(record)
        self.stats.bytes_written += len(record)
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += len(record)
        return self._evict()

    def open(self, block_hash: bytes, layout: RecordLayout) -> DiskRecord | None:
        """A held block's file, open for reading its layers, its header read and checked (a hit; the
        reader checks each layer it reads and calls `reject` for a damaged one); None (a miss) if
        absent, unreadable or not a record of it."""
        if block_hash not in self._files:
            self.stats.misses += 1
            return None
        header, fd = b"", -1
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY)
            header = _read(fd, layout.header_size)
        except OSError as error:
            log.warning("KV disk tier: reading a block from %s failed: %s", self.directory, error)
        self.stats.bytes_read += len(header)
        opened = open_header(block_hash, header, layout)
        if opened is None:
            if fd >= 0:
                os.close(fd)
            self._corrupt(block_hash)
            return None
        self._files.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(self._path(block_hash))  # the next start's scan orders by it
        self.stats.hits += 1
        return DiskRecord(fd, opened, self.stats)

    def reject(self, block_hash: bytes) -> None:
        """A record `open` returned came up short or failed a layer's check: a miss after all, counted
        and dropped."""
        self.stats.hits -= 1
        self._corrupt(block_hash)

    def _corrupt(self, block_hash: bytes) -> None:
        self.stats.corrupt += 1
        self.stats.misses += 1
        log.warning("KV disk tier: block %s in %s failed its check; dropped", block_hash.hex()[:16], self.directory)
        self.drop(block_hash)

    def drop(self, block_hash: bytes) -> None:
        """Forget a block and delete its file."""
        size = self._files.pop(block_hash, None)
        if size is not None:
            self.stats.stored_blocks -= 1
            self.stats.stored_bytes -= size
        self._path(block_hash).unlink(missing_ok=True)

    def _evict(self) -> list[bytes]:
        evicted = []
        while self.stats.stored_bytes > self.capacity_bytes and self._files:
            block_hash = next(iter(self._files))
            self.drop(block_hash)
            evicted.append(block_hash)
        return evicted

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{_SUFFIX}"

    def close(self) -> None:
        """Release the directory for another process."""
        os.close(self._lock)


class DiskRecord:
    """One block's file open for a load: its checked header, and its layers' bytes read in order."""

    def __init__(self, fd: int, header: RecordHeader, stats: DiskTierStats) -> None:
        self.header = header
        self._fd = fd
        self._stats = stats

    def read_into(self, view: memoryview) -> bool:
        """Fill `view` with the file's next bytes; False if it ends first or cannot be read (the
        bytes read so far still count as read)."""
        done = 0
        try:
            while done < len(view):
                count = os.readv(self._fd, [view[done:]])
                if count == 0:
                    break
                done += count
        except OSError as error:
            log.warning("KV disk tier: reading a block's layer failed: %s", error)
        self._stats.bytes_read += done
        return done == len(view)

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def _read(fd: int, size: int) -> bytes:
    """Up to `size` bytes from `fd` (fewer only at its end)."""
    parts = []
    while size > 0:
        part = os.read(fd, size)
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return b"".join(parts)
