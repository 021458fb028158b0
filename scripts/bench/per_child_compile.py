"""scripts/train.py on one GPU with every MoE block compiled the way expert-parallel blocks are.

Expert parallelism needs two GPUs or more; its blocks compile child by child, the MoE as two graphs around its
experts, which run eagerly (parallelize/compile.py, parallelize/ep.py). This runs one GPU's training with every MoE
block compiled that way, the experts' forward excluded from tracing as under EP, so its tok/s against a plain
`scripts/train.py` run (blocks compiled whole) shows what the per-child compile keeps (docs/benchmarks.md):

    python scripts/bench/per_child_compile.py --config configs/base_gpu.toml --model.name=qwen3 \\
        --model.flavor=30B-A3B_4L --compile.enable=true ...
"""
from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    import parallelize.compile
    from models.common.moe import GroupedExperts
    from parallelize.ep import expert_modules

    GroupedExperts.forward = torch.compiler.disable(GroupedExperts.forward)  # as _ExpertParallel.forward
    # Before any plan module is imported: they bind `from parallelize.compile import apply_compile` at import.
    parallelize.compile.apply_compile = functools.partial(parallelize.compile.apply_compile, split=expert_modules)
    sys.argv = [str(REPO / "scripts/train.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
