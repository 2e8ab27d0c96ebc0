"""The links suite's transfer alone in a compressed KV format: the kv_rig's sender in its own process
(as on another host, through its stdin and stdout) sends pages in the format it was started with,
which a receiver expecting that format takes whole. The sender used to send float32 pages only, and
the suite's gRPC receiver expected float32 pages only."""

from __future__ import annotations

from bench.common import kv_rig
from bench.common.remote_sender import RemoteSender
from kvtransfer.receiver import make_receiver


def test_the_remote_sender_ships_the_rigs_prompt_in_a_compressed_format():
    layout = kv_rig.layout_of("int4")
    assert kv_rig.total_bytes(layout) == kv_rig.TOTAL_BYTES * 3 // 16  # 48 bytes a row against fp32's 256
    sender = RemoteSender([], "int4")
    grpc_receiver, stop = kv_rig.serve_grpc(layout)
    dist_receiver = make_receiver("torch_dist", "127.0.0.1", "", timeout=60.0, checksum=True)
    try:
        for receiver in (grpc_receiver, dist_receiver):
            # Each run checks that the sender's count, the receiver's and the layout's bytes agree.
            run = kv_rig.BackendRun(sender, receiver, layout)  # type: ignore[arg-type]
            assert run.once() > 0
    finally:
        dist_receiver.close()
        grpc_receiver.close()
        stop()
        assert sender.close() == 0
