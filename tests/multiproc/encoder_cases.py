"""BERT and T5 under HSDP (dp_replicate 2 x dp_shard 2: shard within a row, all-reduce across rows) against one
process (gloo, fp32), through llava_cases.objective_case: the loss and grad norm of every step, every parameter's
gradient after the first step and every parameter after its AdamW steps, within 1e-5. Called from tp_worker.py's
4-process launch, so no launch of its own (the 2-process layouts of both families, Trainer-driven, are in
toy_family_worker.py).

The models: the debug flavors at a small vocabulary; rows of plain tokens, masked (BERT: 80/10/10, tied decoder) or
span-corrupted (T5: sentinels counted down from the top of the vocabulary) by the family's objective, as the trainer
does."""
from __future__ import annotations

import dataclasses

import torch

import models
from llava_cases import ROWS, objective_case

SEQ, VOCAB, TOKENS = 32, 160, 60  # T5: its 100 sentinels take the rows above TOKENS; BERT masks with VOCAB - 1


def encoder_args(family: str):
    base = models.get_spec(family).flavors["debugmodel"]
    return dataclasses.replace(base, vocab_size=VOCAB, max_seq_len=SEQ)


def token_rows(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of plain token data, as a loader gives them (the objective masks or corrupts them)."""
    toks = torch.randint(1, TOKENS, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(700 + step))
    return toks[:, :-1], toks[:, 1:]


def run(world: int, report) -> None:
    """The encoder cases of a tp_worker.py launch of `world` ranks."""
    if world == 4:
        for family in ("bert", "t5"):
            objective_case(f"{family}_hsdp2x2", {"dp_replicate": 2, "dp_shard": 2}, world, report, family,
                           encoder_args(family), token_rows)
