"""torchrun worker for tests/multiproc/test_dist_checkpoint.py: real Trainer runs that save, stop and resume.

    checkpoint_worker.py ROOT first      A: FSDP 2, 6 steps from the seed checkpoint, sync saves every 2 steps
                                         B: same run, async_with_pinned_mem saves, stopped after step 4
                                         PP2 (if CKPT_TEST_PP=1): pipeline 2 from the seed, stopped after step 4
    checkpoint_worker.py ROOT resume     B again in fresh processes (async saves): resumes at step 5, runs to 6;
                                         plus, when the llama3 plan accepts tp > 1: A's step 4 loaded under TP 2;
                                         PP2's step 4 loaded under FSDP 2
    checkpoint_worker.py ROOT tp4        A's step 4 loaded under FSDP 2 x TP 2 (4 processes)

Each phase writes ROOT/<phase>.json (rank 0): the loss of every step of every run, and the checkpoint stats.
Several Trainers share one process group here, so runs end with `finish()` rather than Trainer.close() (which would
destroy the group).
"""
from __future__ import annotations

import json
import os
import sys

import torch

from titanlike.config.load import config_from_dict
from titanlike.observe.log import setup_logging
from titanlike.train.trainer import Trainer

STEPS = 6


def make_cfg(root: str, name: str, *, local_batch: int = 2, checkpoint: dict | None = None,
             parallelism: dict | None = None, deterministic: bool = True, seed: int = 0):
    """The tiny run every layout shares: global batch 4 sequences of 16 tokens, mock data, fp32 on CPU."""
    return config_from_dict({
        "job": {"dump_folder": root, "run_name": name},
        "model": {"flavor": "debugmodel", "vocab_size": 256},
        "training": {"steps": STEPS, "seq_len": 16, "local_batch_size": local_batch, "device": "cpu",
                     "deterministic": deterministic, "gc_freq": 0, "seed": seed},
        "data": {"dataset": "mock"},
        "lr_scheduler": {"warmup_steps": 2},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "checkpoint": {"enable": True, "interval": 2, **(checkpoint or {})},
        "parallelism": parallelism or {},
    })


def finish(trainer: Trainer) -> None:
    trainer.close(keep_process_group=True)  # heartbeat included: the next run reuses the process group


def run(cfg, stop_after: int | None = None) -> dict:
    trainer = Trainer(cfg)
    if stop_after is not None:  # "stop the process" after this step: the LR schedule already has the full length
        trainer.cfg.training.steps = stop_after
    try:
        history = trainer.train()
    finally:
        finish(trainer)
    return {"losses": {h["step"]: h["loss"] for h in history}, "stats": trainer.checkpointer.stats}


def seed_path(root: str) -> str:
    return os.path.join(root, "seed", "checkpoint")


def a_step4(root: str) -> str:
    return os.path.join(root, "A", "checkpoint", "step-4")


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    setup_logging()
    out = {}
    if phase == "first":
        out["A"] = run(make_cfg(root, "A", checkpoint={"initial_load_path": seed_path(root)}))
        out["B"] = run(make_cfg(root, "B", checkpoint={"initial_load_path": seed_path(root), "keep_latest_k": 1,
                                                       "async_mode": "async_with_pinned_mem"}), stop_after=4)
        if os.environ.get("CKPT_TEST_PP") == "1":
            out["PP2"] = run(make_cfg(root, "PP2", local_batch=4, parallelism={"pp": 2, "dp_shard": 1},
                                      checkpoint={"initial_load_path": seed_path(root)}), stop_after=4)
    elif phase == "resume":
        out["B"] = run(make_cfg(root, "B", checkpoint={"async_mode": "async", "keep_latest_k": 1}))
        if os.environ.get("CKPT_TEST_TP") == "1":
            out["TP2"] = run(make_cfg(root, "TP2", local_batch=4, parallelism={"tp": 2, "dp_shard": 1}, checkpoint={
                "initial_load_path": a_step4(root), "initial_load_model_only": False}))
        if os.environ.get("CKPT_TEST_PP") == "1":
            out["PP2toFSDP2"] = run(make_cfg(root, "PP2toFSDP2", checkpoint={
                "initial_load_path": os.path.join(root, "PP2", "checkpoint"), "initial_load_model_only": False}))
    elif phase == "tp4":
        out["FSDP2xTP2"] = run(make_cfg(root, "FSDP2xTP2", parallelism={"tp": 2, "dp_shard": 2}, checkpoint={
            "initial_load_path": a_step4(root), "initial_load_model_only": False}))
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(root, f"{phase}.json"), "w") as f:
            json.dump(out, f)
    from titanlike.distributed.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":  # the async writer process (spawn) re-imports this file: run nothing then
    main()
    # Skip interpreter teardown after a clean finish: on this torch/gloo a background thread occasionally
    # aborts it ("terminate called without an active exception"), turning a passed run into a failure.
    sys.stdout.flush()
    os._exit(0)

