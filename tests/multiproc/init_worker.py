"""torchrun worker for tests/multiproc/test_dist_init.py: the initial weights of the real Trainer under many layouts.

    init_worker.py ROOT   (4 ranks) every run of RUNS in turn, one Trainer each, on one process group

For each run: build the Trainer (its init runs under titanlike.distributed.seeded_init), gather every parameter's full
value (DTensor.full_tensor() on its own mesh, then all ranks' copies to rank 0, which checks that the ranks holding
the same parameter agree), then train one step. Rank 0 writes ROOT/<run>.pt: {"params": {fqn: tensor}, "loss": step
1's loss}. The single-process reference runs in the pytest process with the same `config()`.

seeded_init.BLOCK_NUMEL is lowered to BLOCK_NUMEL (here and in the reference), so the weights are drawn in many dim-0
blocks and the layouts exercise skipping the blocks a rank does not hold.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlike.config import load_config
from titanlike.distributed import seeded_init
from titanlike.observe.log import setup_logging
from titanlike.train.trainer import Trainer

BLOCK_NUMEL = 4096  # 16 rows of a 256-wide weight, one expert of the MoE's stacked experts
CONFIGS = {"llama3": "configs/debug_model.toml", "deepseek_v3": "configs/deepseek_v3_debug.toml"}
COMMON = ["--training.device=cpu", "--training.seq_len=32", "--training.steps=1", "--training.global_batch_size=4",
          "--training.gc_freq=0", "--compile.enable=false", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
          "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", "--validation.enable=false",
          "--training.seed=7"]
RUNS = {  # name -> (family, flags); 4 ranks each
    # (FSDP 4 alone: deepseek_v3_ep2fsdp4's dense parameters)
    "llama3_hsdp2x2": ("llama3", ["--parallelism.dp_replicate=2", "--parallelism.dp_shard=2",
                                  "--training.local_batch_size=1"]),
    "llama3_tp2fsdp2": ("llama3", ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=2"]),
    "llama3_pp2tp2": ("llama3", ["--parallelism.pp=2", "--parallelism.tp=2", "--parallelism.dp_shard=1",
                                 "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2",
                                 "--training.local_batch_size=4"]),
    "llama3_cp2fsdp2": ("llama3", ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=2"]),
    "deepseek_v3_ep2fsdp4": ("deepseek_v3", ["--parallelism.dp_shard=4", "--parallelism.ep=2",
                                             "--training.local_batch_size=1"]),
    "deepseek_v3_tp2ep2": ("deepseek_v3", ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                                           "--training.local_batch_size=2"]),
    "deepseek_v3_pp2ep2": ("deepseek_v3", ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                                           "--parallelism.pp_microbatches=2", "--training.local_batch_size=2"]),
}


def config(root: str, name: str, family: str, extra: list[str], world_size: int):
    return load_config(["--config", CONFIGS[family], *COMMON, f"--job.dump_folder={root}", f"--job.run_name={name}",
                        *extra], world_size=world_size)


def local_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """{fqn: full value} of this rank's model parts (full_tensor(): a collective on each parameter's mesh, called in
    the same order by every rank of that mesh)."""
    out = {}
    for part in trainer.model_parts:
        for fqn, p in part.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[fqn] = full.detach().cpu().clone()
    return out


def gather_params(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """On rank 0, every parameter of the model; every rank's copy of a parameter is checked equal to the first."""
    mine = local_params(trainer)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(gathered):
        for fqn, value in params.items():
            if fqn in merged:
                assert torch.equal(merged[fqn], value), f"rank {rank} holds another {fqn} than a lower rank"
            else:
                merged[fqn] = value
    return merged


def main() -> None:
    root = sys.argv[1]
    torch.set_num_threads(1)
    setup_logging()
    seeded_init.BLOCK_NUMEL = BLOCK_NUMEL
    world = int(os.environ["WORLD_SIZE"])
    for name, (family, extra) in RUNS.items():
        trainer = Trainer(config(root, name, family, extra, world))
        try:
            params = gather_params(trainer)
            history = trainer.train()
        finally:  # the heartbeat too; the next run reuses the process group
            trainer.close(keep_process_group=True)
        if dist.get_rank() == 0:
            torch.save({"params": params, "loss": history[0]["loss"]}, os.path.join(root, f"{name}.pt"))
            print(f"RUN_OK {name} loss {history[0]['loss']:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
