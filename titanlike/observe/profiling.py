"""torch.profiler traces and CUDA memory snapshots on a step schedule (the `[profiling]` config section).

Every `profile_freq` steps, the `profile_active` steps ending there are recorded (after `profile_warmup` profiled but
discarded steps) and written per rank to
    <run_dir>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json    (open in Perfetto / chrome://tracing)
    <run_dir>/<save_traces_folder>/iteration_<step>/rank<r>_ops.txt       (top ops by device time, then host time)
With `enable_memory_snapshot` (CUDA only) the allocator records its history from the start, and every
`profile_freq` steps it is dumped to
<run_dir>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle (drag onto
https://pytorch.org/memory_viz).

The trainer holds one `StepProfiler` and calls `.step(step)` after each optimizer step and `.stop()` at the end;
when both features are off every call is a no-op.
"""
from __future__ import annotations

import logging
import os
import pickle
import time

import torch

from titanlike.config.sections import Profiling

logger = logging.getLogger("titanlike")

# Allocator events kept for the snapshot: enough for several steps of an 8B model without exhausting host memory.
MEMORY_HISTORY_MAX_ENTRIES = 100_000


class StepProfiler:
    def __init__(self, cfg: Profiling, run_dir: str, rank: int, device: torch.device, start_step: int = 0):
        """`cfg`: the [profiling] section. `start_step`: the step already done (non-zero after a resume), so traces
        still land on multiples of profile_freq."""
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_dir = os.path.join(run_dir, cfg.save_traces_folder)
        self.snapshot_dir = os.path.join(run_dir, cfg.save_memory_snapshot_folder)
        self.last_step = start_step
        self.prof = None
        self.snapshot = False
        if cfg.enable_profiling:
            self._start_trace(start_step)
        if cfg.enable_memory_snapshot:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
                self.snapshot = True
            else:
                logger.warning("profiling.enable_memory_snapshot: the allocator history exists on CUDA only; "
                               f"no snapshot on {device.type}")

    def _start_trace(self, start_step: int) -> None:
        freq, warmup, active = self.cfg.profile_freq, self.cfg.profile_warmup, self.cfg.profile_active
        if warmup + active > freq:
            raise ValueError(f"profiling.profile_warmup + profile_active = {warmup + active} must be <= "
                             f"profiling.profile_freq={freq}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        cycle = torch.profiler.schedule(wait=freq - warmup - active, warmup=warmup, active=active)
        # The profiler counts its own steps from 0; offset them by the steps already done (resume) so traces
        # still end on multiples of profile_freq.
        self.prof = torch.profiler.profile(
            activities=activities, schedule=lambda n: cycle(n + start_step), on_trace_ready=self._save_trace,
            record_shapes=True)
        self.prof.start()

    def _save_trace(self, prof) -> None:
        folder = os.path.join(self.trace_dir, f"iteration_{self.last_step}")
        os.makedirs(folder, exist_ok=True)
        t0 = time.perf_counter()
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))
        averages = prof.key_averages()
        with open(os.path.join(folder, f"rank{self.rank}_ops.txt"), "w") as f:
            if self.device.type == "cuda":
                f.write(averages.table(sort_by="self_device_time_total", row_limit=40) + "\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
        if self.rank == 0:
            logger.info(f"profiling: trace of step {self.last_step} written to {folder} "
                        f"in {time.perf_counter() - t0:.1f}s")

    def step(self, step: int) -> None:
        """Call once after training step `step` (1-based) has been issued."""
        self.last_step = step
        if self.prof is not None:
            self.prof.step()
        if self.snapshot and step % self.cfg.profile_freq == 0:
            self._dump_snapshot(step)

    def _dump_snapshot(self, step: int) -> None:
        folder = os.path.join(self.snapshot_dir, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        if self.rank == 0:
            logger.info(f"profiling: memory snapshot of step {step} written to {folder}")

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once: GPU busy time from kernels that run
    on several streams at once (scripts/bench/pp_bubble.py, scripts/bench/kernel_breakdown.py)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
