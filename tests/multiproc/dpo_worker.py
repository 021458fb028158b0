"""torchrun worker for test_dist_dpo.py: DPO under data, tensor, pipeline and context parallelism, against one process.

    dpo_worker.py ROOT PAIRS      (2 processes) runs, one after the other in the same process group:
        fsdp2         dp_shard 2, 2 pairs per rank, precomputed reference (each rank a share of the pass)
        fsdp2_frozen  the same with the frozen copy (FSDP-sharded too)
        tp2           tensor parallel 2 (vocabulary-sharded logits: the log-probs under loss parallel), 4 pairs
        pp2           pipeline parallel 2 (1F1B, 2 micro-batches of 2 pairs), precomputed reference through the
                      pipeline; pp2_lora the same with LoRA adapters (the reference: the base without them);
                      pp2_frozen with the frozen copy cut into stages; pp2_zbv ZBVZeroBubble (2 stages per rank, the
                      last one on rank 0), 4 micro-batches of one pair
        cp2           context parallel 2 (each rank holds chunks of every sequence), precomputed reference; cp2_lora
                      with LoRA; cp2_frozen with the frozen copy
        *_pack        packed rows (data.preference_layout="pack", sequences of 24 tokens, 4 rows per step):
                      fsdp2_pack (2 rows per rank), fsdp2_pack_frozen, tp2_pack, pp2_pack (2 micro-batches of 2 rows),
                      cp2_pack, against the one-process packed run
Each run records the step-1 gradients (full tensors, from an explicit forward/backward of the first step's batches;
under PP through the schedule, every stage's gathered on rank 0), the losses of 3 steps, the final weights and the
reference table; rank 0 saves them to ROOT/<name>.pt. The pytest side runs `record` in one process on the same pairs
and compares.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlike.config.load import config_from_dict
from titanlike.train.trainer import Trainer

STEPS = 3


PACK = {"preference_layout": "pack", "document_masking": True, "reset_position_ids": True}


def make_cfg(root: str, pairs: str, name: str, *, local_batch: int = 4, parallelism: dict | None = None,
             reference: str = "precompute", lora: bool = False, packed: bool = False):
    """4 pairs per step (global), sequences of 16 tokens, fp32 on CPU; lora: rank-4 adapters on every Linear;
    packed: 4 rows of 24 tokens per step, each holding whole pairs."""
    return config_from_dict({
        "job": {"dump_folder": root, "run_name": name},
        "model": {"flavor": "debugmodel"},
        "training": {"steps": STEPS, "seq_len": 24 if packed else 16, "local_batch_size": local_batch,
                     "device": "cpu", "deterministic": True, "gc_freq": 0, "max_norm": 0.5},
        "data": {"dataset": "preference", "paths": [pairs], "tokenizer_type": "NullTokenizer",
                 "builtin_vocab_size": 127, **(PACK if packed else {})},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay_type": "constant"},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": parallelism or {},
        "dpo": {"reference": reference},
        "lora": {"enable": lora, "rank": 4, "alpha": 8.0},
    })


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _params(trainer) -> list:
    """(FQN, parameter) of this rank's model parts (the whole model without PP)."""
    return [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]


def _over_pipeline(trainer, local: dict) -> dict:
    """Under PP, every pipeline rank's entries (each holds its stages' parameters, full-model FQNs) joined."""
    if trainer.pp is None:
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def record(cfg) -> dict:
    """Step-1 gradients, 3 steps' losses and metrics, final weights, the reference table."""
    trainer = Trainer(cfg)
    try:
        trainer.checkpointer.load()
        trainer.dpo.start()
        batches = trainer.next_batches(iter(trainer.dataloader))
        count = trainer.sum_over_data(sum(b.target_count() for b in batches).float())
        scale = trainer.grad_divide_factor / count
        if trainer.pp is not None:  # through the schedule (the loss on the last stage), as a training step
            with trainer.attention_kernels(), trainer.loss_context(), trainer.amp:
                trainer.pp.step(batches, scale)
        else:
            for b in batches:
                trainer.compute.forward_backward(trainer.model, b, scale)
        grads = _over_pipeline(trainer, {n: _full(p.grad) for n, p in _params(trainer) if p.grad is not None})
        for part in trainer.model_parts:
            part.zero_grad(set_to_none=True)
        history = trainer.train()  # (a fresh iterator: the loader starts again at the first batch)
        weights = _over_pipeline(trainer, {n: _full(p) for n, p in _params(trainer)})
        table = trainer.dpo.table.state_dict() if trainer.dpo.table is not None else None
    finally:  # the heartbeat thread too: run in-process it would print into a later test's output
        trainer.close(keep_process_group=True)
    return {"grads": grads, "count": float(count), "history": history, "weights": weights, "table": table,
            "mesh": str(trainer.mesh), "loss_parallel": trainer.compute.loss_parallel}


def main() -> None:
    root, pairs = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    pp2 = {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B", "pp_microbatches": 2}
    zbv = {"pp": 2, "dp_shard": 1, "pp_schedule": "ZBVZeroBubble", "pp_microbatches": 4}
    cp2 = {"cp": 2, "dp_shard": 1}
    runs = {"fsdp2": make_cfg(root, pairs, "fsdp2", local_batch=2, parallelism={"dp_shard": 2}),
            "fsdp2_frozen": make_cfg(root, pairs, "fsdp2_frozen", local_batch=2, parallelism={"dp_shard": 2},
                                     reference="frozen_copy"),
            "tp2": make_cfg(root, pairs, "tp2", parallelism={"tp": 2, "dp_shard": 1}),
            "pp2": make_cfg(root, pairs, "pp2", parallelism=pp2),
            "pp2_lora": make_cfg(root, pairs, "pp2_lora", parallelism=pp2, lora=True),
            "pp2_frozen": make_cfg(root, pairs, "pp2_frozen", parallelism=pp2, reference="frozen_copy"),
            "pp2_zbv": make_cfg(root, pairs, "pp2_zbv", parallelism=zbv),
            "cp2": make_cfg(root, pairs, "cp2", parallelism=cp2),
            "cp2_lora": make_cfg(root, pairs, "cp2_lora", parallelism=cp2, lora=True),
            "cp2_frozen": make_cfg(root, pairs, "cp2_frozen", parallelism=cp2, reference="frozen_copy"),
            "fsdp2_pack": make_cfg(root, pairs, "fsdp2_pack", local_batch=2, parallelism={"dp_shard": 2},
                                   packed=True),
            "fsdp2_pack_frozen": make_cfg(root, pairs, "fsdp2_pack_frozen", local_batch=2,
                                          parallelism={"dp_shard": 2}, reference="frozen_copy", packed=True),
            "tp2_pack": make_cfg(root, pairs, "tp2_pack", parallelism={"tp": 2, "dp_shard": 1}, packed=True),
            "pp2_pack": make_cfg(root, pairs, "pp2_pack", parallelism=pp2, packed=True),
            "cp2_pack": make_cfg(root, pairs, "cp2_pack", parallelism=cp2, packed=True)}
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # (a subset: test_dist_dpo.py's default)
    runs = {k: v for k, v in runs.items() if only is None or k in only}
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
