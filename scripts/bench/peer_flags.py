"""The torchtitan-style flags every peer script takes (benchmark.py passes them to whichever peer runs a case)."""
from __future__ import annotations

import argparse


def add_run_flags(p: argparse.ArgumentParser, batch: int, steps: int) -> None:
    """--training.seq_len / local_batch_size / steps, --metrics.log_freq, --activation_checkpoint.mode,
    --compile.enable, as torchtitan spells them (dests: seq, batch, steps, log_freq, ac, compile)."""
    p.add_argument("--training.seq_len", dest="seq", type=int, default=4096)
    p.add_argument("--training.local_batch_size", dest="batch", type=int, default=batch)
    p.add_argument("--training.steps", dest="steps", type=int, default=steps)
    p.add_argument("--metrics.log_freq", dest="log_freq", type=int, default=1)
    p.add_argument("--activation_checkpoint.mode", dest="ac", default="none")
    p.add_argument("--compile.enable", dest="compile", action="store_true")
