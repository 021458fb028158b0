"""The run's data side, built once by the Trainer: this DP rank's share of every global batch (torchft replica
groups read theirs), gradient accumulation for the rest, the train and validation loaders, and the token counts the
log's tok/s uses. Bad validation data (paths, split, vocabulary) fails here, at start-up, not at the first
interval."""
from __future__ import annotations

from dataclasses import dataclass

from titanlike.data import build_dataloader, build_validation_dataloader
from titanlike.resilience.ft import ft_data_shard


@dataclass
class RunData:
    dataloader: object
    val_loader: object | None
    loader_kw: dict  # what another loader of this run (in-loop evaluation) is built with
    dp_degree: int
    global_batch: int  # samples per optimizer step, all ranks
    grad_accum_steps: int
    tokens_per_step_local: int
    # tok/s per device: TP/CP/PP ranks of one DP rank share its tokens, so each device counts its share
    tokens_per_step_device: int


def build_run_data(t, data_cfg, val_cfg, ft_cfg, dims, tokenizer, vocab_size: int, rows: int = 1) -> RunData:
    """From the training, data, validation and fault_tolerance sections; `rows` sequences a sample holds (a
    preference pair: 2)."""
    # torchft: replica group i reads the i-th block of each global batch (the groups are the replicate axis)
    dp_degree, dp_rank = ft_data_shard(ft_cfg, dims.dp_degree, dims.dp_rank())
    global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_degree
    accum = global_bs // (t.local_batch_size * dp_degree)
    local = accum * t.local_batch_size * t.seq_len * rows
    loader_kw = dict(dp_rank=dp_rank, dp_degree=dp_degree, local_batch_size=t.local_batch_size, seq_len=t.seq_len,
                     seed=t.seed, vocab_size=vocab_size)
    # global_batch_size: a resume with another global batch is refused (the loader's state records it)
    train = build_dataloader(data_cfg, tokenizer, split="train", global_batch_size=global_bs, steps=t.steps,
                             **loader_kw)
    val = (build_validation_dataloader(data_cfg, val_cfg, tokenizer, steps=val_cfg.steps, **loader_kw)
           if val_cfg.enable else None)
    return RunData(train, val, loader_kw, dp_degree, global_bs, accum, local, local // dims.non_data_parallel_size)
