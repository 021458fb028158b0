"""torchrun worker: mesh layout checks and FSDP2/HSDP training parity against a 1-process reference.

Run by test_dist_fsdp.py with 2 and 4 processes (gloo, fp32, tolerance 1e-5); `--device cuda` runs the
2-process cases on GPUs with NCCL (test_dist_gpu.py): fp32 tightly, plus bf16 mixed precision + compile
loosely. Every check asserts, so a failure exits non-zero and torchrun tears the job down. Rank 0
prints one "CHECK <name> ..." line per check and "ALL CHECKS PASSED".
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

import models
from par_helpers import VOCAB, SEQ, exit_without_teardown, global_batch, loss_fn, meta_model, reference_model
from parallelize import PlanSections, get_plan
from titanlike.config.sections import JobConfig, Optimizer
from titanlike.distributed.init import destroy_distributed, init_distributed
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.optim.adamw import param_groups
from titanlike.optim.muon import build_muon

TOL = 1e-5
DEVICE = "cpu"
LOCAL_BATCH = 2
STEPS = 3
MAX_NORM = 0.5  # small enough to clip: checks the DTensor grad norm is the global one

rank = world = 0


def report(name: str, detail: str = "") -> None:
    if rank == 0:
        print(f"CHECK {name} ok {detail}", flush=True)


# ------------------------------------------------------------------------------------------ meshes
def mesh_case(kw: dict, names: tuple, sizes: dict, dp_rank: int, fsdp_shape: tuple | None) -> None:
    dims = ParallelDims(**kw, world_size=world)
    mesh = dims.build_mesh(DEVICE)
    assert mesh.mesh_dim_names == names, (kw, mesh.mesh_dim_names)
    for name, size in sizes.items():
        sub = dims.get_mesh(name)
        got = None if sub is None else sub.size()
        assert got == size, f"{kw}: mesh {name!r} size {got}, expected {size}"
    assert dims.dp_rank() == dp_rank, f"{kw}: dp_rank {dims.dp_rank()} on rank {rank}, expected {dp_rank}"
    fsdp = dims.fsdp_mesh
    assert (None if fsdp is None else tuple(fsdp.shape)) == fsdp_shape, (kw, fsdp)
    report(f"mesh{kw}", f"names={names}")


def mesh_checks() -> None:
    if world == 2:
        mesh_case({}, ("dp_shard",), {"dp": 2, "dp_shard_cp": 2, "dp_cp": 2, "cp": None, "tp": None}, rank, (2,))
        mesh_case({"dp_replicate": 2}, ("dp_replicate",), {"dp": 2, "dp_shard_cp": None, "dp_cp": 2}, rank, (2,))
        mesh_case({"cp": 2}, ("cp",), {"dp": None, "dp_shard_cp": 2, "dp_cp": 2}, 0, (2,))
    if world == 4:
        mesh_case({"dp_replicate": 2}, ("dp_replicate", "dp_shard"),
                  {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4, "dp_replicate": 2}, rank, (2, 2))
        mesh_case({"dp_shard": 2, "cp": 2}, ("dp_shard", "cp"), {"dp": 2, "dp_shard_cp": 4, "dp_cp": 4}, rank // 2,
                  (4,))
        mesh_case({"pp": 2}, ("pp", "dp_shard"), {"dp": 2, "pp": 2, "dp_cp": 2}, rank % 2, (2,))
        mesh_case({"tp": 2}, ("dp_shard", "tp"), {"dp": 2, "tp": 2, "dp_shard_cp": 2}, rank // 2, (2,))
        mesh_case({"dp_replicate": 2, "cp": 2}, ("dp_replicate", "cp"), {"dp": 2, "dp_shard_cp": 2, "dp_cp": 4},
                  rank // 2, (2, 2))


# ------------------------------------------------------------------------------------------ training
def qwen3_next_args():
    """A tiny hybrid: one Gated DeltaNet and one attention layer, MoE (4 experts, top 2) + gated shared expert. No
    balance loss: it is a statistic of each rank's own batch, so its gradient is not the global batch's."""
    spec = models.get_spec("qwen3_next")
    moe = dataclasses.replace(spec.flavors["debugmodel"].moe, num_experts=4, hidden_dim=32, aux_loss_coeff=0.0)
    return dataclasses.replace(
        spec.flavors["debugmodel"], dim=64, n_layers=2, layer_types=("linear_attention", "full_attention"),
        n_heads=4, n_kv_heads=2, head_dim=16, linear_head_k_dim=16, linear_head_v_dim=16, linear_chunk_size=8,
        hidden_dim=64, shared_hidden_dim=32, moe=moe, vocab_size=VOCAB, max_seq_len=SEQ)


def family_models(family: str, seed: int = 0):
    """(reference on CPU from `seed`, meta model) of a family: llama3 (par_helpers) or qwen3_next."""
    if family == "llama3":
        return reference_model(seed=seed), meta_model()
    spec = models.get_spec(family)
    torch.manual_seed(seed)
    ref = spec.model_cls(qwen3_next_args())
    ref.init_weights()
    with torch.device("meta"):
        return ref, spec.model_cls(qwen3_next_args())


def train_case(name: str, dims_kw: dict, plan: str, ac: tuple[str, str] = ("none", "op"), reshard: str = "default",
               compile: bool = False, param_dtype: str = "float32", tol: float = TOL, family: str = "llama3",
               muon: str = ""):
    """muon: "" for AdamW, else optimizer.name="Muon" with that `distribute` ("owner" | "replicated"), its
    Newton-Schulz in fp32; the reference is the same optimizer on plain tensors (NS on the whole matrix)."""
    dims = ParallelDims(**dims_kw, world_size=world)
    dims.build_mesh(DEVICE)
    cfg = JobConfig()
    cfg.compile.enable = compile
    cfg.training.mixed_precision_param = param_dtype
    cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_option = ac
    cfg.parallelism.fsdp_reshard_after_forward = reshard

    ref, meta = family_models(family)
    ref = ref.to(DEVICE)
    model = get_plan(family, plan)(meta, dims, PlanSections.of(cfg))
    model.to_empty(device=DEVICE)
    torch.manual_seed(123)  # deliberately different init: the state dict copy below must overwrite all of it
    model.init_weights()
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))

    ref_names = [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == ref_names, "parallelized model changed parameter FQNs"
    fsdp_mesh = dims.fsdp_mesh
    expected = (Replicate(), Shard(0)) if fsdp_mesh.ndim == 2 else (Shard(0),)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == expected, (n, type(p), getattr(p, "placements", None))

    # lr 1e-3: Adam turns ~1e-7 gradient round-off into update differences proportional to lr (a
    # near-zero second moment amplifies it); wrong gradient scales are caught by the grad-norm check.
    opt_kw = dict(lr=1e-3, weight_decay=0.1, foreach=True)
    if muon:
        spec = models.get_spec(family)
        io, ocfg = (*spec.input_modules, *spec.output_modules), Optimizer(name="Muon", lr=1e-3, muon_ns_dtype="float32")
        ref_opt = build_muon(ref, ocfg, param_groups(ref, ocfg), io)
        opt = build_muon(model, ocfg, param_groups(model, ocfg), io, distribute=muon)
        assert sum(len(g["params"]) for g in opt.param_groups if g["use_muon"]) > 0
    else:
        ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kw)
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)
    dp_rank, dp = dims.dp_rank(), dims.dp_degree
    loss_group = dims.get_mesh("dp_cp").get_group()
    worst_loss = 0.0
    for step in range(STEPS):
        inputs, labels = (t.to(DEVICE) for t in global_batch(step, dp * LOCAL_BATCH))
        ref_loss = loss_fn(ref(inputs), labels)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()

        rows = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)
        loss = loss_fn(model(inputs[rows]), labels[rows])
        loss.backward()  # FSDP averages gradients over dp: equals the gradient of the global-batch mean
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        opt.step()
        opt.zero_grad()

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=loss_group)  # SUM then divide: gloo AVG support varies by version
        global_loss /= dp
        diff = abs(global_loss.item() - ref_loss.item())
        assert diff <= tol, f"{name} step {step}: loss {global_loss.item()} vs reference {ref_loss.item()}"
        assert abs(norm.item() - ref_norm.item()) <= tol, f"{name} step {step}: grad norm {norm} vs {ref_norm}"
        worst_loss = max(worst_loss, diff)

    ref_params = dict(ref.named_parameters())
    worst_param = 0.0
    for n, p in model.named_parameters():
        d = (p.full_tensor() - ref_params[n].detach()).abs().max().item()
        assert d <= tol, f"{name}: parameter {n} differs from the reference by {d}"
        worst_param = max(worst_param, d)
    report(name, f"loss_diff={worst_loss:.2e} param_diff={worst_param:.2e}")


def main() -> None:
    global rank, world, DEVICE
    DEVICE = "cuda" if "--device=cuda" in sys.argv else "cpu"
    rank, world, _ = init_distributed(DEVICE, timeout_s=60)
    torch.set_num_threads(1)
    mesh_checks()
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 case compares against an fp32 reference
        torch.backends.cudnn.allow_tf32 = False
        train_case("cuda_fsdp2_fp32_sac_op", {}, "default", ac=("selective", "op"), tol=1e-4)
        # bf16 params: the reference stays fp32, so only a loose bound (bf16 has ~3 significant digits).
        train_case("cuda_fsdp2_bf16_compile_sac_op", {}, "default", ac=("selective", "op"), compile=True,
                   param_dtype="bfloat16", tol=3e-2)
    elif world == 2:
        train_case("fsdp2_default_plan_sac_op", {}, "default", ac=("selective", "op"))
        train_case("fsdp2_fsdp_only_reshard_never", {}, "fsdp_only", reshard="never")
        train_case("fsdp2_qwen3_next_sac_op", {}, "default", ac=("selective", "op"), family="qwen3_next")
        train_case("replicate2_default_plan_ac_full", {"dp_replicate": 2}, "default", ac=("full", "op"),
                   reshard="always")
    if world == 4:
        train_case("hsdp_2x2_default_plan_sac_2", {"dp_replicate": 2}, "default", ac=("selective", "2"))
        train_case("fsdp4_fsdp_only", {}, "fsdp_only")
    if rank == 0:
        print("ALL CHECKS PASSED", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    exit_without_teardown(main())

