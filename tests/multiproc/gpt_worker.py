"""torchrun worker (2 processes, gloo, fp32): the GPT family (models/gpt, parallelize/gpt.py) under TP 2 (with and
without sequence/loss parallel) and FSDP 2, tied and untied, against a one-process reference built from the same
weights: the loss, every gradient (first step) and every parameter after 3 SGD steps within 1e-5. Rank 0 prints
"CHECK <name> ok ..." per case and "ALL CHECKS PASSED". Run by test_dist_gpt.py."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import models
from par_helpers import exit_without_teardown
from parallelize import PlanSections, get_plan
from titanlike.config.sections import JobConfig
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.distributed.parallel_dims import ParallelDims

TOL = 1e-5
SEQ, VOCAB, LOCAL_BATCH, STEPS = 16, 128, 2, 3
SPEC = models.get_spec("gpt")
rank = world = 0


def args(tie: bool):
    return dataclasses.replace(SPEC.flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB,
                               max_seq_len=SEQ, tie_embeddings=tie)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def ce_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def case(name: str, dims_kw: dict, tie: bool, sp: bool = True, lp: bool = True) -> None:
    dims = ParallelDims(**dims_kw, world_size=world)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.model.name, cfg.model.flavor = "gpt", "debugmodel"
    cfg.parallelism.enable_sequence_parallel, cfg.parallelism.enable_loss_parallel = sp, lp
    cfg.compile.enable = False
    a = args(tie)
    torch.manual_seed(0)
    ref = SPEC.model_cls(a)
    ref.init_weights()
    with torch.device("meta"):
        meta = SPEC.model_cls(a)
    model = get_plan("gpt", "default")(meta, dims, PlanSections.of(cfg))
    model.to_empty(device="cpu")
    torch.manual_seed(123)  # a different init: the state dict copy must overwrite all of it
    model.init_weights()
    if tie:
        assert model.output.weight is model.tok_embeddings.weight, f"{name}: the tie was lost"
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], (names, "FQNs changed")

    # SGD, not AdamW: attention.wk.bias has a gradient of exactly zero in exact arithmetic (softmax ignores a shift
    # shared by all keys), and Adam's normalisation turns its float noise (~1e-9) into steps of lr.
    opt_kw = dict(lr=0.1, momentum=0.9)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), **opt_kw), torch.optim.SGD(model.parameters(), **opt_kw)
    tp_lp = dims.tp_enabled and lp
    dp_rank, dp = dims.dp_rank(), dims.dp_degree
    worst_loss = worst_grad = 0.0
    for step in range(STEPS):
        inputs, labels = batch(step, dp * LOCAL_BATCH)
        n_tokens = labels.numel()
        ref_loss = ce_sum(ref(inputs), labels) / n_tokens
        ref_loss.backward()
        rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
        with loss_parallel() if tp_lp else contextlib.nullcontext():
            loss = ce_sum(model(inputs[rows]), labels[rows])
            loss = full(loss)
            (loss * dp / n_tokens).backward()
        global_loss = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(global_loss)
        diff = abs(global_loss.item() / n_tokens - ref_loss.item())
        assert diff <= TOL, f"{name} step {step}: loss {global_loss.item() / n_tokens} vs {ref_loss.item()}"
        worst_loss = max(worst_loss, diff)
        if step == 0:
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            for n, p in model.named_parameters():
                d = (full(p.grad) - ref_grads[n]).abs().max().item()
                assert d <= TOL, f"{name}: gradient of {n} differs by {d}"
                worst_grad = max(worst_grad, d)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    worst_param = 0.0
    for n, p in model.named_parameters():
        d = (full(p).detach() - ref_params[n].detach()).abs().max().item()
        assert d <= TOL, f"{name}: parameter {n} differs from the reference by {d}"
        worst_param = max(worst_param, d)
    if rank == 0:
        print(f"CHECK {name} ok loss_diff={worst_loss:.1e} grad_diff={worst_grad:.1e} param_diff={worst_param:.1e}",
              flush=True)


def main() -> None:
    global rank, world
    rank, world, _ = init_distributed("cpu", timeout_s=120)
    torch.set_num_threads(1)
    case("tp2_sp_lp_tied", {"tp": 2}, tie=True)
    case("tp2_tied", {"tp": 2}, tie=True, sp=False, lp=False)
    case("tp2_sp_untied", {"tp": 2}, tie=False, lp=False)
    case("fsdp2_tied", {"dp_shard": 2}, tie=True)
    case("fsdp2_untied", {"dp_shard": 2}, tie=False)
    dist.barrier()
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
    exit_without_teardown()
