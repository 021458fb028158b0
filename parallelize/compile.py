"""torch.compile per transformer block (and optionally the loss).

Per block, not the whole model: every block has the same structure, so one compiled graph serves all of
them (compile time independent of depth), and FSDP2's hooks stay outside the compiled regions.
`nn.Module.compile()` compiles in place, so FQNs stay clean (no `_orig_mod.` as with `torch.compile(m)`).
Apply after activation checkpointing (the checkpoint becomes part of the compiled graph) and before FSDP.

Blocks with expert-parallel experts are compiled child by child instead. The EP dispatch reads its all-to-all split
sizes on the host (parallelize/ep.py), which no graph can hold, and a graph break inside a compiled checkpointed
block sends the whole block back to eager. So the block itself (and its checkpoint, when AC wraps it) stays eager,
each child but the MoE compiles with fullgraph (attention, norms), and the MoE compiles without it: the EP experts'
forward is excluded from tracing (torch.compiler.disable), which splits the MoE into two graphs, routing and sort
before it, un-sort, weighted sum and shared experts after it, with the experts' FSDP hooks, dispatch, local experts
and combine eager between them. The graphs' shapes depend on the batch shape only (the EP experts return one row per
routed row), so the data-dependent token counts never reach a graph and changing routing does not recompile; all
layers share the graphs (apply_ep gives every experts module of a class the same EP class, which the MoE's graph
guards on). Compiled children under an eager checkpoint work for every AC mode: torch's selective-checkpoint dispatch
modes let compiled regions run inside them (tests/multiproc/ep_worker.py checks per-op selective AC).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

# compile.components (config validation reads this); "optimizer" is the one-device master-weight update
# (titanlike/optim/master_weights.py).
logger = logging.getLogger("titanlike")
COMPONENTS = ("model", "loss", "optimizer")
# compile.backend: Inductor, or the graph-capture-only backends (torch._dynamo.list_backends() would import Inductor)
BACKENDS = ("inductor", "aot_eager", "eager")


def _check_components(compile_cfg) -> None:
    unknown = [c for c in compile_cfg.components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"compile.components: unknown {unknown}; known: {list(COMPONENTS)}")


def apply_compile(model: nn.Module, compile_cfg, fullgraph: bool = True,
                  split: Callable[[nn.Module], list] | None = None) -> nn.Module:
    """Compile each block in place (parallelize.ac.blocks_of: `model.layers` and nested stacks such as a vision
    tower's) when compile.enable and "model" in compile.components.

    fullgraph=True: a graph break inside a block is a bug to fix (it would silently cost speed), so fail loudly.
    Blocks whose MoE experts are expert-parallel are compiled per child, their MoE with the EP exchange left eager
    (module docstring; logged). compile.backend picks torch.compile's backend (tests use "aot_eager": the same
    graphs without Inductor's slow CPU code generation). `split`: the submodules whose calls stay eager, found in a
    block or child (default: parallelize.ep's ep_experts; scripts/bench/per_child_compile.py passes every MoE's
    experts)."""
    from parallelize.ac import blocks_of
    from parallelize.ep import ep_experts

    _check_components(compile_cfg)
    if not compile_cfg.enable or "model" not in compile_cfg.components:
        return model
    split = split or ep_experts
    per_child = 0
    for block in blocks_of(model):
        if split(block):
            _compile_per_child(block, fullgraph, compile_cfg.backend, split)
            per_child += 1
            continue
        block.compile(fullgraph=fullgraph, backend=compile_cfg.backend)
    if per_child:
        logger.info(f"compile: {per_child} expert-parallel MoE blocks compiled per child (their all-to-all dispatch, "
                    f"local experts and combine stay eager); the other blocks whole")
    return model


def _compile_per_child(block: nn.Module, fullgraph: bool, backend: str, split: Callable[[nn.Module], list]) -> None:
    """Compile the children of a block holding expert-parallel experts, in place (module docstring): the MoE child
    with graph breaks allowed around the EP experts (`split`, as apply_compile's), every other child with
    `fullgraph`."""
    for child in block.children():
        if split(child):
            # The one break: the call of the EP experts (their FSDP hooks, and the forward parallelize/ep.py marks
            # torch.compiler.disable), which runs eagerly between the MoE's two graphs.
            child.compile(fullgraph=False, backend=backend)
        else:
            child.compile(fullgraph=fullgraph, backend=backend)


def compile_loss(fn: Callable, compile_cfg) -> Callable:
    """`fn` compiled when compile.enable and "loss" in compile.components, else `fn` unchanged.

    Worth it for cross-entropy over a large vocabulary: the compiled version avoids materialising the
    float32 copy of the logits.
    """
    _check_components(compile_cfg)
    if not compile_cfg.enable or "loss" not in compile_cfg.components:
        return fn
    return torch.compile(fn, backend=compile_cfg.backend)
