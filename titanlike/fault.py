"""Surviving bad steps and bad nodes: non-finite guard, loss-spike detector, preemption signals, heartbeat,
flight recorder.

Nothing here adds a per-step host sync: the non-finite guard decides on the device (fused AdamW's `found_inf`
skips the update in the kernel), and its counters are read on log steps only.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlike")


class NonFiniteError(RuntimeError):
    pass


class NonFiniteGuard:
    """Skips every optimizer update whose loss or gradient norm is NaN/Inf, on the device.

    Fused AdamW reads `optimizer.found_inf`: where it is non-zero the kernel leaves params, moments and the step
    count untouched. Counters live on the device; `check()` (log steps only) syncs them, logs the skipped steps
    and raises once `max_consecutive` updates in a row were skipped, naming the first step of that streak.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, max_consecutive: int):
        if not all(g.get("fused") for g in optimizer.param_groups):
            raise ValueError("the non-finite guard needs fused AdamW (optimizer.fused='true' or 'auto')")
        self.optimizer, self.max_consecutive = optimizer, max_consecutive
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        self.skipped, self.consecutive, self.first_bad, self.last_bad = z(), z(), z(), z()
        self.bad_microbatches = z()  # bit i set: micro-batch i of the last bad step had a non-finite loss
        self._reported = 0

    def before_optimizer_step(self, step: int, microbatch_losses: list[torch.Tensor],
                              grad_norm: torch.Tensor) -> None:
        finite = torch.stack([torch.isfinite(x) for x in microbatch_losses]).all() & torch.isfinite(grad_norm)
        bad = (~finite).float()
        self.optimizer.found_inf = bad  # fused AdamW skips the update where this is 1
        self.skipped += bad
        self.consecutive = (self.consecutive + 1) * bad
        self.first_bad = torch.where(self.consecutive == 1, float(step), self.first_bad)
        self.last_bad = torch.where(bad > 0, float(step), self.last_bad)
        mask = sum((~torch.isfinite(x)).float() * 2.0**i for i, x in enumerate(microbatch_losses))
        self.bad_microbatches = torch.where(bad > 0, mask, self.bad_microbatches)

    def check(self) -> int:
        """Host-side report on a log step; returns the number of skipped updates so far."""
        skipped, consecutive = int(self.skipped.item()), int(self.consecutive.item())
        if skipped > self._reported:
            mb = int(self.bad_microbatches.item())
            which = [i for i in range(32) if mb >> i & 1]
            logger.warning(f"skipped {skipped - self._reported} update(s) with a non-finite loss or grad norm; "
                           f"last at step {int(self.last_bad.item())} (non-finite loss in micro-batch(es) "
                           f"{which or 'none: the gradients were non-finite'}); {skipped} skipped in total")
            self._reported = skipped
        if self.max_consecutive > 0 and consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{consecutive} consecutive steps had a non-finite loss or gradient norm, the first at step "
                f"{int(self.first_bad.item())}; stopping. Lower optimizer.lr, check the data around that step, "
                f"or resume from the last checkpoint (checkpoint.load_step)")
        return skipped


class SpikeDetector:
    """Flags logged losses more than `zscore` standard deviations above the mean of the last `window` ones."""

    def __init__(self, window: int, zscore: float):
        self.losses: collections.deque[float] = collections.deque(maxlen=window)
        self.zscore = zscore

    def update(self, step: int, loss: float) -> bool:
        spike = False
        if len(self.losses) >= 8 and math.isfinite(loss):
            mean = sum(self.losses) / len(self.losses)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))
            spike = std > 0 and (loss - mean) / std > self.zscore
            if spike:
                logger.warning(f"loss spike at step {step}: {loss:.4f} vs mean {mean:.4f} ± {std:.4f} "
                               f"over the last {len(self.losses)} logged steps")
        if math.isfinite(loss):
            self.losses.append(loss)
        return spike


class PreemptionHandler:
    """SIGTERM / SIGUSR1 (SLURM's warning signals) ask for a checkpoint at the next agreed step boundary.

    Ranks can receive the signal between different steps, so they agree through an all-reduce (MAX) of the flag,
    run every `check_freq` steps: a sync there, never on other steps.
    """

    def __init__(self, device: torch.device, check_freq: int, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.device, self.check_freq = device, check_freq
        self.received: str | None = None
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self, step: int, force_check: bool = False) -> bool:
        if not force_check and step % self.check_freq:
            return False
        flag = torch.tensor(1.0 if self.received else 0.0, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop:
            logger.warning(f"preemption requested ({self.received or 'signal on another rank'}) - "
                           f"saving a checkpoint at step {step} and exiting")
        return stop


class Heartbeat:
    """A daemon thread: every `interval_s` each rank writes its step to run_dir/heartbeat/rank{N}, and warns in
    the log when its step has not moved for `stall_s` (which rank is stuck shows in the files and the warnings)."""

    def __init__(self, run_dir: str, rank: int, interval_s: float, stall_s: float):
        self.path = os.path.join(run_dir, "heartbeat", f"rank{rank}")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.rank, self.interval_s, self.stall_s = rank, interval_s, stall_s
        self.step, self.step_time = 0, time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titanlike-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self.step_time = step, time.time()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            idle = time.time() - self.step_time
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(f"rank {self.rank} step {self.step} idle_s {idle:.0f} at {time.strftime('%H:%M:%S')}\n")
            os.replace(tmp, self.path)
            if idle > self.stall_s:
                logger.warning(f"heartbeat: rank {self.rank} has been at step {self.step} for {idle:.0f}s "
                               f"(a collective may be hung; see the flight recorder dump if enabled)")

    def close(self) -> None:
        self._stop.set()


def configure_flight_recorder(run_dir: str, buffer_entries: int) -> None:
    """Enable PyTorch's NCCL flight recorder before the process group starts: on a collective timeout every rank
    dumps its last `buffer_entries` collectives to run_dir/flight_recorder/rank_N (read them with
    `python -m torch.distributed.flight_recorder.fr_trace`)."""
    if buffer_entries <= 0:
        return
    folder = os.path.join(os.path.abspath(run_dir), "flight_recorder")
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(buffer_entries))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, "rank_"))
