"""KV transfer throughput of each kvtransfer backend against a raw loopback TCP copy of the same bytes.

One prompt's KV for the default model's shape (512 tokens, 30 layers, 3 KV heads, head_dim 64,
blocks of 16, fp32: about 23.6 MB; with --kv-cache-dtype fp8 or int8, the engine's quantized pages:
about 6.3 MB) goes from a sender process to a receiver process, layer by layer as the prefill sends
it, into a cache tensor indexed by block id. A run is timed from the command
that starts the sender to the receiver's completion; pairing and handshakes happen in a warm-up run
first. The raw baseline sends the same K and V bytes, layer by layer, over one TCP socket. Runs of
the three methods alternate.

    python -m bench kv_transfer [--runs 5] [--kv-cache-dtype auto|fp8|fp8_e4m3|int8]

Prints the table and writes bench/results/kv_transfer.json.
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from bench.harness.kv_rig import PROMPT_TOKENS, BackendRun, layout_of, sender_process, serve_grpc, total_bytes
from bench.harness.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.kv_cache.codec import kv_format
from kvtransfer.receiver import make_receiver


class RawRun:
    """Timed copies of the same bytes over a fresh loopback TCP connection each."""

    def __init__(self, conn: Connection, size: int) -> None:
        self._conn = conn
        self._size = size
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._view = memoryview(bytearray(size))
        self.once()

    def once(self) -> float:
        start = time.perf_counter()
        self._conn.send(("raw", self._listener.getsockname()[1]))
        sock, _ = self._listener.accept()
        with sock:
            filled = 0
            while filled < self._size:
                filled += sock.recv_into(self._view[filled:])
        elapsed = time.perf_counter() - start
        assert self._conn.recv() == self._size
        return elapsed

    def close(self) -> None:
        self._listener.close()


def main(argv: Sequence[str]) -> int:
    """Time every method in turn, print their medians, write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--runs", type=int, default=5, help="timed transfers per backend")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "int8"],
                        help="the pages' KV format, as the engine flag names it (auto: an fp32 model's)")
    args = parser.parse_args(argv)
    layout = layout_of(kv_format(args.kv_cache_dtype, "float32").name)
    size = total_bytes(layout)
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=sender_process, args=(child_end, layout), daemon=True)
    child.start()

    dist_receiver = make_receiver("torch_dist", "127.0.0.1", "", timeout=60.0)
    grpc_receiver, stop_grpc = serve_grpc(layout)
    raw = RawRun(conn, size)
    runs = {"raw tcp": raw, "torch_dist": BackendRun(conn, dist_receiver, layout),
            "grpc": BackendRun(conn, grpc_receiver, layout)}
    # Round-robin, so that every method sees the same background load.
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, run in runs.items():
            results[name].append(run.once())
    conn.send(("exit",))
    child.join(30)
    raw.close()
    dist_receiver.close()
    grpc_receiver.close()
    stop_grpc()

    load = load_average()
    print(f"{size / 1e6:.1f} MB per transfer ({PROMPT_TOKENS} tokens, {layout.num_layers} layers, "
          f"{layout.dtype} pages), median of {args.runs} runs, load average {load}")
    raw_rate = size / statistics.median(results["raw tcp"]) / 1e6
    for name, seconds in results.items():
        median = statistics.median(seconds)
        rate = size / median / 1e6
        print(f"{name:>10}: {median * 1e3:7.1f} ms  {rate:8.0f} MB/s  {rate / raw_rate:6.1%} of raw "
              f"(best {min(seconds) * 1e3:.1f} ms)")
    write_results(results_path(__name__), {"command": command_line(__name__, argv), "load_average": load,
                                           "kv_dtype": layout.dtype, "bytes": size, "seconds": results})
    return 0
