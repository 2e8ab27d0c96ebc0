"""What /v1/models says of the formats: learnt from the workers' load reports."""

from __future__ import annotations

from tandem.v1 import common_pb2

from services.gateway.formats import served_formats


def _report(dtype: str) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(dtype=dtype, quantization="none", cpu_weights="plain", kv_cache_dtype=dtype,
                                 activation_quantization="none")


def test_workers_that_agree_give_one_value_per_format():
    assert served_formats([_report("bfloat16"), _report("bfloat16")]) == {
        "dtype": "bfloat16", "quantization": "none", "cpu_weights": "plain", "kv_cache_dtype": "bfloat16",
        "activation_quantization": "none"}


def test_workers_that_differ_give_each_value_once_and_unreported_formats_are_none():
    mixed = served_formats([_report("float32"), _report("bfloat16"), _report("float32"), common_pb2.LoadReport()])
    assert (mixed["dtype"], mixed["quantization"]) == ("bfloat16,float32", "none")
    assert served_formats([common_pb2.LoadReport(role="decode")]) == dict.fromkeys(mixed)
    assert served_formats([]) == dict.fromkeys(mixed)
