"""Whether workers hold anything after their requests ended: the check every fault, cancellation
and overload test ends with.

A worker is idle when it runs, waits for and reserves no request and holds no KV block beyond its
prefix cache (`used_kv_blocks` does not count unreferenced cached blocks)."""

from __future__ import annotations

import time

import grpc
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from harness.worker import WorkerProcess
from services.common.server import channel_options

IDLE_DEADLINE_S = 60.0  # generous: aborts and lease expiries land within seconds


def load_report(worker: WorkerProcess, credentials: grpc.ChannelCredentials | None = None) -> common_pb2.LoadReport:
    """The worker's LoadReport now (GetLoad over a fresh channel: TLS with `credentials`, else plaintext)."""
    stub_class = prefill_pb2_grpc.PrefillStub if worker.args[0] == "prefill" else decode_pb2_grpc.DecodeStub
    address = str(worker.address)
    channel = (grpc.insecure_channel(address, options=channel_options()) if credentials is None
               else grpc.secure_channel(address, credentials, options=channel_options()))
    with channel:
        return stub_class(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=30)


def is_idle(report: common_pb2.LoadReport) -> bool:
    """No request running, waiting or reserved, and no block held by one."""
    return not (report.used_kv_blocks or report.running_requests or report.waiting_requests
                or report.reserved_requests)


def wait_until_idle(workers: list[WorkerProcess], timeout: float = IDLE_DEADLINE_S,
                    credentials: grpc.ChannelCredentials | None = None) -> list[common_pb2.LoadReport]:
    """Poll until every worker is idle or `timeout` passes; the last reports either way."""
    deadline = time.monotonic() + timeout
    while True:
        reports = [load_report(worker, credentials) for worker in workers]
        if all(is_idle(report) for report in reports) or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


def assert_no_leaks(workers: list[WorkerProcess], timeout: float = IDLE_DEADLINE_S,
                    credentials: grpc.ChannelCredentials | None = None) -> None:
    """Fail, naming each worker's holdings, unless every worker becomes idle within `timeout`
    (asked over TLS with `credentials`, a client certificate for workers that want one)."""
    reports = wait_until_idle(workers, timeout, credentials)
    held = {
        str(worker.address): (f"used_kv_blocks={r.used_kv_blocks} running={r.running_requests} "
                              f"waiting={r.waiting_requests} reserved={r.reserved_requests}")
        for worker, r in zip(workers, reports, strict=True) if not is_idle(r)
    }
    assert not held, f"workers still hold requests or blocks: {held}"
