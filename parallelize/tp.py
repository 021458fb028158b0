"""Tensor parallel (Megatron-style) with sequence parallel, loss parallel and async TP, on DTensor styles.

A model's plan (e.g. parallelize/llama3.py:llama_tp_plan) is a dict from module path ("layers.*.attention.wq";
`*` matches every block) to a torch `ParallelStyle`; `apply_tp` hands it to `parallelize_module`. For the Llama
plan the layouts along one block are (tp ranks, S = sequence):

    residual stream  [B, S/tp, D] plain tensor    (sequence parallel; [B, S, D] replicated without SP)
    attention_norm   SequenceParallel             norm on the local sequence shard
    attention        PrepareModuleInput           all-gather: Shard(1) -> Replicate (one collective for q, k, v)
      wq, wk, wv     ColwiseParallel              local heads, returned as PLAIN tensors: RoPE, repeat_kv and
                                                  SDPA run on ordinary tensors, so flash/cuDNN attention is
                                                  picked as without TP (no DTensor dispatch, no math fallback)
      wo             RowwiseParallel              reduce-scatter -> Shard(1) (all-reduce -> Replicate without SP)
    ffn_norm / feed_forward (w1, w3 colwise; w2 rowwise)   the same pattern

Heads are split across TP ranks, so n_heads and n_kv_heads must be divisible by tp (checked here with the fix in
the message; config-level twin: titanlike/config/validate.py:validate_model).

Modules that read their parameters directly rather than through a Linear (the Mamba-2 mixer's conv, per-head
scalars and gated norm: parallelize/nemotron_h.py) get ShardParameters: DTensors sharded on dim 0, the forward left
alone, reading its local rows through models/common/local.py. A plan dict holds one style per module path; Styles
applies several to one module.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from parallelize.lora import LoraStyle, has_lora, lora_aware

logger = logging.getLogger("titanlike")


class _SyncOutput:
    """Finish the output redistribute before handing out the local tensor.

    torch's Colwise/RowwiseParallel redistribute their output with async_op=True, so `to_local()` returns an
    AsyncCollectiveTensor. Fed into a torch.compile'd region (the first compiled block after the embedding, the
    compiled loss after the output layer), its backward skips the DTensor wrapping and fails ("'Tensor' object
    has no attribute '_local_tensor'", torch 2.13). The consumer needs the value at once anyway, so waiting here
    costs nothing. (Same signature as torch's own static hook, unchanged since torch 2.2.)
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


class SyncOutputRowwiseParallel(_SyncOutput, RowwiseParallel):
    """RowwiseParallel whose (local) output is a plain tensor: for modules feeding compiled code."""


class SyncOutputColwiseParallel(_SyncOutput, ColwiseParallel):
    """ColwiseParallel whose (local) output is a plain tensor: for modules feeding compiled code."""


class ReplicateParallel(ParallelStyle):
    """Parameters become Replicate DTensors on the TP mesh; the module computes the same thing on every TP rank
    and takes and returns plain tensors (the norms when sequence parallel is off).

    Why not leave such a module alone: a model whose parameters are part DTensor, part plain cannot be stepped by
    foreach/fused AdamW ("mixed torch.Tensor and DTensor") and would give FSDP x TP two meshes; replicated DTensor
    parameters cost no communication (their gradients come out identical, hence Replicate, on every rank).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input_fn, output_fn=self._output_fn)

    @staticmethod
    def _input_fn(module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    @staticmethod
    def _output_fn(module, output, device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output


class ShardParameters(ParallelStyle):
    """The module's own parameters named here (not its children's) become DTensors sharded on dim 0 over the TP
    mesh; inputs, outputs and forward are left alone. For modules that read their parameters directly: the module
    computes on the rows it holds (models/common/local.py), while the optimizer, checkpoints (whole tensors,
    resharded on load) and the grad norm see one kind of parameter. A parameter that is None (no bias) is skipped.
    The module's forward must use only its own rows of each, i.e. be local along dim 0 (per head, group or channel).
    """

    def __init__(self, *names: str):
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            if param is None:
                continue
            if param.shape[0] % device_mesh.size():
                raise ValueError(f"ShardParameters: {type(module).__name__}.{name} has {param.shape[0]} rows, which "
                                 f"tensor parallel {device_mesh.size()} does not divide; choose a tp that divides it")
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


class Styles(ParallelStyle):
    """Several styles applied to one module, in order (e.g. PrepareModuleInput and ShardParameters)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank  # parallelize_module sets it on the outer style only
            module = style._apply(module, device_mesh)
        return module


def describe_plan(plan: dict[str, ParallelStyle]) -> str:
    """One line per entry, for logs and docs: 'layers.*.attention.wq  ColwiseParallel(...)'."""
    width = max(map(len, plan))
    return "\n".join(f"  {path:<{width}}  {_style_repr(style)}" for path, style in plan.items())


def _style_repr(style: ParallelStyle) -> str:
    if isinstance(style, Styles):
        return " + ".join(map(_style_repr, style.styles))
    if isinstance(style, LoraStyle):
        return f"LoraStyle({_style_repr(style.style)})"
    fields = []
    for name in ("input_layouts", "output_layouts", "desired_input_layouts", "use_local_output", "names"):
        if hasattr(style, name):
            fields.append(f"{name}={getattr(style, name)}")
    return f"{type(style).__name__}({', '.join(fields)})"


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Shard `model` (on meta or materialised) over the 1-D `tp_mesh` per `plan` in place; returns it.

    Top-level plan entries whose module is None (pipeline stages without the embeddings or the output) are skipped;
    `*` entries match whatever blocks the stage holds.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp: tp_mesh must be 1-D, got {tp_mesh.ndim}-D {tp_mesh}")
    present = {k: v for k, v in plan.items() if "*" in k or _resolve(model, k)}
    if has_lora(model):  # LoRA layers: adapters sharded the way their base is (parallelize/lora.py)
        present = lora_aware(present)
    # No extra hooks beside the styles' own: a second forward pre-hook on a block's attention (an earlier version
    # cast activations to bf16 before the all-gather) made torch 2.11's dynamo fail to build its guards
    # ("Error while creating guard ... _forward_pre_hooks ... NoneType"), seen on 2xH200 on 2026-11-22.
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, present)
    # Some of torch's styles (SequenceParallel's replicated norm weights) make new Parameters that require grad:
    # a frozen parameter (a LoRA base) stays frozen.
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    quiet_embedding_view_warning()
    # The whole plan is one line per module: DEBUG, not on every run's console (the mesh is logged by the trainer).
    logger.debug(f"tensor parallel {tp_mesh.size()} over {tp_mesh}:\n{describe_plan(present)}")
    return model


# FSDP2 (torch >= 2.13) warns when a module it wraps returns a view, since an in-place op on that view would drop its
# pre-backward hook. Under TP an FSDP-wrapped embedding hands out its shard with DTensor.to_local(), a view; every
# model here adds to it out of place (h = x + attention(...)), and TP x FSDP training matches one process
# (tests/multiproc/tp_worker.py), so for embeddings the warning names a hazard no model here has. Other modules keep it.
EMBEDDING_VIEW_WARNING = r"FSDP2-wrapped module \((FSDP)?Embedding(, (FSDP)?Embedding)*\) returned a view tensor"


def quiet_embedding_view_warning() -> None:
    warnings.filterwarnings("ignore", message=EMBEDDING_VIEW_WARNING, category=UserWarning)


def _resolve(model: nn.Module, path: str) -> list[nn.Module]:
    """Modules matching a plan path ("*" matches any child name), skipping None children."""
    found = [model]
    for atom in path.split("."):
        found = [child for m in found for name, child in m.named_children() if atom in ("*", name)]
    return found


def maybe_enable_async_tp(tp_mesh: DeviceMesh, enable: bool, compile_enabled: bool) -> bool:
    """Turn on inductor's micro-pipelined TP (all-gather/reduce-scatter fused with the matmuls through symmetric
    memory) for the compiled blocks. Returns whether it is on; every other case logs why and keeps plain TP.

    CUDA only. Symmetric memory is probed once with a rendezvous on the TP group (P2P over NVLink; NVLink
    multicast is not needed: keep TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on machines where it must stay off), and
    the TP ranks agree on the outcome so none of them compiles a different graph.
    """
    if not enable:
        return False
    if tp_mesh.device_type != "cuda":
        logger.warning(f"parallelism.enable_async_tp: needs CUDA (mesh is on {tp_mesh.device_type}); "
                       f"running synchronous TP")
        return False
    if not compile_enabled:
        logger.warning("parallelism.enable_async_tp: needs compile.enable with 'model' in compile.components (the "
                       "fusion is an inductor pass); running synchronous TP")
        return False
    import torch.distributed as dist
    import torch._inductor.config as inductor_config

    group = tp_mesh.get_group()
    ok = torch.ones((), device="cuda")
    reason = ""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        # Deprecated in newer torch (the rendezvous resolves groups by name) but still read by the async-TP
        # pass on torch 2.11: call it where it exists, quietly.
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group.group_name)
        probe = symm_mem.empty(1024, device="cuda")
        symm_mem.rendezvous(probe, group.group_name)
    except Exception as e:  # noqa: BLE001 - any failure means: fall back, and say why
        ok.zero_()
        reason = f"{type(e).__name__}: {e}"
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() < 1:
        logger.warning(f"parallelism.enable_async_tp: symmetric memory unavailable on the TP group "
                       f"({reason or 'failed on another TP rank'}); running synchronous TP")
        return False
    inductor_config._micro_pipeline_tp = True
    logger.info(f"async TP on: inductor micro-pipelines the TP collectives of the compiled blocks over "
                f"group {group.group_name}")
    return True
