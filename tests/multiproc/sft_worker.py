"""torchrun worker for test_dist_lora.py: supervised fine-tuning through the Trainer under each layout, full and LoRA,
dense (the tiny Llama) and MoE (Qwen3's MoE debug flavor, with LoRA on the routed experts too), on the shipped chat
file (assistant-only labels, packed with document masking and restarted positions).

RUNS[world] lists the runs of a launch of `world` ranks: the 2-rank ones ride in lora_worker.py's launch (its main
calls sft_runs), the 4-rank ones (HSDP, CP 2 x FSDP 2, EP 2 x CP 2) are this file's own launch:

    sft_worker.py ROOT      (4 ranks)

Each run starts from the seeded init (the same weights on every layout) and trains 3 steps on a global batch of 4
rows; before training, check_layout asserts that the layout was built as named (CP's share of the rows, HSDP's 2-D
mesh, the experts and their adapters sharded over ep and, where they have replicas, FSDP over those). Rank 0 writes
ROOT/sft_<world>.json, {run: [{step, loss, grad_norm}]}, and prints "CHECK sft_layouts_<world> ok ...";
test_dist_lora.py runs each run's reference (REFERENCES) in one process and holds the runs to it.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from models.common.lora import is_adapter_key
from par_helpers import exit_without_teardown
from parallelize.ep import ep_experts

# The MoE family: Qwen3's MoE debug flavor (softmax top-2 of 8 experts, the Switch load-balancing loss) cut to 2
# blocks. Its balance loss is a statistic of each data-parallel rank's rows, so its one-process references accumulate
# micro-batches of the same rows: local batch 2, the data-parallel share of every MoE run below (dp degree 2).
MOE_MODEL = {"name": "qwen3", "flavor": "debugmodel_moe",
             "args": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16}}
DENSE_MODEL = {"flavor": "debugmodel", "args": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                                "multiple_of": 32}}
LORA = {"enable": True, "rank": 4, "alpha": 8.0}
MOE_LORA = {**LORA, "target_modules": ["wq", "wk", "wv", "wo", "experts"], "include_experts": True}

# The one-process runs the layouts must equal: sft_cfg's keywords.
REFERENCES = {"dense": {}, "lora": {"lora": LORA}, "moe": {"model": MOE_MODEL, "local_batch": 2},
              "moe_lora": {"model": MOE_MODEL, "local_batch": 2, "lora": MOE_LORA}}
_PP = {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B", "pp_microbatches": 2}
# world size -> {run: (its reference, [parallelism], the local batch for the global batch of 4)}
RUNS = {
    2: {"fsdp2": ("dense", {"dp_shard": 2}, 2),
        "tp2": ("dense", {"tp": 2, "dp_shard": 1}, 4),
        "pp2": ("dense", _PP, 4),
        "cp2": ("dense", {"cp": 2, "dp_shard": 1}, 4),
        "lora_cp2": ("lora", {"cp": 2, "dp_shard": 1}, 4),
        "moe_ep2": ("moe", {"dp_shard": 2, "ep": 2}, 2),  # experts without replicas: EP's gradient scale
        "moe_lora_ep2": ("moe_lora", {"dp_shard": 2, "ep": 2}, 2)},
    4: {"hsdp": ("dense", {"dp_replicate": 2, "dp_shard": 2}, 1),
        "cp2_fsdp2": ("dense", {"cp": 2, "dp_shard": 2}, 2),
        "lora_cp2_fsdp2": ("lora", {"cp": 2, "dp_shard": 2}, 2),
        # the experts FSDP-sharded over their CP replicas (parallelize/ep.py's fsdp_experts), adapters included
        "moe_ep2_cp2": ("moe", {"dp_shard": 2, "cp": 2, "ep": 2}, 2),
        "moe_lora_ep2_cp2": ("moe_lora", {"dp_shard": 2, "cp": 2, "ep": 2}, 2)},
}


def sft_cfg(root: str, name: str, parallelism: dict | None = None, local_batch: int = 4, model: dict | None = None,
            lora: dict | None = None):
    """A 3-step SFT run of a tiny model (default: the Llama) on the shipped chat file with the built-in ChatML
    template, packed: rows of 256 tokens hold two to four conversations (then end-of-document padding), so documents
    end inside context parallel's chunks; `lora`: the [lora] section (LoRA SFT). Validated for this world size."""
    from titanlike.config.load import config_from_dict
    from titanlike.config.validate import validate

    chat = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit", "data",
                        "chat_tiny.jsonl")
    cfg = config_from_dict({
        "job": {"dump_folder": root, "run_name": f"sft_{name}"},
        "model": model or DENSE_MODEL,
        "training": {"steps": 3, "seq_len": 256, "local_batch_size": local_batch, "global_batch_size": 4,
                     "device": "cpu", "max_norm": 1.0, "gc_freq": 0},
        "optimizer": {"lr": 1e-2}, "lr_scheduler": {"warmup_steps": 1},
        "data": {"dataset": "chat", "paths": [chat], "chat_template": "chatml", "sft_layout": "pack",
                 "document_masking": True, "reset_position_ids": True},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": {"dp_shard": -1, **(parallelism or {})},
        "lora": lora or {},
    })
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def train(cfg, check=None) -> list[dict]:
    """The run's logged (step, loss, grad_norm), LoRA or not; `check(trainer)` first. The process group stays for the
    next Trainer."""
    from titanlike.optim.container import optimizers_of
    from titanlike.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        for part in trainer.model_parts:  # LoRA: the base stays frozen through the plan; only adapters train
            assert all(p.requires_grad == (is_adapter_key(n) or not cfg.lora.enable)
                       for n, p in part.named_parameters()), cfg.job.run_name
        held = {id(p) for o in optimizers_of(trainer.optimizer) for g in o.param_groups for p in g["params"]}
        assert held == {id(p) for part in trainer.model_parts for p in part.parameters() if p.requires_grad}
        if check is not None:
            check(trainer)
        return [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in trainer.train()]
    finally:  # the heartbeat thread stopped too (it would outlive the run inside pytest); the group stays
        trainer.close(keep_process_group=True)


def check_layout(trainer, par: dict, lora: dict | None) -> None:
    """The layout `par` was built as it says (module doc)."""
    dims, name = trainer.dims, trainer.cfg.job.run_name
    if par.get("cp", 1) > 1:  # each CP rank trains on its share of every row
        assert trainer.batch_layout.cp == (dims.get_mesh("cp").get_local_rank(), par["cp"]), name
    if par.get("dp_replicate", 1) > 1:
        assert dims.fsdp_mesh.ndim == 2, (name, dims.fsdp_mesh)  # HSDP: shard within a row, replicate across
    experts = [m for part in trainer.model_parts for m in ep_experts(part)]
    assert len(experts) == (2 if par.get("ep", 1) > 1 else 0), (name, len(experts))
    for mod in experts:
        params = {f"experts.{n}": p for n, p in mod.named_parameters()}
        adapters = {n for n in params if is_adapter_key(n)}
        assert len(adapters) == (6 if lora and "experts" in lora["target_modules"] else 0), (name, adapters)
        for n, p in params.items():  # experts and adapters alike: E / ep experts here, FSDP over replicas
            assert isinstance(p, DTensor) and p.requires_grad == (n in adapters or not lora), (name, n)
            assert p.to_local().numel() * par["ep"] * mod.ep_replicas == p.numel(), (name, n, p.placements)
            assert Shard(0) in p.placements, (name, n, p.placements)


def sft_runs(root: str, world: int) -> None:
    """RUNS[world] through the Trainer; rank 0 writes ROOT/sft_<world>.json (module doc)."""
    out = {}
    for name, (ref, parallelism, local_batch) in RUNS[world].items():
        kw = {**REFERENCES[ref], "local_batch": local_batch}
        out[name] = train(sft_cfg(root, name, parallelism, **kw),
                          check=lambda t, par=parallelism, lora=kw.get("lora"): check_layout(t, par, lora))
    if dist.get_rank() == 0:
        with open(os.path.join(root, f"sft_{world}.json"), "w") as f:
            json.dump(out, f)
        print(f"CHECK sft_layouts_{world} ok " + " ".join(f"{k}={[round(h['loss'], 6) for h in v]}"
                                                        for k, v in out.items()), flush=True)


def main() -> None:
    from titanlike.distributed.init import destroy_distributed, init_distributed

    rank, world, _ = init_distributed("cpu", timeout_s=120)
    torch.set_num_threads(1)
    sft_runs(sys.argv[1], world)
    dist.barrier()
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    exit_without_teardown(main())
