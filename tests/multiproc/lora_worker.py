"""torchrun worker (2 processes) for test_dist_lora.py: LoRA under FSDP 2 and TP 2 against a one-process reference
(gloo, fp32, 1e-5).

Every layout builds the tiny Llama of par_helpers on meta, swaps in LoRA adapters on all seven projections
(models/common/lora.py), applies the family's default plan and initialises through the trainer's materialise (seeded:
the same weights on every layout, adapters included: A kaiming-uniform, B zeros). Then STEPS AdamW steps (titanlike's
optimizer, so only the adapters are in it; clipped by titanlike's clip) on the same global batches; per step the loss,
the grad norm and every adapter gradient (whole tensors) must equal the reference's, and afterwards the adapters too,
while the base stays bitwise what it was. Under TP the adapters must be sharded as parallelize/lora.py says; the
adapter-only state dict (what lora.save_adapter_only checkpoints) holds exactly the adapters, whole.

Then the Trainer itself (trainer_cfg: a LoRA run of 4 steps): under PP 2 (1F1B, 2 micro-batches) and under FSDP 2,
which saves adapter-only steps 2 and 4 and is resumed from step 2 by a new Trainer (steps 3-4 repeat exactly); rank 0
writes their losses and grad norms to ROOT/trainers.json, which test_dist_lora.py holds to a one-process run of the
same config. Last, the 2-rank supervised fine-tuning runs of sft_worker.py (RUNS[2]) ride in this launch. Rank 0
prints one "CHECK <name> ok ..." line per case and "ALL CHECKS PASSED".
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from models.common.lora import LoraLinear, apply_lora, is_adapter_key
from par_helpers import exit_without_teardown, global_batch, meta_model
from parallelize import PlanSections, get_plan
from sft_worker import sft_runs, train
from titanlike.config.sections import JobConfig, Optimizer
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.optim.adamw import build_optimizer, clip_grad_norm_
from titanlike.train.construct import materialise

TOL = 1e-5
STEPS = 3
LOCAL_BATCH = 2
MAX_NORM = 0.5
TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]
CPU = torch.device("cpu")
rank = world = 0


def report(name: str, detail: str = "") -> None:
    if rank == 0:
        print(f"CHECK {name} ok {detail}", flush=True)


def lora_model(dims=None, cfg: JobConfig | None = None) -> torch.nn.Module:
    """The tiny Llama with rank-4 adapters; planned for `dims` (None: the one-process reference), materialised."""
    model = meta_model()
    apply_lora(model, TARGETS, rank=4, alpha=8.0)
    if dims is not None:
        model = get_plan("llama3", "default")(model, dims, PlanSections.of(cfg))
    materialise([model], CPU, seed=0)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def check_tp_layout(name: str, model: torch.nn.Module, sp: bool) -> None:
    """Colwise bases (wq, wk, wv, w1, w3): weight and lora_B Shard(0), lora_A replicated; rowwise (wo, w2): weight
    and lora_A Shard(1), lora_B replicated. The base stays frozen, the adapters train."""
    colwise = {"wq", "wk", "wv", "w1", "w3"}
    n = 0
    for fqn, m in model.named_modules():
        if not isinstance(m, LoraLinear):
            continue
        col = fqn.rsplit(".", 1)[-1] in colwise
        want = {"weight": Shard(0) if col else Shard(1), "lora_A.weight": Replicate() if col else Shard(1),
                "lora_B.weight": Shard(0) if col else Replicate()}
        for pname, placement in want.items():
            p = m.get_parameter(pname)
            assert isinstance(p, DTensor) and p.placements == (placement,), (name, fqn, pname, p.placements)
            assert p.requires_grad == (pname != "weight"), (name, fqn, pname, p.requires_grad)
        n += 1
    assert n == 14, (name, n)


def run_case(name: str, dims_kw: dict, sp: bool = True, lp: bool = True, ac: str = "none") -> None:
    dims = ParallelDims(**dims_kw, world_size=world)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.parallelism.enable_sequence_parallel, cfg.parallelism.enable_loss_parallel = sp, lp
    cfg.activation_checkpoint.mode = ac
    lp = lp and dims.tp_enabled
    ref, model = lora_model(), lora_model(dims, cfg)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()], f"{name}: FQNs"
    if dims.tp_enabled:
        check_tp_layout(name, model, sp)
    if dims.fsdp_enabled:  # FSDP2 shards the frozen base and the adapters alike; the flags survive
        for n, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), (name, n, p)
            assert p.requires_grad == is_adapter_key(n), (name, n)
    base = {n: _full(p.detach()).clone() for n, p in model.named_parameters() if not p.requires_grad}
    for n, p in ref.named_parameters():  # the seeded init: the same weights on both layouts, bitwise
        assert torch.equal(_full(dict(model.named_parameters())[n].detach()), p.detach()), f"{name}: init of {n}"
    opt_cfg = Optimizer(lr=1e-2, weight_decay=0.1)
    ref_opt, opt = build_optimizer(ref, opt_cfg, CPU), build_optimizer(model, opt_cfg, CPU)
    n_adapters = sum(len(g["params"]) for g in opt.param_groups)
    assert n_adapters == 28 == sum(len(g["params"]) for g in ref_opt.param_groups), f"{name}: {n_adapters} in AdamW"

    dp_rank, dp = dims.dp_rank(), dims.dp_degree
    worst_loss = worst_grad = 0.0
    for step in range(STEPS):
        inputs, labels = global_batch(step, dp * LOCAL_BATCH)
        n_tokens = labels.numel()
        ref_loss = ce_sum(ref(inputs), labels) / n_tokens
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
        assert set(ref_grads) == {n for n in ref_grads if is_adapter_key(n)} and len(ref_grads) == 28
        ref_norm = clip_grad_norm_(list(ref.parameters()), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()

        rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = _full(ce_sum(model(inputs[rows]), labels[rows]))
            (loss * dp / n_tokens).backward()  # FSDP averages over dp: the trainer's scaling to the global mean
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(ref_grads), f"{name}: gradients on {sorted(set(grads) ^ set(ref_grads))}"
        for n, g in grads.items():
            d = (g - ref_grads[n]).abs().max().item()
            assert d <= TOL, f"{name} step {step}: the gradient of {n} differs from the reference by {d}"
            worst_grad = max(worst_grad, d)
        norm = clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dims.get_mesh("dp_cp") is not None:
            dist.all_reduce(total, group=dims.get_mesh("dp_cp").get_group())
        diff = abs(total.item() / n_tokens - ref_loss.item())
        assert diff <= TOL, f"{name} step {step}: loss {total.item() / n_tokens} vs {ref_loss.item()}"
        assert abs(norm.item() - ref_norm.item()) <= TOL, f"{name} step {step}: grad norm {norm} vs {ref_norm}"
        worst_loss = max(worst_loss, diff)
    b_norm = max(_full(p.detach()).abs().max().item() for n, p in model.named_parameters() if "lora_B" in n)
    assert b_norm > 1e-3, f"{name}: lora_B still ~0 after {STEPS} steps ({b_norm}): the check would be vacuous"

    ref_params = dict(ref.named_parameters())
    worst_param = 0.0
    for n, p in model.named_parameters():
        full = _full(p.detach())
        if n in base:
            assert torch.equal(full, base[n]), f"{name}: the frozen {n} changed"
        d = (full - ref_params[n].detach()).abs().max().item()
        assert d <= TOL, f"{name}: parameter {n} differs from the reference by {d}"
        worst_param = max(worst_param, d)
    # What an adapter-only checkpoint holds (the manager's state dict): the 28 adapters, whole, as the reference's
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True, full_state_dict=True))
    assert sorted(sd) == sorted(n for n in ref_params if is_adapter_key(n)), f"{name}: adapter-only keys {sorted(sd)}"
    for k, v in sd.items():
        assert (v - ref_params[k].detach()).abs().max().item() <= TOL, f"{name}: state dict {k}"
    report(name, f"loss_diff={worst_loss:.1e} grad_diff={worst_grad:.1e} param_diff={worst_param:.1e} "
                 f"max|B|={b_norm:.2e}")


def trainer_cfg(root: str, name: str, parallelism: dict | None = None, local_batch: int = 4,
                checkpoint: dict | None = None):
    """A 4-step LoRA run of the tiny Llama on mock data (global batch 4), validated for this world size."""
    from titanlike.config.load import config_from_dict
    from titanlike.config.validate import validate

    cfg = config_from_dict({
        "job": {"dump_folder": root, "run_name": name},
        "model": {"flavor": "debugmodel", "vocab_size": 128,
                  "args": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32}},
        "training": {"steps": 4, "seq_len": 16, "local_batch_size": local_batch, "global_batch_size": 4,
                     "device": "cpu", "max_norm": 1.0, "gc_freq": 0},
        "optimizer": {"lr": 1e-2}, "data": {"dataset": "mock"}, "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": {"dp_shard": -1, **(parallelism or {})},
        "checkpoint": checkpoint or {},
        "lora": {"enable": True, "rank": 4, "alpha": 8.0},
    })
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def trainer_cases(root: str) -> None:
    out = {"pp2": train(trainer_cfg(root, "pp2", {"pp": 2, "dp_shard": 1, "pp_schedule": "1F1B",
                                                  "pp_microbatches": 2}))}
    report("lora_pp2_trainer", f"losses={[round(h['loss'], 6) for h in out['pp2']]}")
    ck = {"enable": True, "interval": 2}
    out["fsdp2"] = train(trainer_cfg(root, "fsdp2", {"dp_shard": 2}, local_batch=2, checkpoint=ck))
    resumed = train(trainer_cfg(root, "fsdp2", {"dp_shard": 2}, local_batch=2, checkpoint={**ck, "load_step": 2}))
    assert resumed == out["fsdp2"][2:], (resumed, out["fsdp2"])
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(os.path.join(root, "fsdp2", "checkpoint", "step-2")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 28 and all(is_adapter_key(k) for k in model_keys), model_keys
    report("lora_fsdp2_trainer_resume", f"steps 3-4 resumed from adapter-only step 2 bitwise; "
                                        f"{len(model_keys)} model tensors saved")
    if rank == 0:
        with open(os.path.join(root, "trainers.json"), "w") as f:
            json.dump(out, f)


def main() -> None:
    global rank, world
    rank, world, _ = init_distributed("cpu", timeout_s=120)
    torch.set_num_threads(1)
    run_case("lora_fsdp2", {"dp_shard": 2})
    run_case("lora_tp2", {"tp": 2}, sp=False, lp=False)
    run_case("lora_tp2_sp_lp_sac", {"tp": 2}, sp=True, lp=True, ac="selective")
    trainer_cases(sys.argv[1])
    sft_runs(sys.argv[1], world)  # the SFT layouts of 2 ranks (sft_worker.py)
    dist.barrier()
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    exit_without_teardown(main())
