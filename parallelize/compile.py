"""torch.compile per transformer block (and optionally the loss).

Per block, not the whole model: every block has the same structure, so one compiled graph serves all of
them (compile time independent of depth), and FSDP2's hooks stay outside the compiled regions.
`nn.Module.compile()` compiles in place, so FQNs stay clean (no `_orig_mod.` as with `torch.compile(m)`).
Apply after activation checkpointing (the checkpoint becomes part of the compiled graph) and before FSDP.
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


def _check_components(compile_cfg) -> None:
    unknown = [c for c in compile_cfg.components if c not in COMPONENTS]
    if unknown:
        raise ValueError(f"compile.components: unknown {unknown}; known: {list(COMPONENTS)}")


def apply_compile(model: nn.Module, compile_cfg, fullgraph: bool = True) -> nn.Module:
    """Compile each block of `model.layers` in place when compile.enable and "model" in compile.components.

    fullgraph=True: a graph break inside a block is a bug to fix (it would silently cost speed), so fail loudly.
    Blocks whose MoE experts are expert-parallel stay eager (logged): the dispatch reads its all-to-all split sizes
    on the host (parallelize/ep.py), which a full graph cannot hold.
    """
    from parallelize.ep import ep_experts

    _check_components(compile_cfg)
    if not compile_cfg.enable or "model" not in compile_cfg.components:
        return model
    eager = 0
    for block in model.layers.values():
        if block is None:
            continue
        if ep_experts(block):
            eager += 1
            continue
        block.compile(fullgraph=fullgraph)
    if eager:
        logger.warning(f"compile: {eager} expert-parallel MoE blocks left eager (the all-to-all split sizes are read "
                       f"on the host); the other blocks are compiled")
    return model


def compile_loss(fn: Callable, compile_cfg) -> Callable:
    """`fn` compiled when compile.enable and "loss" in compile.components, else `fn` unchanged.

    Worth it for cross-entropy over a large vocabulary: the compiled version avoids materialising the
    float32 copy of the logits.
    """
    _check_components(compile_cfg)
    if not compile_cfg.enable or "loss" not in compile_cfg.components:
        return fn
    return torch.compile(fn)
