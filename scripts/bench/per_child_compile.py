"""scripts/train.py on one GPU with every MoE block compiled the way expert-parallel blocks are.

Expert parallelism needs two GPUs or more; its blocks compile child by child, the MoE as two graphs around its
experts, which run eagerly (parallelize/compile.py, parallelize/ep.py). This runs one GPU's training with every MoE
block compiled that way, the experts' forward excluded from tracing as under EP, so its tok/s against a plain
`scripts/train.py` run (blocks compiled whole) shows what the per-child compile keeps (docs/benchmarks.md):

    python scripts/bench/per_child_compile.py --config configs/base_gpu.toml --model.name=qwen3 \\
        --model.flavor=30B-A3B_4L --compile.enable=true ...
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    import parallelize.compile
    from models.common.moe import GroupedExperts

    def has_experts(module: torch.nn.Module) -> bool:
        return any(isinstance(m, GroupedExperts) for m in module.modules())

    def per_child(model, cfg, fullgraph: bool = True, backend: str = "inductor"):
        if not cfg.enable or "model" not in cfg.components:
            return model
        moe_blocks = 0
        for block in model.layers.values():
            if block is None:
                continue
            if has_experts(block):  # as parallelize/compile.py's compile_ep_block
                for child in block.children():
                    child.compile(fullgraph=fullgraph and not has_experts(child), backend=backend)
                moe_blocks += 1
            else:
                block.compile(fullgraph=fullgraph, backend=backend)
        print(f"per_child_compile: {moe_blocks} MoE blocks compiled per child, experts eager", flush=True)
        return model

    GroupedExperts.forward = torch.compiler.disable(GroupedExperts.forward)  # as _ExpertParallel.forward
    # Before any plan module is imported: they bind `from parallelize.compile import apply_compile` at import.
    parallelize.compile.apply_compile = per_child
    sys.argv = [str(REPO / "scripts/train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
