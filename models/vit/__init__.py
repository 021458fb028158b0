"""Vision Transformer family (HF's ViTForImageClassification; SigLIP's vision tower, HF's SiglipVisionModel and
SiglipForImageClassification, and CLIP's, HF's CLIPVisionModel and CLIPForImageClassification, through ModelArgs'
options): the model, flavors, counts, checks and HF adapter, as
one ModelSpec trained by its own objective (images + class labels, models/vit/objective.py)."""
from __future__ import annotations

from models.common.checks import attention_head_checks, dense_checks, ffn_checks
from models.spec import ModelSpec
from models.vit import hf
from models.vit.args import ModelArgs
from models.vit.counts import flops_per_image, flops_per_patch_token, flops_per_token, param_counts, pp_costs, shape
from models.vit.flavors import vit_flavors
from models.vit.model import ViT
from models.vit.objective import Images

INPUT_MODULES = ("patch_embed",)
OUTPUT_MODULES = ("norm", "map_head", "first_token", "mean_tokens", "head")


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    problems = []
    # SigLIP so400m is published at 384 with 14-pixel patches: HF's valid conv drops the remainder, as ours does.
    if args.image_size % args.patch_size and args.class_token:
        problems.append(f"model.args.image_size={args.image_size} is not a multiple of patch_size={args.patch_size} "
                        f"(flavor {flavor!r}): set model.args.image_size to a multiple of {args.patch_size}")
    tp = getattr(par, "tp", 1)
    if tp > 1 and args.n_heads % tp:
        problems.append(f"parallelism.tp={tp} does not divide vit's n_heads={args.n_heads} (flavor {flavor!r}); "
                        f"set parallelism.tp to a divisor of {args.n_heads}")
    problems += attention_head_checks(args.n_heads, args.n_heads, par, flavor) if not problems else []
    problems += ffn_checks(args.hidden_dim, par, flavor)
    if tp > 1 and getattr(par, "enable_sequence_parallel", False) and args.n_tokens % tp:
        # torch's sequence-parallel styles assume equal shards (the global length = tp x the local one)
        cls = " + the class token" if args.class_token else ""
        problems.append(f"parallelism.enable_sequence_parallel=true with parallelism.tp={tp}: vit's {args.n_tokens} "
                        f"tokens ({args.n_patches} patches{cls}) do not split evenly; "
                        f"set parallelism.enable_sequence_parallel=false, or a model.args.image_size whose token "
                        f"count is a multiple of {tp}")
    for name in ("pp", "cp"):
        if getattr(par, name, 1) > 1:
            why = "images have no sequence to cut" if name == "cp" else "no pipeline split is tested for vit yet"
            problems.append(f"parallelism.{name}={getattr(par, name)}: {why}; set parallelism.{name}=1")
    return problems + dense_checks(par, "vit")


SPEC = ModelSpec(
    name="vit",
    model_cls=ViT,
    args_cls=ModelArgs,
    flavors=vit_flavors,
    plans="parallelize.vit",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    objective=Images,
    float8_keep=("head",),  # the classifier
)

__all__ = ["SPEC", "Images", "ModelArgs", "ViT", "flops_per_image", "flops_per_patch_token", "vit_flavors"]
