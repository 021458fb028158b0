"""torchrun worker for tests/multiproc/test_dist_cp_train.py: context parallel through the real Trainer.

    cp_train_worker.py ROOT pp      4 ranks: CP 2 x PP 2 (1F1B, 2 micro-batches), without and with document masking
                                    (with masking also by the ring and the all-to-all, parallelism.cp_method);
                                    CP 2 x FSDP 2, saving a full checkpoint half-way
    cp_train_worker.py ROOT fsdp2   2 ranks: FSDP 2 resuming from CP 2 x FSDP 2's half-way checkpoint

The runs of FULL_ONLY only with TITANLIKE_TEST_FULL=1 (default_runs()).
Every run starts from the seed checkpoint ROOT/seed and writes ROOT/<run>.json (rank 0): the float history of
Trainer.train() (loss and grad norm per step) and the validation losses. Several Trainers share one process group,
so runs end with `finish()` rather than Trainer.close() (which would destroy the group).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from titanlike.config import load_config
from titanlike.observe.log import setup_logging
from titanlike.train.trainer import Trainer
from tests.launch import full_matrix

STEPS, HALF = 4, 2
# The debug Llama on the embedded stdlib corpus. "." ends a document, so a 32-token window holds several of them (the
# corpus's own end-of-text only falls between whole source files).
COMMON = ["--config", "configs/debug_model.toml", "--training.device=cpu", "--training.seq_len=32",
          f"--training.steps={STEPS}", "--training.global_batch_size=4", "--training.gc_freq=0",
          "--compile.enable=false", "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1",
          "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", "--data.eod_token=.",
          "--validation.enable=true", f"--validation.interval={HALF}", "--validation.steps=2"]
RUNS = {  # name -> (phase, extra flags)
    "cp2pp2": ("pp", ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
                      "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2",
                      "--training.local_batch_size=4"]),
    "cp2pp2_docs": ("pp", ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
                           "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2",
                           "--training.local_batch_size=4", "--data.document_masking=true"]),
    # the other attention methods (parallelism.cp_method) through the same pipeline and documents
    "cp2pp2_docs_ring": ("pp", ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
                                "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2",
                                "--training.local_batch_size=4", "--data.document_masking=true",
                                "--parallelism.cp_method=ring"]),
    "cp2pp2_docs_a2a": ("pp", ["--parallelism.cp=2", "--parallelism.pp=2", "--parallelism.dp_shard=1",
                               "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2",
                               "--training.local_batch_size=4", "--data.document_masking=true",
                               "--parallelism.cp_method=alltoall"]),
    "cp2dp2": ("pp", ["--parallelism.cp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=2",
                      "--checkpoint.enable=true", f"--checkpoint.interval={HALF}"]),
    "resume_fsdp2": ("fsdp2", ["--parallelism.dp_shard=2", "--training.local_batch_size=2"]),
}


# Left to TITANLIKE_TEST_FULL=1: CP 2 x PP 2 without documents (CP without them: cp2dp2; through the pipeline: the
# _docs runs), by the ring (the ring on documents: test_dist_cp.py; cp_method through the Trainer: _a2a), and FSDP 2
# resuming from cp2dp2's checkpoint (resume_one loads it in one process; FSDP resharding: test_dist_checkpoint.py).
FULL_ONLY = ("cp2pp2", "cp2pp2_docs_ring", "resume_fsdp2")


def default_runs() -> list[str]:
    return [name for name in RUNS if full_matrix() or name not in FULL_ONLY]


def config(root: str, name: str, extra: list[str], world_size: int):
    """The run's JobConfig: from the seed checkpoint, or ("resume*") from CP 2 x FSDP 2's half-way one."""
    if name == "seed":
        start = ["--checkpoint.create_seed_checkpoint=true"]
    elif name.startswith("resume"):
        start = [f"--checkpoint.initial_load_path={os.path.join(root, 'cp2dp2', 'checkpoint', f'step-{HALF}')}",
                 "--checkpoint.initial_load_model_only=false"]
    else:
        start = [f"--checkpoint.initial_load_path={os.path.join(root, 'seed', 'checkpoint')}"]
    return load_config([*COMMON, f"--job.dump_folder={root}", f"--job.run_name={name}", *start, *extra],
                       world_size=world_size)


def run(cfg) -> dict:
    """Train; the float history and the validation losses."""
    trainer = Trainer(cfg)
    validations = []
    validate = trainer.validate
    trainer.validate = lambda: validations.append(validate()) or validations[-1]
    try:
        history = trainer.train()
    finally:  # the heartbeat thread too: run in-process it would print into a later test's output
        trainer.close(keep_process_group=True)
    return {"loss": {h["step"]: h["loss"] for h in history}, "grad_norm": {h["step"]: h["grad_norm"] for h in history},
            "validation": validations}


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    setup_logging()
    world = int(os.environ["WORLD_SIZE"])
    for name in default_runs():
        run_phase, extra = RUNS[name]
        if run_phase != phase:
            continue
        out = run(config(root, name, extra, world))
        if dist.get_rank() == 0:
            with open(os.path.join(root, f"{name}.json"), "w") as f:
                json.dump(out, f)
            print(f"RUN_OK {name}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
