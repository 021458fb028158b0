"""torchrun worker for test_dist_model_contract.py: train a model family that lives only in tests/toy_family.

    toy_family_worker.py ROOT reference   (1 process) seed checkpoint of the toy model, then a 1-process run from it
    toy_family_worker.py ROOT fsdp        (2 processes) the same run from the same seed under FSDP (dp_shard=-1)

The family is registered here, at start, the way a user's launcher could: `models.MODELS["toy"] = SPEC`; nothing in
models/, parallelize/ or titanlike/ knows it. Checks that need the live trainer assert here (a failure exits non-zero);
rank 0 writes ROOT/<phase>.json (losses, grad norms, the logged throughput metrics, the counts the trainer used and
its log lines) for the pytest side to compare across phases.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import torch

import models
import toy_models  # tests/toy_family, put on PYTHONPATH by the test

models.MODELS["toy"] = toy_models.SPEC  # the only registration: no library file lists this family

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from titanlike.config.load import config_from_dict  # noqa: E402
from titanlike.config.validate import validate  # noqa: E402
from titanlike.observe.log import setup_logging  # noqa: E402
from titanlike.train.trainer import Trainer  # noqa: E402

STEPS = 10
SEQ = 32
LOCAL_BATCH = 2
GLOBAL_BATCH = 4  # the 1-process reference accumulates 2 micro-batches of 2; FSDP 2 takes 2 per rank


def make_cfg(root: str, name: str, *, seed: int = 0, checkpoint: dict | None = None):
    cfg = config_from_dict({
        "job": {"dump_folder": root, "run_name": name},
        "model": {"name": "toy", "flavor": "tiny"},  # vocab from the tokenizer
        "training": {"steps": STEPS, "seq_len": SEQ, "local_batch_size": LOCAL_BATCH,
                     "global_batch_size": GLOBAL_BATCH, "device": "cpu", "gc_freq": 0, "seed": seed,
                     "max_norm": 1.0},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 2},
        "data": {"dataset": "stdlib", "tokenizer": "builtin"},  # real text: the loss has something to learn
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": {"dp_shard": -1},
        "checkpoint": checkpoint or {},
    })
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # the config loader's rules, as load_config applies them
    return cfg


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def finish(trainer: Trainer) -> None:
    """End a run without destroying the process group (the next Trainer of this process reuses it)."""
    trainer.checkpointer.close()
    trainer.metrics.close()


def seed_path(root: str) -> str:
    return os.path.join(root, "seed", "checkpoint")


def check_fsdp_layout(trainer: Trainer) -> None:
    """The toy plan ran: every parameter a DTensor sharded over the 2 ranks, one FSDP group per block, the
    embeddings and the head in their own groups."""
    model = trainer.model
    assert isinstance(model, FSDPModule), type(model)
    for name in ("wte", "ln_f"):  # the first module of each list group carries the FSDP state
        assert isinstance(getattr(model, name), FSDPModule), name
    assert all(isinstance(b, FSDPModule) for b in model.layers.values())
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == 2, n


def train(root: str, name: str, expect_fsdp: bool) -> dict:
    lines = _Lines()
    logging.getLogger("titanlike").addHandler(lines)
    trainer = Trainer(make_cfg(root, name, checkpoint={"initial_load_path": seed_path(root)}))
    try:
        spec, args = toy_models.SPEC, trainer.model_args
        # The trainer read the family only through its spec: the spec, its args class and its counts.
        assert trainer.spec is spec and type(args) is toy_models.ToyArgs, (trainer.spec, type(args))
        assert isinstance(trainer.model, toy_models.ToyDecoder), type(trainer.model)  # (FSDP subclasses it)
        assert trainer.flops_per_token == spec.flops_per_token(args, SEQ) == trainer.metrics.flops_per_token
        assert trainer.dims.fsdp_enabled == expect_fsdp
        if expect_fsdp:
            check_fsdp_layout(trainer)
        history = trainer.train()
    finally:
        finish(trainer)
        logging.getLogger("titanlike").removeHandler(lines)
    counts = spec.param_counts(args)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trainer.model.parameters())
    return {
        "history": history,
        "args": {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")},
        "counts": {"total": counts.total, "active": counts.active, "embedding": counts.embedding},
        "flops_per_token": trainer.flops_per_token,
        "spec_flops_per_token": spec.flops_per_token(args, SEQ),
        "local_params": local,
        "log": lines.lines,
    }


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    setup_logging()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = {"world": world}
    if phase == "reference":
        assert world == 1, world
        # another init seed than the runs': a run that failed to load the seed would show it in its loss
        seed = Trainer(make_cfg(root, "seed", seed=1, checkpoint={"create_seed_checkpoint": True}))
        try:
            seed.checkpointer.save_seed()
        finally:
            finish(seed)
        out["run"] = train(root, "reference", expect_fsdp=False)
    elif phase == "fsdp":
        assert world == 2, world
        out["run"] = train(root, "fsdp", expect_fsdp=True)
        t = torch.tensor([out["run"]["local_params"]])
        torch.distributed.all_reduce(t)
        out["local_params_all_ranks"] = int(t.item())
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(root, f"{phase}.json"), "w") as f:
            json.dump(out, f)
    from titanlike.distributed.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":  # the async checkpoint writer (spawn) would re-import this file: run nothing then
    main()
    # Skip interpreter teardown after a clean finish: on this torch/gloo a background thread occasionally aborts it
    # ("terminate called without an active exception"), turning a passed run into a failure.
    sys.stdout.flush()
    os._exit(0)
