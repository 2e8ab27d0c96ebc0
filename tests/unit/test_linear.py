"""engine.model.linear: each CPU weight format's plan (engine.model.product_plan.plan_dense) has its
kernels serve the input sizes they win, over the same weight values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from environment import needs

from engine.config import EngineConfig
from engine.model import linear as linear_module
from engine.model.linear import Linear
from engine.model.product_plan import FP16_MAX_ROWS, FP16_MAX_ROWS_THREADED, PACKED_MAX_ROWS, plan_dense


def _packs(cpu_weights: str) -> bool:
    """Whether this torch has the kernel that the format packs fp32 weights for."""
    return plan_dense(torch.empty(1, 1), cpu_weights).bands[0].kernel != "linear"  # type: ignore[arg-type]


def _recording_plain_linear(monkeypatch) -> list[int]:
    calls: list[int] = []
    plain = F.linear

    def recording(x, *args, **kwargs):
        calls.append(x.shape[0])
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(linear_module.F, "linear", recording)
    return calls


def _weight_and_bias() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(96, 64) * 0.1, torch.randn(96)


@needs(_packs("fp32"), "torch built with oneDNN")
@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS, 300])
def test_fp32_packed_weight_serves_small_inputs_and_gemm_the_large(monkeypatch, rows):
    # The packed oneDNN product measured 7-8% slower than F.linear from 64 rows up, so prefill
    # chunks must not take it; decode batches must (1.4-2x faster there).
    plain_calls = _recording_plain_linear(monkeypatch)
    weight, bias = _weight_and_bias()
    exact = weight.clone()
    product = Linear(weight, plan_dense(weight, "fp32"), bias)
    assert [band.kernel for band in product.plan.bands] == ["onednn_fp32", "linear"]
    assert torch.equal(weight, exact), "fp32 keeps the weights exact"
    x = torch.randn(rows, 64)
    torch.testing.assert_close(product(x), x @ exact.T + bias, atol=1e-4, rtol=1e-4)
    assert plain_calls == ([] if rows < PACKED_MAX_ROWS else [rows])


@needs(_packs("fp16"), "torch built with fbgemm")
@pytest.mark.parametrize("rows", [1, 8, FP16_MAX_ROWS - 1, FP16_MAX_ROWS])
def test_fp16_weights_are_rounded_once_and_every_path_computes_with_them(monkeypatch, rows):
    # The fp16 product reads half the bytes (decode steps 1.3-1.8x faster); F.linear takes the
    # inputs where it is faster, over the same rounded values, so a prefill and the decode steps
    # after it see one model.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    plain_calls = _recording_plain_linear(monkeypatch)
    weight, bias = _weight_and_bias()
    rounded = weight.half().float()
    assert not torch.equal(rounded, weight)
    product = Linear(weight, plan_dense(weight, "fp16"), bias)
    assert [band.kernel for band in product.plan.bands] == ["fbgemm_fp16", "linear"]
    assert torch.equal(weight, rounded), "the parameter itself holds the fp16 values"
    x = torch.randn(rows, 64)
    torch.testing.assert_close(product(x), x @ rounded.T + bias, atol=1e-4, rtol=1e-4)
    assert plain_calls == ([] if rows < FP16_MAX_ROWS else [rows])


@needs(_packs("fp16"), "torch built with fbgemm")
def test_fp16_product_takes_only_small_inputs_when_torch_runs_several_threads(monkeypatch):
    # fbgemm's fp16 product runs on one thread: with two, oneDNN's fp32 product overtakes it
    # between 16 and 32 rows, so larger inputs go to F.linear's threaded GEMM.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    plain_calls = _recording_plain_linear(monkeypatch)
    weight, bias = _weight_and_bias()
    product = Linear(weight, plan_dense(weight, "fp16"), bias)  # planned with torch's threads at load
    product(torch.randn(FP16_MAX_ROWS_THREADED - 1, 64))
    product(torch.randn(FP16_MAX_ROWS_THREADED, 64))
    assert plain_calls == [FP16_MAX_ROWS_THREADED]


def test_plain_format_and_non_fp32_weights_keep_one_copy(monkeypatch):
    plain_calls = _recording_plain_linear(monkeypatch)
    weight, bias = _weight_and_bias()
    exact = weight.clone()
    plain = Linear(weight, plan_dense(weight, "plain"), bias)
    assert [band.kernel for band in plain.plan.bands] == ["linear"]
    assert torch.equal(weight, exact)
    half = weight.bfloat16()
    assert plan_dense(half, "fp16") == plan_dense(half, "fp32") == plan_dense(half, "plain")
    Linear(half, plan_dense(half, "fp16"))(torch.randn(2, 64).bfloat16())
    assert plain_calls == [2]


def test_engine_config_rejects_an_unknown_weight_format():
    with pytest.raises(ValueError, match="cpu_weights"):
        EngineConfig(cpu_weights="int4")  # type: ignore[arg-type]
