"""SIGTERM/SIGUSR1 handling: the run checkpoints at the next step boundary and exits 0, so a scheduler's requeue
resumes it. Ranks agree on stopping through one all-reduce every training.signal_check_freq steps."""
from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlike")


class PreemptionHandler:
    """SIGTERM / SIGUSR1 (what SLURM and most schedulers send before a kill) ask for a checkpoint and a clean exit
    at the next agreed step boundary.

    Ranks can receive the signal between different steps, so with several processes they agree through an
    all-reduce (MAX) of the flag every `check_freq` steps - a host sync there and nowhere else. The previous
    handlers come back on close().
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, device: torch.device, check_freq: int):
        self.device, self.check_freq = device, check_freq
        self.received: str | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed:
            stop = self.received is not None
        elif step % self.check_freq:
            return False
        else:
            flag = torch.tensor(1.0 if self.received else 0.0, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            logger.warning(f"preemption: {self.received or 'a signal on another rank'} - saving step {step} "
                           f"and exiting; rerun the same command to resume")
        return stop

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
