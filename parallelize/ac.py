"""Activation checkpointing per transformer block: none | full | selective ("N" = every N-th block, "op" =
per-op selective checkpointing that saves the expensive ops' outputs and recomputes the cheap ones, "attention" =
save only the attention kernels' outputs and recompute everything else, matmuls included: at long context attention
is most of a block's compute and its output is one [tokens, dim] tensor, so this keeps the costly part for the memory
of about two hidden states per block) |
memory_budget (no wrapper at all: torch.compile's min-cut partitioner keeps `memory_budget` of each compiled
block's activation memory and recomputes the ops cheapest per byte saved - it spends the memory a budget allows
instead of a fixed rule).

FQNs stay clean. Instead of torch's `checkpoint_wrapper` (which inserts `_checkpoint_wrapped_module.`
into every parameter name and relies on state-dict hooks to hide it), a checkpointed block keeps its
object, children and names; only its class is swapped for a generated subclass whose forward runs the
original forward under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`. FSDP2 uses the same
trick, so the two compose (FSDP's subclass goes on top of ours). `named_parameters()`, `state_dict()`,
DCP, float8 filters and HF adapters see the same names with or without AC.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.common.fa4 import fa4_forward_op
from models.common.fla_kernels import fla_forward_ops
AC_MODES = ("none", "full", "selective", "memory_budget")  # activation_checkpoint.mode: config validation reads this

_aten = torch.ops.aten


def _op_save_list(matmuls: bool = True) -> set:
    """Ops whose outputs per-op SAC keeps: costly to recompute relative to their memory (matmuls=False: attention
    only, the "attention" option)."""
    ops = {
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        # Float8 scaling computes amax with max(); saving the scalar avoids recomputing a full reduction.
        _aten.max.default,
    }
    if matmuls:
        ops.add(_aten.mm.default)
    # Optional ops: present in current torch, guarded so an older/newer build without them still imports.
    if hasattr(_aten, "_scaled_dot_product_cudnn_attention"):
        ops.add(_aten._scaled_dot_product_cudnn_attention.default)
    ops.add(fa4_forward_op())  # model.attn_backend = "fa4": the same rule as SDPA's
    ops.update(fla_forward_ops())  # the recurrent mixers' scans on fla's kernels (model.mixer_kernel)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        # Under TP/sequence parallel, recomputing a reduce-scatter means communicating again.
        ops.add(c10d.reduce_scatter_tensor.default)
    return ops


def _op_sac_policy(counts: dict, save_ops: set, save_every_other_mm: bool, ctx, func, *args, **kwargs):
    # Forward and recompute count mm calls separately, so both passes make the same decision per mm.
    if func is _aten.mm.default:
        key = "recompute_mm" if ctx.is_recompute else "forward_mm"
        counts[key] += 1
        if save_every_other_mm and counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def op_sac_context_fn(save_every_other_mm: bool = True, matmuls: bool = True):
    """A fresh (forward, recompute) context pair for one checkpointed call (the mm counter is per call)."""
    policy = partial(_op_sac_policy, defaultdict(int), _op_save_list(matmuls), save_every_other_mm)
    return create_selective_checkpoint_contexts(policy)


class _CheckpointedModule:
    """Mixin placed in front of the block's own class: forward = the original forward, checkpointed."""

    _ac_context_fn = None  # None = full recompute; else a callable returning SAC contexts

    def forward(self, *args, **kwargs):
        kw = {} if self._ac_context_fn is None else {"context_fn": self._ac_context_fn}
        # preserve_rng_state=False: blocks are dropout-free, and saving/restoring RNG state costs time.
        return checkpoint(super().forward, *args, use_reentrant=False, preserve_rng_state=False, **kw, **kwargs)


_checkpointed_classes: dict[type, type] = {}


def checkpoint_module(module: nn.Module, context_fn=None) -> nn.Module:
    """Make `module` recompute its forward in backward (in place, names unchanged); returns it.

    One generated class per original class, so every block shares a type and torch.compile can reuse
    one compiled graph for all of them.
    """
    if isinstance(module, _CheckpointedModule):
        raise ValueError(f"{type(module).__name__} is already activation-checkpointed")
    cls = type(module)
    new_cls = _checkpointed_classes.get(cls)
    if new_cls is None:
        new_cls = type(f"Checkpointed{cls.__name__}", (_CheckpointedModule, cls), {"__module__": cls.__module__})
        _checkpointed_classes[cls] = new_cls
    module.__class__ = new_cls
    module._ac_context_fn = context_fn
    return module


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, _CheckpointedModule)


def fully_checkpointed(module: nn.Module) -> bool:
    """Checkpointed with full recompute (it keeps only its inputs for backward, compiled or not)."""
    return is_checkpointed(module) and module._ac_context_fn is None


def forward_without_checkpoint(module: nn.Module):
    """The module's forward as it was before checkpoint_module (itself if it is not checkpointed)."""
    if not is_checkpointed(module):
        return module.forward
    return super(_CheckpointedModule, module).forward


def _parse_every_n(option: str) -> int:
    try:
        n = int(option)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"activation_checkpoint.selective_option must be 'op', 'attention' or a positive integer N (checkpoint "
            f"every N-th block), got {option!r}"
        )
    return n


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """Every transformer block of `model`: those of `model.layers` and of any other block stack inside it (a
    ModuleDict named `layers`, such as a VLM's vision tower's `vision.layers`), in module order; a pipeline stage's
    removed blocks (None) left out. AC and compile treat each the same way."""
    stacks = [model.layers]  # (T5's is a view over both its stacks, not a registered module)
    stacks += [m for name, m in model.named_modules()
               if name.endswith(".layers") and isinstance(m, nn.ModuleDict) and m is not model.layers]
    return [b for stack in stacks for b in stack.values() if b is not None]


def apply_ac(model: nn.Module, ac_cfg, save_every_other_mm: bool = True) -> nn.Module:
    """Apply activation checkpointing to each block (blocks_of: `model.layers` and nested stacks such as a vision
    tower's) per `ac_cfg` (mode, selective_option).

    selective "N": blocks N-1, 2N-1, ... (every N-th counting from 1) recompute fully, the rest keep
    activations; N=1 equals full. selective "op": every block, saving mm/attention outputs (and, with
    `save_every_other_mm`, only every other mm's, trading some recompute for memory); "attention": every block,
    saving the attention outputs only.
    """
    mode = ac_cfg.mode
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {AC_MODES}, got {mode!r}")
    # Process-wide and read when a graph is compiled (the first forward): set it on every call, so a model built
    # after another in the same process does not inherit that one's budget. 1.0 is torch's default.
    torch._functorch.config.activation_memory_budget = (
        float(ac_cfg.memory_budget) if mode == "memory_budget" else 1.0)
    if mode in ("none", "memory_budget"):
        return model
    # A compiled checkpoint refuses forward side effects (the MoE records its aux loss and drop count on itself)
    # unless told that the recompute need not replay them: it need not, it would write the same values again.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    context_fn = None
    every_n = 1
    if mode == "selective":
        option = str(ac_cfg.selective_option)
        if option == "op":
            context_fn = partial(op_sac_context_fn, save_every_other_mm)
        elif option == "attention":
            context_fn = partial(op_sac_context_fn, False, matmuls=False)
        else:
            every_n = _parse_every_n(option)
    for count, block in enumerate(blocks_of(model), start=1):
        if count % every_n == 0:
            checkpoint_module(block, context_fn)
    return model
