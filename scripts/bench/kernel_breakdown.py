"""Where a training step's GPU time goes, from a torch.profiler trace: time per kernel class and the top kernels.

    python scripts/bench/kernel_breakdown.py OUTPUTS/RUN/profile_traces/iteration_12/rank0_trace.json [--top 15]

The trace comes from `--profiling.enable_profiling --profiling.profile_freq=N`. The window is the span of the
recorded ProfilerStep#N annotations (divided by their count: per step). Kernel classes (by kernel name):

  gemm        cuBLAS/cuBLASLt/CUTLASS matmuls (bf16 and float8: nvjet*, sm90_xmma*, cutlass*, *gemm*)
  attention   flash / cuDNN / memory-efficient SDPA kernels, forward and backward
  triton      Inductor's generated kernels (norms, RoPE, SwiGLU, casts, the compiled loss, float8 scaling)
  optimizer   multi-tensor kernels (fused/foreach AdamW, gradient norm and clipping)
  nccl        collectives (exposed or overlapped: see pp_bubble.py for the exposed part)
  copy        memcpy / memset
  other       eager ATen kernels (elementwise, reductions, index ops)

"idle" is the part of the window where no kernel of any class ran: host-bound gaps, syncs, launch latency;
`--gaps N` lists the N longest such stretches with the kernels on either side.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from titanlike.observe.profiling import union_length

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
    # The profiler records each ProfilerStep#N twice: on the CPU (user_annotation) and, for the kernels it
    # launched, on the GPU (gpu_user_annotation). Count and span the CPU ones: a step, host gaps included.
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
             and re.fullmatch(r"ProfilerStep#\d+", str(e.get("name", "")))]
    if not steps:
        raise ValueError("no ProfilerStep#N annotations in the trace: write it with --profiling.enable_profiling")
    lo, hi = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    n = len(steps)
    per_class: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list] = {}
    busy, busy_named = [], []
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
        busy_named.append((a, b, name))
    window = (hi - lo) / 1e3 / n
    gaps = _gaps(sorted(busy_named), lo, hi)
    kernels = sorted(((name, v[0], v[1], v[2] / n) for name, v in per_kernel.items()), key=lambda k: -k[2])
    return {"steps": n, "window_ms": window, "classes": dict(per_class),
            "idle_ms": window - union_length(busy) / 1e3 / n, "kernels": kernels, "gaps": gaps}


def _gaps(spans: list[tuple], lo: float, hi: float) -> list[tuple]:
    """[(ms, ms into the window, kernel before, kernel after)] of every stretch with no kernel, longest first."""
    out, end, last = [], lo, "(window start)"
    for a, b, name in spans:
        if a > end:
            out.append(((a - end) / 1e3, (end - lo) / 1e3, last, name))
        if b > end:
            end, last = b, name
    if hi > end:
        out.append(((hi - end) / 1e3, (end - lo) / 1e3, last, "(window end)"))
    return sorted(out, key=lambda g: -g[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a rank<r>_trace.json")
    p.add_argument("--top", type=int, default=15, help="list this many kernels by time")
    p.add_argument("--gaps", type=int, default=0, help="list this many of the longest idle stretches")
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
    if a.gaps:
        print(f"\n{'idle ms':>9} {'at ms':>8}  between")
        for ms, at, before, after in r["gaps"][: a.gaps]:
            print(f"{ms:9.2f} {at:8.1f}  {before[:60]}  ->  {after[:60]}")


if __name__ == "__main__":
    main()
