"""What the device checksum NCCL pairs carry costs per message, against copying the pages to the host for CRC32C.

Per message (one layer's pages, K and V as two flat uint8 tensors, as the torch_dist sender sends
them), on the GPU when there is one (`--device`):

- receiver: `payload_checksum` (the device sums: Triton kernels on CUDA) with its 8-byte read back;
- sender: `pages_header`, the checksum written into the header on the device; host time, since the
  sender never waits for the device (also given until the device is done);
- torch form: `torch_device_checksum` with its read back (the reference the kernels are tested on);
- baseline, measured in the same run: each message copied to the host and CRC32C'd there.

Cases: the shipped model's 512-token fp32 prompt (30 layers of 786 KB) and a Llama-3-8B-shaped
1,024-token bf16 prompt (32 layers of 4 MiB), random bytes. Means over --repeats passes after a
warm-up pass.

    python -m bench device_checksum [--device cuda] [--repeats 20] [--quick]

Writes bench/results/device_checksum.json (a --quick run's under bench/results/smoke/).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from bench.common.suite import command_line, results_path, suite_parser, write_results
from kvtransfer.device_checksum import torch_device_checksum
from kvtransfer.torch_dist import Header, Kind, PageRun, pages_header, payload_checksum

# name -> (layers, K or V bytes of one layer's pages)
CASES = {
    "SmolLM2-135M, 512 tokens fp32": (30, 512 * 3 * 64 * 4),
    "Llama-3-8B shape, 1,024 tokens bf16": (32, 1024 * 8 * 128 * 2),
}


def _mean_seconds(messages: list[list[torch.Tensor]], repeats: int, work: Callable[[list[torch.Tensor]], object],
                  until_done: Callable[[], None]) -> float:
    """Mean seconds of `work` over all messages per pass, after one warm-up pass."""
    for message in messages:
        work(message)
    until_done()
    start = time.perf_counter()
    for _ in range(repeats):
        for message in messages:
            work(message)
    until_done()
    return (time.perf_counter() - start) / repeats


def measure(device: torch.device, layers: int, half_bytes: int, repeats: int) -> dict:
    """One case's figures: seconds per prompt (all its layer messages) for each way."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(0)
    messages = [[torch.randint(0, 256, (half_bytes,), dtype=torch.uint8, device=device, generator=generator)
                 for _ in range(2)] for _ in range(layers)]
    header = Header(Kind.PAGES, 1, (PageRun(0, 0, 1, half_bytes),))
    checksums = {payload_checksum(m) for m in messages[:1]} | {int(torch_device_checksum(messages[0]))}
    figures = {
        "receiver_s": _mean_seconds(messages, repeats, payload_checksum, sync),
        "torch_form_s": _mean_seconds(messages, repeats, lambda m: int(torch_device_checksum(m)), sync),
        "sender_until_done_s": _mean_seconds(messages, repeats, lambda m: pages_header(header, m, device, True), sync),
        "baseline_host_crc32c_s": _mean_seconds(
            messages, max(1, repeats // 4), lambda m: payload_checksum([t.cpu() for t in m]), sync),
    }
    figures["sender_host_s"] = _mean_seconds(messages, repeats, lambda m: pages_header(header, m, device, True),
                                             lambda: None)
    sync()
    figures["bytes"] = layers * 2 * half_bytes
    figures["layers"] = layers
    figures["forms_agree"] = len(checksums) == 1 or device.type == "cpu"  # on a CPU the pages carry CRC32C
    return figures


def main(argv: Sequence[str]) -> int:
    """Each case on the device, the table, the results."""
    parser = suite_parser(__name__, __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}; per layer message, mean of {args.repeats} passes")
    if device.type == "cpu":
        print("on a CPU, pages carry CRC32C: the receiver and the baseline do the same work (run with a GPU)")
    print()
    print("| case | bytes | receiver (ms) | sender, host (ms) | sender, until done (ms) | torch form (ms) "
          "| baseline: to host + CRC32C (ms) | baseline / receiver |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    results = {}
    for case, (layers, half_bytes) in CASES.items():
        row = measure(device, layers, half_bytes, args.repeats)
        results[case] = row
        per = {key: row[key] / layers * 1e3 for key in row if key.endswith("_s")}
        print(f"| {case} | {row['bytes'] // layers:,} | {per['receiver_s']:.3f} | {per['sender_host_s']:.3f} | "
              f"{per['sender_until_done_s']:.3f} | {per['torch_form_s']:.3f} | {per['baseline_host_crc32c_s']:.3f} "
              f"| {row['baseline_host_crc32c_s'] / row['receiver_s']:.1f}x |")
        if not row["forms_agree"]:
            print(f"error: the Triton and torch forms disagree on {case}")
            return 1
    write_results(results_path(__name__, args.quick), {
        "command": command_line(__name__, argv), "settings": vars(args), "device": name,
        "torch": torch.__version__, "cases": results,
    })
    return 0
