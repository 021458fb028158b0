"""GPU kinds the planner has figures for: memory, dense peaks, and the rates measured on them.

Peaks are the vendor's dense figures (MFU in docs/benchmarks.md uses the same). `matmul_eff` is the fraction of the
bf16 peak a large dense training step reached here (the best measured MFU of the kind's family), `nvlink_gbps` the
bus bandwidth an NCCL all-gather/reduce-scatter reaches inside a node and `network_gbps` per GPU between nodes
(GB/s). A kind without measured runs borrows the nearest kind's efficiencies: its entry says so.

To add a kind: copy the nearest entry, put its vendor peaks and memory, then measure a 1B-shape step on one GPU
(`scripts/bench/benchmark.py` on the 1B config) and an 8B FSDP step on two, and set matmul_eff from
their MFU.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak; 0 = no float8 tensor cores
    hbm_tbps: float
    matmul_eff: float  # fraction of bf16_tflops a large training step reaches (measured MFU)
    nvlink_gbps: float  # achieved NCCL bus bandwidth inside a node, GB/s
    network_gbps: float  # achieved per-GPU bandwidth between nodes, GB/s
    gpus_per_node: int = 8
    note: str = ""


GPUS: dict[str, GpuKind] = {
    "h100": GpuKind("h100", 79.1, 989.0, 1979.0, 3.35, 0.66, 360.0, 45.0,
                    note="measured: 1B shape one GPU 57-62% MFU (docs/benchmarks.md)"),
    "h200": GpuKind("h200", 139.8, 989.0, 1979.0, 4.8, 0.66, 360.0, 45.0,
                    note="measured: 8B FSDP 2 58% MFU, a 774M 1280-wide model 51% MFU (docs/benchmarks.md)"),
    "a100": GpuKind("a100", 79.1, 312.0, 0.0, 2.0, 0.60, 230.0, 22.0,
                    note="vendor peaks only: efficiencies borrowed from h100, not measured here"),
}


class UnknownGpu(ValueError):
    pass


def gpu_kind(name: str) -> GpuKind:
    """The kind by name (case-insensitive; "H100 80GB HBM3" finds h100). One line naming the known kinds otherwise."""
    key = name.lower().replace("nvidia", "").strip()
    for k, g in GPUS.items():
        if key == k or key.startswith(k) or f" {k}" in f" {key}":
            return g
    raise UnknownGpu(f"GPU kind {name!r} has no figures here; known: {', '.join(GPUS)}. To add one, give it an entry "
                     f"in titanlike/planner/gpus.py (its peaks, memory, and efficiencies measured as that file says)")
