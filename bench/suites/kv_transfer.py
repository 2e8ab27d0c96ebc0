"""KV transfer throughput of each kvtransfer backend against a raw loopback TCP copy of the same bytes,
and what the CRC32C costs each backend.

One prompt's KV for the default model's shape (512 tokens, 30 layers, 3 KV heads, head_dim 64,
blocks of 16, fp32: about 23.6 MB; with --kv-cache-dtype fp8 or int8, the engine's quantized pages:
about 6.3 MB, int4 about 4.4 MB) goes from a sender process to a receiver process, layer by layer as the prefill sends
it, into a cache tensor indexed by block id. A run is timed from the command
that starts the sender to the receiver's completion; pairing and handshakes happen in a warm-up run
first. The raw baseline sends the same K and V bytes, layer by layer, over one TCP socket. Each
backend runs twice: with `--kv-checksum on` (the default) on both ends, and off on both ends, the
only way pages go without CRC32C; the difference, as a share of the checked transfer, is the
checksum's cost. Runs of the five methods alternate. The CRC32C alone (one end's, over the same
pages) is timed too: on a shared machine it is the steadier figure.

    python -m bench kv_transfer [--runs 5] [--kv-cache-dtype auto|fp8|fp8_e4m3|int8|int4] [--quick]

Prints the table and writes bench/results/kv_transfer.json (a --quick run's, 2 runs, under
bench/results/smoke/).
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from bench.common.kv_rig import (
    PROMPT_TOKENS,
    BackendRun,
    layout_of,
    prompt_kv,
    sender_process,
    serve_grpc,
    total_bytes,
)
from bench.common.machine import cpu_model
from bench.common.suite import command_line, load_average, results_path, suite_parser, write_results
from engine.kv_cache.codec import kv_format
from kvtransfer.descriptor import KVLayout
from kvtransfer.receiver import make_receiver
from kvtransfer.torch_dist import payload_checksum, raw_bytes

BACKENDS = ("torch_dist", "grpc")
UNCHECKED = " no crc"  # suffix of a backend's run with --kv-checksum off on both ends


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


def crc_seconds(layout: KVLayout, runs: int) -> float:
    """Median seconds of one end's CRC32C over one prompt's pages (each end computes it once)."""
    payload = [raw_bytes(tensor, torch.device("cpu")) for pages in prompt_kv(layout) for tensor in pages]
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        payload_checksum(payload)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main(argv: Sequence[str]) -> int:
    """Time every method in turn, print their medians, write the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--runs", type=int, default=5, help="timed transfers per backend")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "int8", "int4"],
                        help="the pages' KV format, as the engine flag names it (auto: an fp32 model's)")
    parser.add_argument("--quick", action="store_true", help="2 runs, for a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs = 2
    layout = layout_of(kv_format(args.kv_cache_dtype, "float32").name)
    size = total_bytes(layout)
    torch.set_num_threads(1)
    ctx = multiprocessing.get_context("spawn")
    conn, child_end = ctx.Pipe()
    child = ctx.Process(target=sender_process, args=(child_end, layout), daemon=True)
    child.start()

    receivers, stops = [], []
    raw = RawRun(conn, size)
    runs: dict[str, RawRun | BackendRun] = {"raw tcp": raw}
    for checksum in (True, False):
        dist_receiver = make_receiver("torch_dist", "127.0.0.1", "", timeout=60.0, checksum=checksum)
        grpc_receiver, stop_grpc = serve_grpc(layout, checksum)
        receivers += [dist_receiver, grpc_receiver]
        stops.append(stop_grpc)
        suffix = "" if checksum else UNCHECKED
        runs[f"torch_dist{suffix}"] = BackendRun(conn, dist_receiver, layout, checksum)
        runs[f"grpc{suffix}"] = BackendRun(conn, grpc_receiver, layout, checksum)
    # Round-robin, so that every method sees the same background load.
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, run in runs.items():
            results[name].append(run.once())
    conn.send(("exit",))
    child.join(30)
    raw.close()
    for receiver in receivers:
        receiver.close()
    for stop in stops:
        stop()

    crc_s = crc_seconds(layout, args.runs)
    load = load_average()
    print(f"{size / 1e6:.1f} MB per transfer ({PROMPT_TOKENS} tokens, {layout.num_layers} layers, "
          f"{layout.dtype} pages), median of {args.runs} runs, {cpu_model()}, load average {load}")
    medians = {name: statistics.median(seconds) for name, seconds in results.items()}
    raw_rate = size / medians["raw tcp"] / 1e6
    for name, seconds in results.items():
        rate = size / medians[name] / 1e6
        print(f"{name:>17}: {medians[name] * 1e3:7.1f} ms  {rate:8.0f} MB/s  {rate / raw_rate:6.1%} of raw "
              f"(best {min(seconds) * 1e3:.1f} ms)")
    # Negative when the difference is below the noise between runs.
    checksum_share = {name: 1 - medians[name + UNCHECKED] / medians[name] for name in BACKENDS}
    print("CRC32C's share of the checked transfer (on both ends vs off on both): "
          + ", ".join(f"{name} {share:.1%}" for name, share in checksum_share.items()))
    print(f"CRC32C alone: {crc_s * 1e3:.1f} ms at one end ({size / crc_s / 1e9:.1f} GB/s); both ends' share of the "
          "checked transfer: " + ", ".join(f"{name} {2 * crc_s / medians[name]:.1%}" for name in BACKENDS))
    write_results(results_path(__name__, args.quick),
                  {"command": command_line(__name__, argv), "load_average": load, "processor": cpu_model(),
                   "kv_dtype": layout.dtype, "bytes": size, "seconds": results, "checksum_share": checksum_share,
                   "crc_seconds_one_end": crc_s})
    return 0
