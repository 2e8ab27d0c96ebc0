"""What a KV transfer is: the page layout both sides must share, and where the pages go."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol

import torch
from tandem.v1 import kvtransfer_pb2

from engine.kv_cache.codec import KV_FORMATS

Backend = Literal["torch_dist", "grpc"]

# (layer, destination block ids, k, v): writes received pages into the receiver's cache. k and v
# are [len(block ids), *layout.block_shape] of layout.torch_dtype (a quantized layout's pages are
# uint8 rows of codes and their scales, engine.kv_cache.codec).
WriteBlocks = Callable[[int, Sequence[int], torch.Tensor, torch.Tensor], None]

_DIST_BACKENDS = ("gloo", "nccl")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


class _ModelShape(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class _BlockTables(Protocol):
    @property
    def block_size(self) -> int: ...


class _PageFormat(Protocol):
    @property
    def name(self) -> str: ...


class PagedEngine(Protocol):
    """What `KVLayout.of_engine` reads of an engine (engine.engine.Engine is one): its model's
    shape, the fingerprint of its weights and dtype, its KV format, its KV cache's block size and
    the KV heads each of its tensor-parallel ranks holds."""

    @property
    def model_config(self) -> _ModelShape: ...
    @property
    def fingerprint(self) -> bytes: ...
    @property
    def kv_format(self) -> _PageFormat: ...
    @property
    def kv(self) -> _BlockTables: ...
    @property
    def kv_head_ranges(self) -> Sequence[range]: ...


class TransferError(Exception):
    """A transfer failed: corruption, timeout, peer gone, cancellation or layout mismatch."""


class LayoutTransferError(TransferError):
    """A sender and a receiver hold different KV layouts, found when they pair (before any page
    travels); `reason` names every differing field (KVLayout.mismatch)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"KV layout mismatch with {address}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What a KV page means; two workers exchange pages only when every field is equal. `dtype` is
    the KV format (engine.kv_cache.codec): the model's dtype for an "auto" cache, else fp8_e4m3 or
    int8, so peers whose caches differ are refused naming it."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    # The worker's tensor-parallel size and each rank's KV heads [start, end) (() for one rank
    # holding all). They may differ between peers: pages travel with all the heads (engine.parallel.kv_heads).
    tensor_parallel_size: int = 1
    kv_head_ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in KV_FORMATS:
            raise ValueError(f"dtype: unknown KV dtype {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be at least 1, got {self.tensor_parallel_size}")
        if not self.kv_head_ranges:
            object.__setattr__(self, "kv_head_ranges", ((0, self.num_kv_heads),) * self.tensor_parallel_size)
        if len(self.kv_head_ranges) != self.tensor_parallel_size:
            raise ValueError(f"kv_head_ranges: {len(self.kv_head_ranges)} ranges for "
                             f"{self.tensor_parallel_size} ranks")
        # ValueError from a quantized format for a head_dim its scales cannot follow.
        KV_FORMATS[self.dtype].page_shape(self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def of_engine(cls, engine: PagedEngine) -> KVLayout:
        """The layout of an engine's paged KV cache."""
        config = engine.model_config
        ranges = engine.kv_head_ranges
        return cls(
            model=f"{config.name}:{engine.fingerprint.hex()[:16]}",
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=engine.kv_format.name,
            block_size=engine.kv.block_size,
            tensor_parallel_size=len(ranges),
            kv_head_ranges=tuple((heads.start, heads.stop) for heads in ranges),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a page's elements (uint8 for a quantized format)."""
        return KV_FORMATS[self.dtype].storage_dtype

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V): [block_size, num_kv_heads, head_dim], or
        head_dim + 4 bytes per row for a quantized format (codes, then the row's scale)."""
        return KV_FORMATS[self.dtype].page_shape(self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V), scales included."""
        return KV_FORMATS[self.dtype].page_bytes(self.block_size, self.num_kv_heads, self.head_dim)

    def mismatch(self, other: KVLayout) -> str | None:
        """None if pages of one layout can go to the other, else why not, naming every field: one
        of the pages' fields differs ("block_size: 16 here, 32 there"), or either side's ranks leave
        a KV head out. The tensor-parallel sizes may differ."""
        diffs = [
            f"{name}: {getattr(self, name)} here, {getattr(other, name)} there"
            for name in _PAGE_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]
        for side, layout in (("here", self), ("there", other)) if not diffs else ():
            held = {head for start, end in layout.kv_head_ranges for head in range(start, end)}
            if held != set(range(layout.num_kv_heads)):
                diffs.append(f"kv_head_ranges: the {layout.tensor_parallel_size} ranks {side} hold KV heads "
                             f"{sorted(held)}, not each of the {layout.num_kv_heads}")
        return "; ".join(diffs) or None

    @property
    def page_fingerprint(self) -> str:
        """The fields pages must share, as one string: two complete layouts exchange pages exactly
        when theirs are equal (what a worker reports, for the gateway to pair by)."""
        return "|".join(str(getattr(self, name)) for name in _PAGE_FIELDS)

    def describe(self) -> str:
        """The ranks and the heads each holds, e.g. "TP 3 (KV heads 0:1 | 1:2 | 2:3)"."""
        heads = " | ".join(f"{start}:{end}" for start, end in self.kv_head_ranges)
        return f"TP {self.tensor_parallel_size} (KV heads {heads})"

    def route_to(self, receiver: KVLayout) -> str:
        """How pages of this layout reach `receiver`'s ranks, for the log of a new pairing."""
        return (f"{self.describe()} -> {receiver.describe()}: pages of all {self.num_kv_heads} KV heads, "
                "joined on the sender's rank 0 and split on the receiver's")

    def to_proto(self) -> kvtransfer_pb2.KVLayout:
        """The wire form."""
        msg = kvtransfer_pb2.KVLayout(**{name: getattr(self, name) for name in _PAGE_FIELDS},
                                      tensor_parallel_size=self.tensor_parallel_size)
        msg.kv_head_ranges.extend(kvtransfer_pb2.KVHeadRange(start=start, end=end)
                                  for start, end in self.kv_head_ranges)
        return msg

    @classmethod
    def from_proto(cls, msg: kvtransfer_pb2.KVLayout) -> KVLayout:
        """Read the wire form; ValueError naming the field if it is invalid."""
        return cls(**{name: getattr(msg, name) for name in _PAGE_FIELDS},
                   tensor_parallel_size=msg.tensor_parallel_size or 1,
                   kv_head_ranges=tuple((r.start, r.end) for r in msg.kv_head_ranges))


# The fields that say what a page on the wire holds: equal on both sides of a transfer.
_PAGE_FIELDS = tuple(f.name for f in fields(KVLayout) if f.name not in ("tensor_parallel_size", "kv_head_ranges"))


@dataclass(frozen=True)
class TransferTarget:
    """Where and how a prefill worker must push one request's pages (chosen by the receiver).

    `block_ids` are the destination blocks in prompt order; the sender ships its blocks from index
    `num_cached_tokens // block_size` on, and its i-th shipped block lands in `block_ids[i]`.
    torch_dist: `host:port` is the pairing rendezvous and `namespace` names the pair. grpc:
    `host:port` is the receiver's KVTransfer service.
    """

    layout: KVLayout
    transfer_id: int
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    backend: Backend
    host: str
    port: int
    namespace: str = ""
    dist_backend: str = "gloo"

    def __post_init__(self) -> None:
        # A target comes from another process: a malformed one is refused before anything dials it.
        if not valid_host(self.host):
            raise ValueError(f"host: expected a DNS name or an IP address, got {self.host[:64]!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in [1, 65535], got {self.port}")
        if self.backend == "torch_dist" and not self.namespace:
            raise ValueError("namespace: must not be empty")
        if self.dist_backend not in _DIST_BACKENDS:
            raise ValueError(f"dist_backend: must be gloo or nccl, got {self.dist_backend[:64]!r}")

    @property
    def address(self) -> str:
        """`host:port`, with IPv6 hosts in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def to_proto(self) -> kvtransfer_pb2.KVTarget:
        """The wire form."""
        msg = kvtransfer_pb2.KVTarget(
            layout=self.layout.to_proto(),
            block_ids=self.block_ids,
            num_cached_tokens=self.num_cached_tokens,
            transfer_id=self.transfer_id,
        )
        if self.backend == "torch_dist":
            msg.torch_dist.CopyFrom(kvtransfer_pb2.TorchDistTarget(
                host=self.host, port=self.port, namespace=self.namespace, backend=self.dist_backend
            ))
        else:
            msg.grpc.CopyFrom(kvtransfer_pb2.GrpcTarget(address=self.address))
        return msg

    @classmethod
    def from_proto(cls, msg: kvtransfer_pb2.KVTarget) -> TransferTarget:
        """Read the wire form; ValueError naming the field if it is incomplete or malformed."""
        common = {
            "layout": KVLayout.from_proto(msg.layout),
            "transfer_id": msg.transfer_id,
            "block_ids": tuple(msg.block_ids),
            "num_cached_tokens": msg.num_cached_tokens,
        }
        kind = msg.WhichOneof("backend")
        if kind == "torch_dist":
            dist = msg.torch_dist
            return cls(**common, backend="torch_dist", host=dist.host, port=dist.port,
                       namespace=dist.namespace, dist_backend=dist.backend or "gloo")
        if kind == "grpc":
            host, port = split_address(msg.grpc.address, "grpc.address")
            return cls(**common, backend="grpc", host=host, port=port)
        raise ValueError("backend: neither torch_dist nor grpc is set")


def checksum_agreed(receiver: bool, sender: bool) -> bool:
    """Whether a pair's pages carry a CRC32C, from each side's `--kv-checksum`: yes unless both are
    off. A receiver that requires checksums thus always gets them, and neither side can drop them
    alone; the receiver decides (it answers the gRPC Handshake, and refuses unchecked pages)."""
    return receiver or sender


def split_address(address: str, field: str = "address") -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port); ValueError naming `field` if malformed."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not valid_host(host) \
            or (":" in host) != bracketed:
        raise ValueError(f"{field}: expected host:port, got {address[:64]!r}")
    return host, int(port)


def valid_host(host: str) -> bool:
    """Whether `host` is an IP address or a well-formed DNS name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_HOSTNAME.match(host))
    return True


def check_pages(target: TransferTarget, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless k and v are one layer's pages for target.block_ids[first_block:...]."""
    layout = target.layout
    shape = (k.shape[0], *layout.block_shape)
    if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != layout.torch_dtype or v.dtype != k.dtype:
        raise ValueError(f"kv pages: expected two [n, {', '.join(map(str, layout.block_shape))}] {layout.dtype} "
                         f"tensors, got {list(k.shape)} {k.dtype} and {list(v.shape)} {v.dtype}")
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer: {layer} is outside [0, {layout.num_layers})")
    if k.shape[0] < 1 or first_block < 0 or first_block + k.shape[0] > len(target.block_ids):
        raise ValueError(f"first_block: blocks [{first_block}, {first_block + k.shape[0]}) are outside the "
                         f"{len(target.block_ids)} of the target")
