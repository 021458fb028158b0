"""Measured pipeline bubble from torch.profiler traces, next to the schedule's theoretical bubble.

    python scripts/bench/pp_bubble.py OUTPUTS/RUN/profile_traces/iteration_10 --pp 2 --microbatches 8 --schedule 1F1B

Per rank trace (rank<r>_trace.json, written by `--profiling.enable_profiling`): the window is the span of the
recorded ProfilerStep#N annotations; "busy" is the union of the GPU's compute kernels and copies inside it (NCCL
kernels excluded: a pipeline receive shows up as a long NCCL kernel while the stage waits for its input). The
measured bubble is 1 - busy / window: it also contains load imbalance between stages, exposed communication and
the optimizer's host gaps, so it bounds the schedule's own bubble from above.

Theory (p ranks, m micro-batches, v stages per rank, equal stage times):
  GPipe, 1F1B:            (p-1) / (m + p - 1)
  Interleaved1F1B:        (p-1) / (v*m + p - 1)
  ZBVZeroBubble, DualPipeV: ~0 when forward, input-backward and weight-backward take equal time
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re

from titanlike.observe.profiling import union_length


def theoretical_bubble(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2) -> float | None:
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return 0.0
    return None


def trace_bubble(events: list[dict]) -> dict:
    """{"window_ms", "busy_ms", "nccl_only_ms", "bubble"} for one rank's Chrome-trace events."""
    steps = [e for e in events if e.get("ph") == "X" and re.fullmatch(r"ProfilerStep#\d+", str(e.get("name", "")))]
    if not steps:
        raise ValueError("no ProfilerStep#N annotations in the trace: write it with --profiling.enable_profiling")
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    compute, nccl = [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if b > a:
            (nccl if "nccl" in str(e.get("name", "")).lower() else compute).append((a, b))
    window, busy = hi - lo, union_length(compute)
    return {"window_ms": window / 1e3, "busy_ms": busy / 1e3,
            "nccl_only_ms": (union_length(compute + nccl) - busy) / 1e3, "bubble": 1 - busy / window}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", help="a profile_traces/iteration_<step> folder")
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--stages-per-rank", type=int, default=2)
    a = p.parse_args()
    files = sorted(glob.glob(os.path.join(a.trace_dir, "rank*_trace.json")))
    if not files:
        raise SystemExit(f"no rank*_trace.json under {a.trace_dir}")
    theory = theoretical_bubble(a.schedule, a.pp, a.microbatches, a.stages_per_rank)
    print(f"{'trace':28} {'window ms':>10} {'busy ms':>9} {'NCCL-only ms':>13} {'bubble':>7}")
    for path in files:
        with open(path) as f:
            data = json.load(f)
        r = trace_bubble(data["traceEvents"] if isinstance(data, dict) else data)
        print(f"{os.path.basename(path):28} {r['window_ms']:10.1f} {r['busy_ms']:9.1f} {r['nccl_only_ms']:13.1f} "
              f"{r['bubble']:7.1%}")
    if theory is not None:
        print(f"theoretical bubble of {a.schedule} (p={a.pp}, m={a.microbatches}): {theory:.1%}")


if __name__ == "__main__":
    main()
