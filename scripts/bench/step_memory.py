"""Step time and peak GPU memory of the trainer's own `train_step`, with no logging (no host sync per step).

    python scripts/bench/step_memory.py --config CONFIG.toml --model.vocab_size=128256 [--section.key=value ...]

Runs 6 warm-up steps, then times 8 and prints the mean step time, peak allocated and peak reserved memory: what the
memory rows of docs/benchmarks.md compare. Set PYTORCH_CUDA_ALLOC_CONF before running to compare
allocators (scripts/train.py sets expandable segments for one process; this script does not).
"""
from __future__ import annotations

import sys
import time


import torch

from titanlike.config.load import load_config
from titanlike.train.trainer import Trainer


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("step_memory.py measures GPU memory: it needs a CUDA device")
    cfg = load_config(["--training.steps=14", "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=100",
                       "--checkpoint.enable=false", "--metrics.enable_tensorboard=false",
                       "--job.dump_folder=/tmp/step_memory", *argv])
    trainer = Trainer(cfg)
    batches = iter(trainer.dataloader)

    def steps(n: int) -> None:
        for _ in range(n):
            trainer.step += 1
            trainer.train_step(trainer.next_batches(batches))

    steps(6)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    steps(8)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 8 * 1e3
    print(f"{' '.join(argv):60s} step {ms:6.1f} ms  peak allocated {torch.cuda.max_memory_allocated() / 2**30:5.1f} "
          f"GiB  peak reserved {torch.cuda.max_memory_reserved() / 2**30:5.1f} GiB", flush=True)
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
