"""A decode request's Timings are worked out from its progress record: the time each stage began,
the prefill worker's figures and the outputs' times (hand-set times, so every figure is exact)."""

from __future__ import annotations

import pytest

from services.common.chunk import Timings
from services.decode.progress import DecodeProgress, DecodeStage, PrefillFigures


def test_a_disaggregated_request_is_timed_stage_by_stage():
    progress = DecodeProgress(arrived_at=10.0)
    for stage, at in ((DecodeStage.RESERVED, 10.5), (DecodeStage.PREFILLING, 10.75),
                      (DecodeStage.TRANSFERRING, 12.0), (DecodeStage.JOINING, 12.25), (DecodeStage.DECODING, 13.0)):
        progress.enter(stage, at)
    progress.prefill = PrefillFigures(queue_s=0.25, compute_s=1.0, delivery_wait_s=0.125)
    for at in (13.0, 13.5, 14.0, 15.0):
        progress.streamed(at)
    assert progress.timings(num_output_tokens=5) == Timings(
        ttft_s=3.0, tpot_s=0.5, prefill_queue_s=0.25, prefill_compute_s=1.0, kv_wait_s=0.25, e2e_s=5.0,
        kv_delivery_wait_s=0.125, reserve_s=0.5, batch_join_s=0.75)


def test_a_local_prefill_computes_until_its_first_token_and_has_no_transfer_stages():
    progress = DecodeProgress(arrived_at=1.0)
    progress.enter(DecodeStage.DECODING, 2.0)
    progress.streamed(2.0)
    progress.streamed(3.0)
    assert progress.timings(num_output_tokens=3) == Timings(
        ttft_s=1.0, tpot_s=0.5, prefill_compute_s=1.0, e2e_s=2.0)


@pytest.mark.parametrize(("stage", "holds"), [
    (DecodeStage.RESERVING, False), (DecodeStage.RESERVED, True), (DecodeStage.PREFILLING, True),
    (DecodeStage.TRANSFERRING, True), (DecodeStage.JOINING, True), (DecodeStage.DECODING, False),
    (DecodeStage.DONE, False),
])
def test_a_reservation_is_held_from_the_blocks_reserved_until_the_batch_join(stage, holds):
    assert stage.holds_reservation is holds
