"""KVTransfer.Push fuzzed against a real gRPC receiver (kvtransfer_harness.GrpcServer, in this process):
a live transfer's pieces arrive with bad offsets, out of order, of wrong sizes, with wrong totals,
layers and blocks, for another transfer, without or with a wrong CRC32C, or end early. Every push
ends with OK or a refusal (INVALID_ARGUMENT, NOT_FOUND, ABORTED, DATA_LOSS, FAILED_PRECONDITION),
never UNKNOWN or INTERNAL; the transfer it failed is failed on the receiver too, one it completed
holds every page it was sent; and the receiver then takes a whole transfer bit for bit.

Each mutation alone is pinned to its exact status below; hypothesis combines them (tests/fuzzing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import google_crc32c
import grpc
import pytest
import torch
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransfer_harness import FakeCache, Receivers, layout_of, pages
from tandem.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

from kvtransfer import TransferError, TransferTarget

NUM_BLOCKS = 2
TIMEOUT_S = 120.0  # generous: the calls below take milliseconds, but CI machines may be busy
LAYOUT = layout_of("float32")
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
            grpc.StatusCode.DATA_LOSS, grpc.StatusCode.FAILED_PRECONDITION}
Chunks = list[kvtransfer_pb2.KVChunk]


@pytest.fixture(scope="module")
def receivers() -> Iterator[Receivers]:
    made = Receivers("grpc")
    try:
        yield made
    finally:
        made.close()


def _piece(target: TransferTarget, layer: int, kv: int, data: bytes, offset: int, total: int) -> kvtransfer_pb2.KVChunk:
    return kvtransfer_pb2.KVChunk(transfer_id=target.transfer_id, layer=layer, first_block=0, num_blocks=NUM_BLOCKS,
                                  kv=kv, offset=offset, total_bytes=total, data=data,
                                  crc32c=google_crc32c.value(data))


def _whole(target: TransferTarget, seed: int, piece_bytes: int) -> Chunks:
    """Every chunk of a whole transfer, in order: each layer's K then V, in pieces of `piece_bytes`."""
    chunks = []
    for layer in range(LAYOUT.num_layers):
        for kv, tensor in enumerate(pages(LAYOUT, NUM_BLOCKS, seed, layer)):
            raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            chunks += [_piece(target, layer, kv, raw[at:at + piece_bytes], at, len(raw))
                       for at in range(0, len(raw), piece_bytes)]
    return [*chunks, kvtransfer_pb2.KVChunk(transfer_id=target.transfer_id, last=True, crc32c=google_crc32c.value(b""))]


def _push(target: TransferTarget, chunks: Chunks) -> tuple[grpc.StatusCode, int]:
    with grpc.insecure_channel(target.address) as channel:
        try:
            response = kvtransfer_pb2_grpc.KVTransferStub(channel).Push(iter(chunks), timeout=TIMEOUT_S)
            return grpc.StatusCode.OK, response.bytes_received
        except grpc.RpcError as error:
            return error.code(), 0


def _with(chunk: kvtransfer_pb2.KVChunk, **fields) -> kvtransfer_pb2.KVChunk:
    changed = kvtransfer_pb2.KVChunk()
    changed.CopyFrom(chunk)
    for name, value in fields.items():
        setattr(changed, name, value)
    if "data" in fields:
        changed.crc32c = google_crc32c.value(changed.data)
    return changed


# A mutation of a whole transfer's chunks at index i (taken modulo the pieces with data).
Mutation = Callable[[Chunks, int], Chunks]
MUTATIONS: dict[str, tuple[Mutation, grpc.StatusCode]] = {
    "offset moved": (lambda c, i: [*c[:i], _with(c[i], offset=c[i].offset + 1), *c[i + 1:]],
                     grpc.StatusCode.INVALID_ARGUMENT),
    "offset huge": (lambda c, i: [*c[:i], _with(c[i], offset=2**63), *c[i + 1:]], grpc.StatusCode.INVALID_ARGUMENT),
    "pieces swapped": (lambda c, i: [*c[:i], c[i + 1], c[i], *c[i + 2:]], grpc.StatusCode.INVALID_ARGUMENT),
    "piece too long": (lambda c, i: [*c[:i], _with(c[i], data=c[i].data + b"\0" * 4096), *c[i + 1:]],
                       grpc.StatusCode.INVALID_ARGUMENT),
    "total_bytes wrong": (lambda c, i: [*c[:i], _with(c[i], total_bytes=c[i].total_bytes + 1), *c[i + 1:]],
                          grpc.StatusCode.INVALID_ARGUMENT),
    "num_blocks beyond the target": (lambda c, i: [*c[:i], _with(c[i], num_blocks=NUM_BLOCKS + 1), *c[i + 1:]],
                                     grpc.StatusCode.INVALID_ARGUMENT),
    "piece missing": (lambda c, i: [*c[:i], *c[i + 1:]], grpc.StatusCode.INVALID_ARGUMENT),
    "another transfer's piece": (lambda c, i: [*c[:i], _with(c[i], transfer_id=c[i].transfer_id + 10**6), *c[i + 1:]],
                                 grpc.StatusCode.INVALID_ARGUMENT),
    "CRC32C wrong": (lambda c, i: [*c[:i], _with(c[i], crc32c=c[i].crc32c ^ 1), *c[i + 1:]], grpc.StatusCode.DATA_LOSS),
    "CRC32C missing": (lambda c, i: [*c[:i], _without_crc(c[i]), *c[i + 1:]], grpc.StatusCode.FAILED_PRECONDITION),
    # Whole pages that fit no block fail the transfer when written: its next chunk finds it failed.
    "layer beyond the layout": (lambda c, i: _relabel_layer(c, i, LAYOUT.num_layers), grpc.StatusCode.ABORTED),
    "first_block beyond the target": (lambda c, i: _reblock(c, i, 2**31), grpc.StatusCode.ABORTED),
    "ends before its last chunk": (lambda c, i: c[:i], grpc.StatusCode.ABORTED),
    "last too early": (lambda c, i: [*c[:i], c[-1]], grpc.StatusCode.DATA_LOSS),
}


def _without_crc(chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
    changed = _with(chunk)
    changed.ClearField("crc32c")
    return changed


def _relabel_layer(chunks: Chunks, i: int, layer: int) -> Chunks:
    """Every piece of chunk i's layer (K and V) says `layer` instead: whole pages that fit no layer."""
    old = chunks[i].layer
    return [_with(c, layer=layer) if c.data and c.layer == old else c for c in chunks]


def _reblock(chunks: Chunks, i: int, first_block: int) -> Chunks:
    """Every piece of chunk i's layer says `first_block`: whole pages beyond the target's blocks."""
    old = chunks[i].layer
    return [_with(c, first_block=first_block) if c.data and c.layer == old else c for c in chunks]


def _transfer(receivers: Receivers) -> tuple[TransferTarget, FakeCache]:
    cache = FakeCache(LAYOUT)
    return receivers.expect(cache, LAYOUT, num_blocks=NUM_BLOCKS, receiver=receivers.get(timeout=TIMEOUT_S)), cache


def _settled(receivers: Receivers, target: TransferTarget, code: grpc.StatusCode, received: int) -> None:
    """The receiver's verdict agrees with the push's: completed with its bytes, or failed."""
    completion = receivers.get(timeout=TIMEOUT_S).completion(target.transfer_id)
    if code == grpc.StatusCode.OK:
        assert completion.result(TIMEOUT_S) == received
        return
    assert code in REFUSALS, code
    with pytest.raises(TransferError):
        completion.result(TIMEOUT_S)


def _next_arrives_whole(receivers: Receivers, seed: int) -> None:
    target, cache = _transfer(receivers)
    code, received = _push(target, _whole(target, seed, piece_bytes=5000))
    assert code == grpc.StatusCode.OK
    _settled(receivers, target, code, received)
    cache.assert_holds(target, seed)


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_bad_push_is_refused_with_its_status(receivers, name):
    mutate, status = MUTATIONS[name]
    target, _ = _transfer(receivers)
    chunks = _whole(target, seed=1, piece_bytes=5000)
    code, received = _push(target, mutate(chunks, 1))  # a piece of layer 0's K, not its first
    assert code == status, (name, code)
    _settled(receivers, target, code, received)
    _next_arrives_whole(receivers, seed=2)


def test_an_unknown_transfer_is_not_found(receivers):
    target, _ = _transfer(receivers)
    chunks = _whole(target, seed=1, piece_bytes=5000)
    code, _ = _push(target, [_with(c, transfer_id=target.transfer_id + 10**6) for c in chunks])
    assert code == grpc.StatusCode.NOT_FOUND
    receivers.get(timeout=TIMEOUT_S).cancel(target.transfer_id)


@settings(max_examples=examples(40))
@given(piece_bytes=st.integers(1000, 24576), mutations=st.lists(
    st.tuples(st.sampled_from(sorted(MUTATIONS)), st.integers(0, 10**6)), max_size=3))
def test_pushes_fuzzed(receivers, piece_bytes, mutations):
    target, cache = _transfer(receivers)
    chunks = _whole(target, seed=3, piece_bytes=piece_bytes)
    for name, at in mutations:
        if len(chunks) > 2:
            chunks = MUTATIONS[name][0](chunks, at % (len(chunks) - 2))
    code, received = _push(target, chunks)
    _settled(receivers, target, code, received)
    if code == grpc.StatusCode.OK:  # only pages sent whole: what was sent landed
        cache.assert_holds(target, seed=3)
    _next_arrives_whole(receivers, seed=4)
