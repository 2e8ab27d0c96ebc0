"""A roofline estimate (arithmetic, nothing measured) of a MoE decode step's expert weights on a GPU,
alone and split by expert parallelism, and of what EP's combine costs over NVLink or InfiniBand.

A decode step of batch B reads every expert that any of its B tokens routes to: with uniform,
independent routing (an assumption: trained routers are skewed, so fewer) a layer reads
E * (1 - (1 - k/E)^B) of its E experts, k per token. One GPU streams those bytes from HBM (bf16
weights) or, at large B, is bound by their FLOPs instead. EP over n GPUs gives each rank E/n
experts, so each reads and computes a 1/n share (balanced routing assumed), but every layer then
all-reduces the [B, hidden] bf16 partial sums: a ring all-reduce sends 2(n - 1)/n of the message
per rank, plus a fixed per-call latency (assumed below: small NCCL all-reduces take microseconds, and
at batch 1 that latency, not the bytes, is the combine's cost). EP pays at batch B where the weights'
time it saves exceeds the combines' time it adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.moe.models import MoEShape

BF16_BYTES = 2
# HBM bandwidth (bytes/s) and dense bf16 tensor-core peak (FLOP/s, SXM parts' datasheet figures).
GPUS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}
# Per-direction bandwidth (bytes/s) and an assumed latency per small all-reduce (s).
LINKS = {"NVLink": (450e9, 10e-6), "InfiniBand": (50e9, 20e-6)}
BATCHES = (1, 8, 32, 128, 512)
SEARCH = tuple(2**i for i in range(11))  # batches 1..1024, where "EP pays from" is looked for


def experts_read(shape: MoEShape, batch: int) -> float:
    """Expected experts a layer reads in a step of `batch` tokens (uniform independent routing)."""
    return shape.experts * (1 - (1 - shape.top_k / shape.experts) ** batch)


def expert_params(shape: MoEShape) -> int:
    """One expert's parameters: gate, up and down."""
    return 3 * shape.hidden * shape.expert_intermediate


def expert_bytes(shape: MoEShape, batch: int) -> float:
    """Expert weight bytes a decode step of `batch` reads, all layers, bf16."""
    return shape.layers * experts_read(shape, batch) * expert_params(shape) * BF16_BYTES


def expert_flops(shape: MoEShape, batch: int) -> float:
    """The experts' FLOPs in a decode step: k experts' products per token, all layers."""
    return 2.0 * batch * shape.top_k * expert_params(shape) * shape.layers


def experts_s(shape: MoEShape, batch: int, gpu: str, share: int = 1) -> float:
    """Seconds for one rank's `1/share` of the experts: the slower of reading and computing them."""
    bandwidth, peak = GPUS[gpu]
    return max(expert_bytes(shape, batch) / share / bandwidth, expert_flops(shape, batch) / share / peak)


def combine_bytes(shape: MoEShape, batch: int, ranks: int) -> float:
    """Bytes one rank sends per layer in the ring all-reduce of [batch, hidden] bf16."""
    return 2 * (ranks - 1) / ranks * batch * shape.hidden * BF16_BYTES


def combine_s(shape: MoEShape, batch: int, ranks: int, link: str, latency: bool = True) -> float:
    """Seconds of a step's combines (one per layer) over `link`; without `latency`, the bytes alone."""
    bandwidth, fixed = LINKS[link]
    return shape.layers * ((fixed if latency else 0.0) + combine_bytes(shape, batch, ranks) / bandwidth)


def ep_s(shape: MoEShape, batch: int, gpu: str, link: str, ranks: int, latency: bool = True) -> float:
    """An EP rank's step: its share of the experts, then the combines."""
    return experts_s(shape, batch, gpu, ranks) + combine_s(shape, batch, ranks, link, latency)


def ep_pays_at(shape: MoEShape, gpu: str, link: str, ranks: int, latency: bool = True) -> list[int]:
    """The batches of SEARCH at which EP's step beats one GPU's: the weights it saves grow with the
    experts a step reads, then stop once it reads all of them, while the combine's bytes keep growing."""
    return [b for b in SEARCH if ep_s(shape, b, gpu, link, ranks, latency) < experts_s(shape, b, gpu)]


@dataclass(frozen=True)
class RooflineRow:
    shape: str
    gpu: str
    batch: int
    experts_read: float  # per layer
    expert_gb: float  # per step, one GPU
    one_gpu_us: float
    ep_rank_us: float  # an EP rank's experts alone
    combine_us: dict[str, float]  # link -> the step's combines, latency included
    ep_total_us: dict[str, float]  # link -> an EP rank's step


def roofline(shapes: list[MoEShape], ranks: int = 2, batches: tuple[int, ...] = BATCHES) -> list[RooflineRow]:
    """Every shape x GPU x batch row of the estimate."""
    return [RooflineRow(shape.name, gpu, b, experts_read(shape, b), expert_bytes(shape, b) / 1e9,
                        experts_s(shape, b, gpu) * 1e6, experts_s(shape, b, gpu, ranks) * 1e6,
                        {link: combine_s(shape, b, ranks, link) * 1e6 for link in LINKS},
                        {link: ep_s(shape, b, gpu, link, ranks) * 1e6 for link in LINKS})
            for shape in shapes for gpu in GPUS for b in batches]


def roofline_table(shapes: list[MoEShape], ranks: int = 2) -> str:
    """The estimate as a markdown table, then where EP pays for each shape, GPU and link."""
    links = list(LINKS)
    lines = [f"| shape | GPU | batch | experts read / layer | expert GB / step | 1 GPU (µs) | EP {ranks} rank experts "
             f"(µs) | " + " | ".join(f"combine {link} (µs) | EP {ranks} step {link} (µs)" for link in links) + " |",
             "|---|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(links)]
    for row in roofline(shapes, ranks):
        links_cells = " | ".join(f"{row.combine_us[link]:.1f} | {row.ep_total_us[link]:.1f}" for link in links)
        lines.append(f"| {row.shape} | {row.gpu} | {row.batch} | {row.experts_read:.2f} | {row.expert_gb:.3f} | "
                     f"{row.one_gpu_us:.1f} | {row.ep_rank_us:.1f} | {links_cells} |")
    lines.append("")
    for shape in shapes:
        for gpu in GPUS:
            said = []
            for link in links:
                with_latency = ep_pays_at(shape, gpu, link, ranks)
                bytes_only = ep_pays_at(shape, gpu, link, ranks, latency=False)
                said.append(f"over {link} at {batch_ranges(with_latency)} ({batch_ranges(bytes_only)} on bytes alone)")
            lines.append(f"- {shape.name} on {gpu}, EP {ranks} pays " + "; ".join(said))
    return "\n".join(lines)


def batch_ranges(batches: list[int]) -> str:
    """Batches of SEARCH as runs of consecutive entries, e.g. "batch 16-64", "no batch up to 1024"."""
    if not batches:
        return f"no batch up to {SEARCH[-1]}"
    runs: list[list[int]] = []
    for batch in batches:
        if runs and SEARCH.index(batch) == SEARCH.index(runs[-1][-1]) + 1:
            runs[-1].append(batch)
        else:
            runs.append([batch])
    return "batch " + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
