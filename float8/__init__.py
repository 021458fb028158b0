"""Float8 training through torchao, as a model converter applied to the meta model before parallelisation.

The two calls every numeric-format converter offers (docs/ARCHITECTURE.md):

    f8 = float8.convert(model, cfg.float8, fsdp_enabled=dims.fsdp_enabled)   # on meta, before the plan
    ...
    optimizer.step(); f8.post_optimizer_hook(model)                          # every step

Compute only: torchao's Float8Linear keeps `weight` (and `bias`) as high-precision parameters under the same
FQNs and adds no buffers, so state dicts and checkpoints are those of the unconverted model — a float8 run resumes
in bf16 and the reverse. Recipes (torchao `Float8LinearConfig.from_recipe_name`):
  tensorwise          one scale per tensor, cuBLAS fp8 GEMM; the fastest; the only one with float8 FSDP all-gather
  rowwise             one scale per row, power-of-2 scales, e4m3 everywhere
  rowwise_with_gw_hp  rowwise, but the weight gradient GEMM in high precision; the most accurate
Float8 FSDP all-gather (tensorwise): FSDP2 all-gathers the float8 weight (half the bytes of bf16); with
`precompute_float8_dynamic_scale_for_fsdp` the scales of all weights come from one all-reduce after the optimizer
step instead of one small all-reduce per layer inside the all-gather, and (`compile_fsdp_cast`) each weight's cast
to float8 before its all-gather is one compiled kernel (float8/fsdp_cast.py).
Routed experts (float8.moe_experts, with any recipe): the MoE's grouped GEMMs through torchao's float8 rowwise grouped
GEMM on token groups padded to 16 rows (float8/experts.py).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from float8.experts import convert_experts
from float8.filter import build_filter, fqn_matches, tied_linears

logger = logging.getLogger("titanlike")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


class _CpuOnlyTorchaoLibs(logging.Filter):
    """Drops torchao's import-time "Failed to load .../torchao/_C*.so" warnings where CUDA is not available: those
    libraries hold CUDA kernels (mxfp8, CUTLASS) a CPU-only run never calls, and each failure is a long line per
    process. With CUDA they stay, since there they mean a torchao build that does not match torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load ") and "torchao" in msg and not torch.cuda.is_available())


# On the "torchao" logger before anything imports torchao (its __init__ logs through getLogger("torchao")).
_torchao_log = logging.getLogger("torchao")
if not any(isinstance(f, _CpuOnlyTorchaoLibs) for f in _torchao_log.filters):
    _torchao_log.addFilter(_CpuOnlyTorchaoLibs())


@dataclasses.dataclass
class Float8Converter:
    """What `convert` did, and the per-step hook that goes with it."""

    enabled: bool = False
    recipe: str = ""
    converted: list[str] = dataclasses.field(default_factory=list)  # FQNs now Float8Linear
    experts: list[str] = dataclasses.field(default_factory=list)  # routed-experts FQNs on the float8 grouped GEMM
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # Linear FQN -> why it stays high precision
    fsdp_float8_all_gather: bool = False
    precompute_scales: bool = False

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """After optimizer.step(): recompute every float8 weight's scale in one all-reduce (tensorwise + float8
        all-gather + precompute only; otherwise nothing). `model` may be a list of pipeline stages."""
        if not self.precompute_scales:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model if isinstance(model, (list, tuple)) else [model]:
            precompute_float8_dynamic_scale_for_fsdp(part)


def _check_device() -> None:
    # float8 GEMMs need Ada/Hopper or newer; older GPUs fail deep inside the first matmul otherwise.
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(f"float8.enable=true needs a GPU of compute capability >= 8.9 (Ada/Hopper); this one is "
                             f"{major}.{minor}: set float8.enable=false")


def config_problems(cfg) -> list[str]:
    """What is wrong with the Float8 config section `cfg` (config validation reports these at load time)."""
    problems = []
    if cfg.moe_experts and not cfg.enable:
        problems.append("float8.moe_experts=true needs float8.enable=true (float8 is one switch; to leave the dense "
                        "layers in bf16, list them in float8.filter_fqns)")
    # torchao casts FSDP all-gathers to float8 only with one scale per tensor.
    if cfg.enable_fsdp_float8_all_gather and cfg.recipe != "tensorwise":
        problems.append(f"float8.enable_fsdp_float8_all_gather needs float8.recipe=\"tensorwise\" (got "
                        f"{cfg.recipe!r}); turn the all-gather off or use the tensorwise recipe")
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        problems.append("float8.precompute_float8_dynamic_scale_for_fsdp needs "
                        "float8.enable_fsdp_float8_all_gather=true")
    return problems


def build_linear_config(cfg, fsdp_enabled: bool):
    """torchao `Float8LinearConfig` for the Float8 config section `cfg`."""
    from torchao.float8 import Float8LinearConfig

    if cfg.recipe not in RECIPES:
        raise ValueError(f"float8.recipe={cfg.recipe!r} is not one of {', '.join(RECIPES)}")
    problems = config_problems(cfg)
    if problems:
        raise ValueError(problems[0])
    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    if cfg.enable_fsdp_float8_all_gather:
        if fsdp_enabled:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        else:
            # Without FSDP nothing is all-gathered; the wrapper subclass would only add dispatch overhead.
            logger.info("float8: enable_fsdp_float8_all_gather ignored (FSDP is off: nothing is all-gathered)")
    return config


def convert(model: nn.Module, cfg, *, fsdp_enabled: bool = False, model_keep: tuple[str, ...] = ()) -> Float8Converter:
    """Swap the chosen nn.Linear layers of `model` (built on meta, not yet parallelised) for torchao Float8Linear,
    in place. `cfg` is the Float8 config section; `fsdp_enabled` whether the plan will apply FSDP (the float8
    all-gather only exists under FSDP); `model_keep` the family's output heads to keep in high precision besides
    `cfg.filter_fqns` (its ModelSpec.float8_keep; dropped when float8.keep_model_heads is false). Returns the
    converter (a no-op one when float8.enable is false). A Linear whose weight is tied to another module (a word
    table) converts with the tie kept (Float8Linear reuses the Parameter), except under the float8 all-gather."""
    if not cfg.enable:
        return Float8Converter()
    _check_device()
    from torchao.float8 import convert_to_float8_training

    config = build_linear_config(cfg, fsdp_enabled)
    if cfg.recipe.startswith("rowwise"):
        # Inductor otherwise fuses the fp32->fp8 cast chain without intermediate rounding and the compiled scales
        # differ from eager ones (pytorch/pytorch#150859); the setting makes compiled casts round like eager.
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    skipped: dict[str, str] = {}
    heads = list(model_keep) if cfg.keep_model_heads else []
    tied = tied_linears(model) if config.enable_fsdp_float8_all_gather else frozenset()
    module_filter = build_filter(list(cfg.filter_fqns), cfg.recipe, cfg.filter_small, skipped, heads, tied)
    before = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
    from torchao.float8.float8_linear import Float8Linear

    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    # (the default "output" is no typo in a model without an LM head: ViT's classifier is its ModelSpec's "head")
    stale = [p for p in cfg.filter_fqns if p and p != "output" and not any(fqn_matches(name, p) for name in before)]
    if stale:
        logger.warning(f"float8.filter_fqns entries {stale} match no Linear layer of the model (typo?)")
    # After the Linear swap, which leaves the experts' 3-D weights alone.
    experts = convert_experts(model) if cfg.moe_experts else []
    if not converted and not experts:
        logger.warning("float8.enable=true but no Linear layer was converted (all filtered): float8 does nothing")
    all_gather = config.enable_fsdp_float8_all_gather
    result = Float8Converter(
        enabled=True, recipe=cfg.recipe, converted=converted, experts=experts, skipped=skipped,
        fsdp_float8_all_gather=all_gather,
        precompute_scales=all_gather and cfg.precompute_float8_dynamic_scale_for_fsdp)
    if result.precompute_scales and cfg.compile_fsdp_cast:
        from float8.fsdp_cast import enable_compiled_fsdp_cast

        if not enable_compiled_fsdp_cast():
            logger.warning("float8.compile_fsdp_cast: this torchao has no fsdp_pre_all_gather hook; casts stay eager")
    kept = ", ".join(f"{k} ({v})" for k, v in list(skipped.items())[:4]) + (" ..." if len(skipped) > 4 else "")
    logger.info(f"float8 {cfg.recipe}: {len(converted)} Linear layers converted, {len(skipped)} kept in high "
                f"precision{': ' + kept if kept else ''}; {len(experts)} routed-experts modules on the float8 rowwise "
                f"grouped GEMM; FSDP float8 all-gather {all_gather}, precomputed scales {result.precompute_scales}")
    return result


def tp_styles(converter: Float8Converter):
    """(ColwiseParallel, RowwiseParallel, PrepareModuleInput) classes for a TP plan: torchao's float8 versions
    when the tensorwise recipe is on (they all-gather/redistribute activations in float8), else torch's.
    Rowwise recipes use the plain styles: torchao has no rowwise float8 TP communication."""
    if converter.enabled and converter.recipe == "tensorwise":
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


__all__ = ["RECIPES", "Float8Converter", "build_filter", "build_linear_config", "config_problems", "convert",
           "convert_experts", "fqn_matches", "tied_linears", "tp_styles"]
