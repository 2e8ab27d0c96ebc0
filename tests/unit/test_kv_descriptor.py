"""KV layouts and transfer targets: field-by-field mismatch reports, wire round trips, page checks."""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch
from tandem.v1 import kvtransfer_pb2

from engine.config import ModelConfig
from engine.kv_cache.codec import INT8, kv_format
from kvtransfer.descriptor import KVLayout, TransferTarget, check_pages

LAYOUT = KVLayout("SmolLM2:0123456789abcdef", 30, 3, 64, "float32", 16)
OTHER = KVLayout("Llama:fedcba9876543210", 32, 8, 128, "bfloat16", 32)
PAGE_FIELDS = [f.name for f in fields(KVLayout)][:6]  # what a page holds; the tensor-parallel fields follow


@pytest.mark.parametrize("name", PAGE_FIELDS)
def test_mismatch_names_the_one_differing_field(name: str) -> None:
    changed = replace(LAYOUT, **{name: getattr(OTHER, name)})
    assert LAYOUT.mismatch(changed) == f"{name}: {getattr(LAYOUT, name)} here, {getattr(OTHER, name)} there"


def test_mismatch_names_every_differing_field() -> None:
    report = LAYOUT.mismatch(OTHER)
    assert report is not None
    assert [part.split(":")[0] for part in report.split("; ")] == PAGE_FIELDS


def test_equal_layouts_match() -> None:
    assert LAYOUT.mismatch(replace(LAYOUT)) is None


def test_layouts_of_different_tensor_parallel_sizes_pair_and_a_rank_split_leaving_a_head_out_is_refused() -> None:
    split = replace(LAYOUT, tensor_parallel_size=3, kv_head_ranges=((0, 1), (1, 2), (2, 3)))
    replicated = replace(LAYOUT, tensor_parallel_size=9, kv_head_ranges=tuple((h, h + 1) for h in (0, 0, 0, 1, 1, 1,
                                                                                                   2, 2, 2)))
    assert LAYOUT.mismatch(split) is None and split.mismatch(replicated) is None
    assert split.describe() == "TP 3 (KV heads 0:1 | 1:2 | 2:3)"
    holey = replace(LAYOUT, tensor_parallel_size=2, kv_head_ranges=((0, 1), (2, 3)))
    assert LAYOUT.mismatch(holey) == "kv_head_ranges: the 2 ranks there hold KV heads [0, 2], not each of the 3"
    with pytest.raises(ValueError, match="kv_head_ranges: 2 ranges for 3 ranks"):
        replace(LAYOUT, tensor_parallel_size=3, kv_head_ranges=((0, 1), (1, 3)))


def test_the_page_fingerprint_is_equal_exactly_when_pages_can_go_either_way() -> None:
    split = replace(LAYOUT, tensor_parallel_size=3, kv_head_ranges=((0, 1), (1, 2), (2, 3)))
    assert split.page_fingerprint == LAYOUT.page_fingerprint
    for name, value in (("dtype", "int8"), ("block_size", 32), ("model", "SmolLM2:fedcba9876543210")):
        other = replace(LAYOUT, **{name: value})
        assert other.page_fingerprint != LAYOUT.page_fingerprint and LAYOUT.mismatch(other) is not None


def test_a_layout_without_tensor_parallel_fields_reads_as_one_rank_holding_every_head() -> None:
    wire = kvtransfer_pb2.KVLayout(model=LAYOUT.model, num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32",
                                   block_size=16)
    assert KVLayout.from_proto(wire) == LAYOUT and LAYOUT.kv_head_ranges == ((0, 3),)


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        replace(LAYOUT, dtype="int2")


@pytest.mark.parametrize("layout", [LAYOUT, replace(LAYOUT, tensor_parallel_size=3, kv_head_ranges=((0, 1), (1, 2),
                                                                                                   (2, 3)))])
def test_layout_round_trips_through_protobuf(layout: KVLayout) -> None:
    wire = layout.to_proto().SerializeToString()
    assert KVLayout.from_proto(kvtransfer_pb2.KVLayout.FromString(wire)) == layout


@pytest.mark.parametrize(("kv_cache_dtype", "dtype"), [("auto", "bfloat16"), ("fp8", "fp8_e4m3"), ("int8", "int8")])
def test_layout_of_engine_names_model_fingerprint_and_kv_format(kv_cache_dtype: str, dtype: str) -> None:
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, name="Tiny")
    engine = SimpleNamespace(model_config=config, fingerprint=bytes(range(32)),
                             kv_format=kv_format(kv_cache_dtype, "bfloat16"), kv=SimpleNamespace(block_size=16),
                             kv_head_ranges=[range(0, 1), range(1, 2)])
    assert KVLayout.of_engine(engine) == KVLayout("Tiny:0001020304050607", 2, 2, 8, dtype, 16, 2, ((0, 1), (1, 2)))


def test_a_quantized_layout_pages_rows_of_codes_and_scales() -> None:
    layout = replace(LAYOUT, dtype="int8")
    assert layout.block_shape == (16, 3, 68) and layout.torch_dtype == torch.uint8
    assert layout.block_bytes == 16 * 3 * 68  # 3,264 bytes against 12,288 in fp32
    assert LAYOUT.mismatch(layout) == "dtype: float32 here, int8 there"
    target = TransferTarget(layout, 1, (4, 5), 0, "grpc", "h", 1)
    pages = INT8.encode(torch.randn(2, 16, 3, 64))
    check_pages(target, 0, 0, pages, pages)
    with pytest.raises(ValueError, match="kv pages"):
        check_pages(target, 0, 0, torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64))
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        replace(layout, head_dim=62)


@pytest.mark.parametrize("target", [
    TransferTarget(LAYOUT, 2**63 - 1, (5, 3, 9), 32, "torch_dist", "10.0.0.7", 40123, "ab" * 16),
    TransferTarget(OTHER, 1, (0,), 0, "torch_dist", "127.0.0.1", 1, "cd" * 16, dist_backend="nccl"),
    TransferTarget(LAYOUT, 7, (), 48, "grpc", "decode-1.local", 50071),
    TransferTarget(LAYOUT, 8, (4, 2), 0, "grpc", "::1", 50072),
])
def test_target_round_trips_through_protobuf(target: TransferTarget) -> None:
    wire = target.to_proto().SerializeToString()
    assert TransferTarget.from_proto(kvtransfer_pb2.KVTarget.FromString(wire)) == target


def test_grpc_target_carries_a_bracketed_ipv6_address() -> None:
    target = TransferTarget(LAYOUT, 8, (4,), 0, "grpc", "::1", 50072)
    assert target.to_proto().grpc.address == "[::1]:50072"


def test_target_without_backend_is_refused() -> None:
    msg = kvtransfer_pb2.KVTarget(layout=LAYOUT.to_proto(), transfer_id=1)
    with pytest.raises(ValueError, match="backend"):
        TransferTarget.from_proto(msg)


def test_pages_must_fit_the_target() -> None:
    target = TransferTarget(LAYOUT, 1, (4, 5, 6), 0, "grpc", "h", 1)
    pages = torch.zeros(2, 16, 3, 64)
    check_pages(target, 29, 1, pages, pages)
    with pytest.raises(ValueError, match="first_block"):
        check_pages(target, 0, 2, pages, pages)
    with pytest.raises(ValueError, match="layer"):
        check_pages(target, 30, 0, pages, pages)
    with pytest.raises(ValueError, match="kv pages"):
        check_pages(target, 0, 0, pages.to(torch.bfloat16), pages.to(torch.bfloat16))
    with pytest.raises(ValueError, match="kv pages"):
        check_pages(target, 0, 0, pages, torch.zeros(2, 16, 3, 32))
