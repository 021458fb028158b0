"""LLaVA under TP (+ SP, loss parallel), CP, PP and FSDP x TP against one process (gloo, fp32): the loss and the
grad norm of every step, every parameter's gradient after the first step and every parameter after STEPS AdamW steps,
all within TOL (the grad norm relative to its size). Called from tp_worker.py's launches (2 ranks: TP 2, CP 2,
PP 2; 4 ranks: FSDP 2 x TP 2), so no launch of its own.

The model: the debug ViT tower (3 blocks, 2 used: 16 patches + the class token = 17 tokens, odd, which the tower's
TP without sequence parallel takes whole) and a tiny Llama or Qwen3; rows of 0, 1 and 2 images (two image slots a
row), placeholder runs at shifting places, crossing the CP chunks and the SP shards, built by the family's objective
from loader rows as the trainer does (every slot and image_pos, per row)."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import models
from models.batch import StepContext, build_objective
from parallelize import PlanSections, get_plan
from parallelize.cp import shard_sequence
from titanlike.config.sections import JobConfig
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.optim.adamw import clip_grad_norm_
from titanlike.train.pipeline import PipelineRunner

TOL = 1e-5
STEPS, ROWS, SEQ, VOCAB = 3, 4, 40, 64  # SEQ: tokens after the image slots (CP 2 cuts it in 4 chunks of 10)
IMAGES = ((0, 2, 1, 2), (2, 0, 2, 1), (1, 2, 0, 2))  # images per row, per step
MAX_NORM = 0.5


def llava_args(language: str = "llama3"):
    spec = models.get_spec("llava")
    base = spec.flavors["debugmodel"]
    if language == "llama3":
        text = dataclasses.replace(base.text, dim=64, n_heads=4, n_kv_heads=2, multiple_of=32)
    else:
        text = models.get_spec("qwen3").args_cls(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128)
    return dataclasses.replace(base, language_family=language, text=text, n_layers=2, vocab_size=VOCAB,
                               max_seq_len=SEQ, images_per_row=2)


def loader_rows(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) as a loader gives them: two image slots of pixel bytes, then SEQ tokens."""
    g = torch.Generator().manual_seed(500 + step)
    per = args.image_tokens
    toks = torch.randint(0, VOCAB - 1, (ROWS, SEQ + 1), generator=g)
    for r, n in enumerate(IMAGES[step]):
        starts = (1 + step + r, 20 + r)[:n] if n == 2 else (7 + 3 * step,)[:n]
        for s in starts:
            toks[r, s:s + per] = args.image_token
    pixels = torch.randint(0, 256, (ROWS, args.images_per_row * args.pixels), generator=g)
    rows = torch.cat([pixels, toks], 1)
    return rows[:, :-1], rows[:, 1:]


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_grads(name: str, named_params, ref_grads: dict[str, torch.Tensor], tol: float = TOL) -> tuple[float, float]:
    """Every parameter's gradient (DTensors gathered whole) within `tol` of the one-process run's, elementwise;
    returns (the worst difference, the largest reference gradient). A parameter without a gradient (frozen) must
    have none in the reference either. Shared by the other families' layout checks (toy_family_worker.py)."""
    worst = scale = 0.0
    for n, p in named_params:
        if p.grad is None:
            assert ref_grads.get(n) is None, f"{name}: {n} has no gradient, the reference has one"
            continue
        assert n in ref_grads, f"{name}: {n} has a gradient, the reference has none"
        d = (_full(p.grad) - ref_grads[n]).abs().max().item()
        assert d <= tol, f"{name}: the gradient of {n} differs from the reference by {d}"
        worst, scale = max(worst, d), max(scale, ref_grads[n].abs().max().item())
    return worst, scale


def llava_case(name: str, dims_kw: dict, world: int, report, language: str = "llama3", sp: bool = True,
               lp: bool = True) -> None:
    objective_case(name, dims_kw, world, report, "llava", llava_args(language), loader_rows, sp=sp, lp=lp)


def objective_case(name: str, dims_kw: dict, world: int, report, family: str, args, rows, sp: bool = True,
                   lp: bool = True) -> None:
    """`family` at `args` under the layout `dims_kw` against one process, on the batches its spec's objective builds
    from `rows(args, step)` (the loader's (input_ids, labels), ROWS of them); the loss the trainer would use (the
    objective's own function, else the summed cross-entropy). LLaVA's cases, and other families' (encoder_cases.py)."""
    dims = ParallelDims(**dims_kw, world_size=world)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.parallelism.enable_sequence_parallel, cfg.parallelism.enable_loss_parallel = sp, lp
    cfg.training.seq_len, cfg.training.local_batch_size = args.max_seq_len, ROWS // dims.dp_degree
    spec = models.get_spec(family)
    problems = spec.check(args, dims, "debugmodel")
    assert not problems, problems
    objective = build_objective(spec.objective, args)
    loss_fn = objective.loss if callable(objective.loss) else ce_sum
    torch.manual_seed(0)
    ref = spec.model_cls(args)
    ref.init_weights()
    with torch.device("meta"):
        meta = spec.model_cls(args)
    plan = get_plan(family, "default")
    runner = None
    if dims.pp_enabled:
        cfg.parallelism.pp, cfg.parallelism.pp_schedule, cfg.parallelism.pp_microbatches = dims.pp, "1F1B", 2
        runner = PipelineRunner(meta, spec, args, dims, PlanSections.of(cfg), torch.device("cpu"), plan, loss_fn)
        parts = runner.model_parts
    else:
        parts = [plan(meta, dims, PlanSections.of(cfg))]
    for part in parts:  # FSDP: each tower block its own group (the dotted fsdp_groups names of parallelize/llava.py)
        if dims.fsdp_enabled and getattr(part, "vision", None) is not None:
            assert all(isinstance(b, FSDPModule) for b in part.vision.layers.values()), f"{name}: tower blocks"
    ref_sd = ref.state_dict()
    for part in parts:
        part.to_empty(device="cpu")
        torch.manual_seed(123)  # a different init: the copy below must overwrite all of it
        part.init_weights(buffer_device="cpu")
        keys = list(part.state_dict())
        set_model_state_dict(part, {k: ref_sd[k] for k in keys}, options=StateDictOptions(full_state_dict=True))
    opt_kw = dict(lr=1e-3, weight_decay=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), **opt_kw)
    opts = [torch.optim.AdamW(p.parameters(), **opt_kw) for p in parts]
    params = [p for part in parts for p in part.parameters()]
    ref_params = dict(ref.named_parameters())
    dp, dp_rank = dims.dp_degree, dims.dp_rank()
    loss_mesh = dims.get_mesh("dp_cp")
    cp = dims.get_mesh("cp")
    loss_ctx = loss_parallel if dims.tp_enabled and lp else contextlib.nullcontext
    worst_loss = worst_grad = grad_scale = 0.0
    for step in range(STEPS):
        batch = objective(*rows(args, step), StepContext(step, 0))
        count = batch.target_count()
        ref_loss = loss_fn(ref(*batch.args(), **batch.kwargs()), batch.labels) / count
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()} if step == 0 else {}
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()

        local = batch.split(dp)[dp_rank]  # this data rank's rows
        if cp is not None:  # as titanlike/train/batch.py: the inputs the Batch names as sequences, cut
            at = (cp.get_local_rank(), cp.size())
            local = local.replace(inputs={k: shard_sequence(v, *at) if k in batch.sequence else v
                                          for k, v in local.inputs.items()},
                                  labels=shard_sequence(local.labels, *at))
        scale = torch.tensor(float(dims.dp_cp_degree)) / count  # FSDP averages over dp x cp: back to the sum
        with loss_ctx():
            if runner is not None:
                loss = runner.step([local], scale) * scale
            else:
                loss = _full(loss_fn(parts[0](*local.args(), **local.kwargs()), local.labels)) * scale
                loss.backward()
        if step == 0:
            worst_grad, grad_scale = check_grads(name, [np for part in parts for np in part.named_parameters()],
                                                 ref_grads)
        norm = runner.clip_grad_norm_(MAX_NORM) if runner is not None else clip_grad_norm_(params, MAX_NORM)
        for o in opts:
            o.step()
            o.zero_grad()
        loss = loss.detach() / dims.dp_cp_degree
        if runner is not None:
            loss = runner.reduce_over_pp(loss)
        if loss_mesh is not None:
            dist.all_reduce(loss, group=loss_mesh.get_group())
        diff = abs(loss.item() - ref_loss.item())
        assert diff <= TOL, f"{name} step {step}: loss {loss.item()} vs the reference's {ref_loss.item()}"
        # the norm relative to its size (~6 here: fp32 sums over every gradient, in another order per layout)
        assert abs(norm.item() - ref_norm.item()) <= TOL * max(1.0, ref_norm.item()), \
            f"{name} step {step}: grad norm {norm} vs {ref_norm}"
        worst_loss = max(worst_loss, diff)
    worst_param = 0.0
    for part in parts:
        for n, p in part.named_parameters():
            d = (_full(p).detach() - ref_params[n].detach()).abs().max().item()
            assert d <= TOL, f"{name}: parameter {n} differs from the reference by {d}"
            worst_param = max(worst_param, d)
    dist.barrier()
    stages = f" stages={runner.pipeline.layout}" if runner is not None else ""
    meshes = sorted({str(p.device_mesh.mesh_dim_names) for p in params if isinstance(p, DTensor)})
    report(name, f"loss_diff={worst_loss:.1e} grad_diff={worst_grad:.1e} (largest gradient "
                 f"{grad_scale:.1e}) param_diff={worst_param:.1e}{stages} meshes={meshes}")


def run(world: int, report, full: bool = False) -> None:
    """The llava cases of a tp_worker.py launch of `world` ranks."""
    if world == 2:
        llava_case("llava_tp2_sp_lp", {"tp": 2}, world, report)
        llava_case("llava_cp2", {"cp": 2}, world, report)
        llava_case("llava_pp2", {"pp": 2}, world, report)
        llava_case("llava_qwen3_tp2_sp", {"tp": 2}, world, report, language="qwen3", lp=False)
    if world == 4:
        llava_case("llava_fsdp2_tp2_sp_lp", {"dp_shard": 2, "tp": 2}, world, report)
        if full:
            llava_case("llava_pp2_fsdp2", {"pp": 2, "dp_shard": 2}, world, report)
            llava_case("llava_cp2_tp2", {"cp": 2, "tp": 2}, world, report)
