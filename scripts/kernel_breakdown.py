"""Where a training step's GPU time goes, from a torch.profiler trace: time per kernel class and the top kernels.

    python scripts/kernel_breakdown.py OUTPUTS/RUN/profile_traces/iteration_12/rank0_trace.json [--top 15]

The trace comes from `--profiling.enable_profiling --profiling.profile_freq=N`. The window is the span of the
recorded ProfilerStep#N annotations (divided by their count: per step). Kernel classes (by kernel name):

  gemm        cuBLAS/cuBLASLt/CUTLASS matmuls (bf16 and float8: nvjet*, sm90_xmma*, cutlass*, *gemm*)
  attention   flash / cuDNN / memory-efficient SDPA kernels, forward and backward
  triton      Inductor's generated kernels (norms, RoPE, SwiGLU, casts, the compiled loss, float8 scaling)
  optimizer   multi-tensor kernels (fused/foreach AdamW, gradient norm and clipping)
  nccl        collectives (exposed or overlapped: see pp_bubble.py for the exposed part)
  copy        memcpy / memset
  other       eager ATen kernels (elementwise, reductions, index ops)

"idle" is the part of the window where no kernel of any class ran: host-bound gaps, syncs, launch latency.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from titanlike.profiling import union_length  # noqa: E402

CLASSES = [  # first match wins: float8 matmuls launched by Inductor are still gemms, not triton
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|_mm_|scaled_mm", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("triton", re.compile(r"^triton", re.I)),
]


def kernel_class(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def breakdown(events: list[dict]) -> dict:
    """{"steps", "window_ms" (per step), "classes": {class: ms per step}, "idle_ms", "kernels": [(name, class,
    ms per step, calls per step)] sorted by time} for one rank's Chrome-trace events."""
    steps = [e for e in events if e.get("ph") == "X" and re.fullmatch(r"ProfilerStep#\d+", str(e.get("name", "")))]
    if not steps:
        raise ValueError("no ProfilerStep#N annotations in the trace: write it with --profiling.enable_profiling")
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    n = len(steps)
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list] = {}
    busy = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b <= a:
            continue
        name = str(e.get("name", ""))
        label = kernel_class(name, e["cat"])
        per_class[label] += (b - a) / 1e3 / n
        k = per_kernel.setdefault(name, [label, 0.0, 0])
        k[1] += (b - a) / 1e3 / n
        k[2] += 1
        busy.append((a, b))
    window = (hi - lo) / 1e3 / n
    kernels = sorted(((name, v[0], v[1], v[2] / n) for name, v in per_kernel.items()), key=lambda k: -k[2])
    return {"steps": n, "window_ms": window, "classes": dict(per_class),
            "idle_ms": window - union_length(busy) / 1e3 / n, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a rank<r>_trace.json")
    p.add_argument("--top", type=int, default=15, help="list this many kernels by time")
    a = p.parse_args()
    with open(a.trace) as f:
        data = json.load(f)
    r = breakdown(data["traceEvents"] if isinstance(data, dict) else data)
    w = r["window_ms"]
    print(f"{a.trace}: {r['steps']} step(s), {w:.1f} ms per step")
    print(f"{'class':12} {'ms/step':>9} {'share':>7}")
    for label, ms in sorted(r["classes"].items(), key=lambda kv: -kv[1]):
        print(f"{label:12} {ms:9.1f} {ms / w:7.1%}")
    print(f"{'idle':12} {r['idle_ms']:9.1f} {r['idle_ms'] / w:7.1%}   (no kernel running)")
    print(f"\n{'ms/step':>9} {'calls':>6} {'class':10} kernel")
    for name, label, ms, calls in r["kernels"][: a.top]:
        print(f"{ms:9.2f} {calls:6.0f} {label:10} {name[:110]}")


if __name__ == "__main__":
    main()
