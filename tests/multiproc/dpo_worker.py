"""torchrun worker for test_dist_dpo.py: DPO under data and tensor parallelism, against one process.

    dpo_worker.py ROOT PAIRS      (2 processes) runs, one after the other in the same process group:
        fsdp2         dp_shard 2, 2 pairs per rank, precomputed reference (each rank a share of the pass)
        fsdp2_frozen  the same with the frozen copy (FSDP-sharded too)
        tp2           tensor parallel 2 (vocabulary-sharded logits: the log-probs under loss parallel), 4 pairs
Each run records the step-1 gradients (full tensors, from an explicit forward/backward of the first step's batches),
the losses of 3 steps, the final weights and the reference table; rank 0 saves them to ROOT/<name>.pt. The pytest
side runs `record` in one process on the same pairs and compares.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor import DTensor

from titanlike.config.load import config_from_dict
from titanlike.train.trainer import Trainer

STEPS = 3


def make_cfg(root: str, pairs: str, name: str, *, local_batch: int = 4, parallelism: dict | None = None,
             reference: str = "precompute"):
    """4 pairs per step (global), sequences of 16 tokens, fp32 on CPU."""
    return config_from_dict({
        "job": {"dump_folder": root, "run_name": name},
        "model": {"flavor": "debugmodel"},
        "training": {"steps": STEPS, "seq_len": 16, "local_batch_size": local_batch, "device": "cpu",
                     "deterministic": True, "gc_freq": 0, "max_norm": 0.5},
        "data": {"dataset": "preference", "paths": [pairs], "tokenizer_type": "NullTokenizer",
                 "builtin_vocab_size": 127},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": parallelism or {},
        "dpo": {"reference": reference},
    })


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def record(cfg) -> dict:
    """Step-1 gradients, 3 steps' losses and metrics, final weights, the reference table."""
    trainer = Trainer(cfg)
    try:
        trainer.checkpointer.load()
        trainer.dpo.start()
        batches = trainer.next_batches(iter(trainer.dataloader))
        count = trainer.sum_over_data(sum(b.target_count() for b in batches).float())
        for b in batches:
            trainer.compute.forward_backward(trainer.model, b, trainer.grad_divide_factor / count)
        grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters()}
        trainer.model.zero_grad(set_to_none=True)
        history = trainer.train()  # (a fresh iterator: the loader starts again at the first batch)
        weights = {n: _full(p) for n, p in trainer.model.named_parameters()}
        table = trainer.dpo.table.state_dict() if trainer.dpo.table is not None else None
    finally:
        trainer.checkpointer.close()
        trainer.metrics.close()
    return {"grads": grads, "count": float(count), "history": history, "weights": weights, "table": table,
            "mesh": str(trainer.mesh), "loss_parallel": trainer.compute.loss_parallel}


def main() -> None:
    root, pairs = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    runs = {"fsdp2": make_cfg(root, pairs, "fsdp2", local_batch=2, parallelism={"dp_shard": 2}),
            "fsdp2_frozen": make_cfg(root, pairs, "fsdp2_frozen", local_batch=2, parallelism={"dp_shard": 2},
                                     reference="frozen_copy"),
            "tp2": make_cfg(root, pairs, "tp2", parallelism={"tp": 2, "dp_shard": 1})}
    for name, cfg in runs.items():
        out = record(cfg)
        if rank == 0:
            torch.save(out, os.path.join(root, f"{name}.pt"))
            print(f"RUN {name} done: losses {[round(h['loss'], 6) for h in out['history']]}", flush=True)
    from titanlike.distributed.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # (no interpreter teardown: on torch 2.13/gloo a background thread occasionally aborts it)
