"""Shared pieces of the parallelism tests: a tiny Llama, its seeded full-size reference, deterministic data.

Imported both by pytest files and by torchrun worker scripts (both have tests/multiproc on sys.path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import models

SEQ = 16
VOCAB = 128


def tiny_args():
    spec = models.get_spec("llama3")
    return spec.args_cls(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, rope_theta=10000.0,
        max_seq_len=SEQ,
    )


def reference_model(seed: int = 0) -> torch.nn.Module:
    """The full model on CPU, initialised from `seed`: identical on every rank."""
    torch.manual_seed(seed)
    model = models.get_spec("llama3").model_cls(tiny_args())
    model.init_weights()
    return model


def meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return models.get_spec("llama3").model_cls(tiny_args())


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [rows, SEQ] for one step; the same on every rank; each DP rank takes its slice."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def exit_without_teardown(code: int | None = 0) -> None:
    """End a worker after a clean finish without the interpreter's teardown: on torch 2.13/gloo a background
    thread occasionally aborts it ("terminate called without an active exception"), failing a passed run."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
