"""engine.model.product_plan: each format's plan (row band -> kernel -> operand), resolved once at load,
the table the engine logs, and the one place the row thresholds live."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from engine.model.product_plan import (
    BF16_MIN_ROWS,
    DENSE_MIN_ROWS,
    DPBF16_MAX_ROWS,
    FP16_MAX_ROWS,
    FP16_MIN_ROWS,
    INT8_MIN_ROWS,
    Band,
    ProductPlan,
    plan_quantized,
    plan_table,
)
from engine.model.quantized import QuantizedWeight

MODEL_PACKAGE = Path(__file__).resolve().parents[2] / "engine" / "model"


def _weight(cols: int = 64) -> QuantizedWeight:
    return QuantizedWeight(q=torch.zeros(16, cols, dtype=torch.uint8), scale=torch.ones(16, cols // 32),
                           offset=torch.zeros(16, cols // 32), bits=4, group_size=32)


def _bands(plan: ProductPlan) -> list[tuple[int, str]]:
    return [(band.first, band.kernel) for band in plan.bands]


@pytest.mark.parametrize(("dtype", "options", "bands"), [
    (torch.float32, {}, [(1, "qmatmul"), (DENSE_MIN_ROWS, "linear_dequantized")]),
    (torch.float32, {"fp16_copy": True},
     [(1, "qmatmul"), (FP16_MIN_ROWS, "fp16_pieces"), (FP16_MAX_ROWS, "linear_dequantized")]),
    (torch.bfloat16, {"onednn_bf16": True}, [(1, "qmatmul"), (BF16_MIN_ROWS, "onednn_bf16")]),
    (torch.bfloat16, {"onednn_bf16": False}, [(1, "qmatmul"), (BF16_MIN_ROWS, "linear")]),
    (torch.bfloat16, {"bf16_instruction": "vdpbf16ps", "onednn_bf16": True},
     [(1, "qmatmul"), (BF16_MIN_ROWS, "bf16_gemm_vdpbf16ps"), (DPBF16_MAX_ROWS + 1, "onednn_bf16")]),
    (torch.bfloat16, {"bf16_instruction": "fma"}, [(1, "qmatmul"), (BF16_MIN_ROWS, "bf16_gemm_fma")]),
    (torch.bfloat16, {"int8_parts": 2}, [(1, "qmatmul"), (INT8_MIN_ROWS, "int8_gemm")]),
    (torch.float16, {"fp16_copy": True}, [(1, "qmatmul"), (DENSE_MIN_ROWS, "linear_dequantized")]),
])
def test_each_format_plans_its_bands(dtype, options, bands):
    assert _bands(plan_quantized(_weight(), dtype, **options)) == bands


def test_int8_activations_are_planned_only_where_the_weights_groups_are_whole_blocks_of_32():
    def per_row(cols: int) -> QuantizedWeight:
        return QuantizedWeight(q=torch.zeros(16, cols, dtype=torch.int8), scale=torch.ones(16, 1), offset=None,
                               bits=8, group_size=cols)

    assert plan_quantized(per_row(96), torch.bfloat16, int8_parts=2).int8_parts == 2
    ragged = plan_quantized(per_row(48), torch.bfloat16, int8_parts=2)
    assert "int8_gemm" not in ragged.kernels() and ragged.int8_parts == 0


def test_a_band_is_looked_up_by_rows_and_bands_must_ascend_from_one_row():
    plan = plan_quantized(_weight(), torch.float32, fp16_copy=True)
    assert plan.band(0).kernel == plan.band(FP16_MIN_ROWS - 1).kernel == "qmatmul"
    assert plan.band(FP16_MIN_ROWS).kernel == plan.band(FP16_MAX_ROWS - 1).kernel == "fp16_pieces"
    assert plan.band(10**9).kernel == "linear_dequantized"
    with pytest.raises(ValueError, match="ascend"):
        ProductPlan((Band(1, "qmatmul", "x"), Band(1, "linear", "y")))
    with pytest.raises(ValueError, match="ascend"):
        ProductPlan((Band(4, "qmatmul", "x"),))


def test_the_table_names_each_layer_kind_its_rows_kernel_and_operand():
    plan = plan_quantized(_weight(), torch.bfloat16, onednn_bf16=True)
    table = plan_table([("qkv", plan), ("qkv", plan), ("lm_head", plan)], stacked_rows=BF16_MIN_ROWS - 1)
    lines = [line.split() for line in table.splitlines()]
    assert lines[0][:2] == ["layer", "kind"]
    assert lines[1][:4] == ["qkv", "2", f"1-{BF16_MIN_ROWS - 1}", "qmatmul"]
    assert lines[2] == ["qkv", "2", f"{BF16_MIN_ROWS}+", "onednn_bf16", "bf16", "copy,", "oneDNN-packed"]
    assert lines[3][:2] == ["lm_head", "1"]
    assert "decode_stack" in lines[-1]


def test_the_engine_logs_the_plan_at_load(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        make_engine(quantization="gguf")
    logged = "\n".join(record.getMessage() for record in caplog.records if record.name == "engine.model.loader")
    assert "product plan" in logged and "qmatmul" in logged
    for kind in ("qkv", "o", "gate_up", "down", "lm_head"):
        assert re.search(rf"^{kind}\s", logged, re.MULTILINE), kind


def test_the_row_thresholds_live_in_the_plan_module_only():
    threshold = re.compile(r"^[A-Z0-9_]*(MIN|MAX)_ROWS[A-Z0-9_]*\s*=", re.MULTILINE)
    elsewhere = [path.relative_to(MODEL_PACKAGE).as_posix() for path in MODEL_PACKAGE.rglob("*.py")
                 if path.name != "product_plan.py" and threshold.search(path.read_text())]
    assert elsewhere == []
