"""LLaVA family (HF's LlavaForConditionalGeneration): a vision family's tower, a projector MLP and a decoder
family's language model, as one ModelSpec trained on image + text rows (models/llava/objective.py)."""
from __future__ import annotations

from models.common.decoder import OUTPUT_MODULES
from models.llava import families, hf
from models.llava.args import FREEZE_KEYS, ModelArgs
from models.llava.counts import flops_per_image, flops_per_token, param_counts, pp_costs, shape
from models.llava.flavors import llava_flavors
from models.llava.model import Llava
from models.llava.objective import ImageText
from models.spec import ModelSpec

INPUT_MODULES = ("tok_embeddings", "vision", "projector")


class _TowerView:
    """The parallelism the vision tower sees: TP without sequence parallel (parallelize/llava.py says why), no PP or
    CP (it runs whole, on the first pipeline stage and on every CP rank)."""

    OWN = {"pp": 1, "cp": 1, "enable_sequence_parallel": False}

    def __init__(self, par):
        self.par = par

    def __getattr__(self, name: str):
        return self.OWN[name] if name in self.OWN else getattr(self.par, name)


def check(args: ModelArgs, par, flavor: str) -> list[str]:
    problems = []
    v = args.vision
    if v.image_size % v.patch_size and v.class_token:  # SigLIP so400m: 384 / 14, HF's valid conv drops the rest
        problems.append(f"model.args.vision.image_size={v.image_size} is not a multiple of patch_size="
                        f"{v.patch_size} (flavor {flavor!r}): set it to a multiple of {v.patch_size}")
    if getattr(par, "ep", 1) > 1:
        problems.append(f"parallelism.ep={par.ep}: llava has no routed experts; set parallelism.ep=1")
    # the tower's TP limits (heads, MLP width, each naming parallelism.tp); its image-size line is the one above
    tower = [f"vision tower: {p}" for p in families.vision(args.vision_family).check(v, _TowerView(par), flavor)
             if p.startswith("parallelism.")]
    lang = families.language(args.language_family)
    return problems + [p for p in tower + lang.check(args.text_args, par, flavor) if p not in problems]


SPEC = ModelSpec(
    name="llava",
    model_cls=Llava,
    args_cls=ModelArgs,
    flavors=llava_flavors,
    plans="parallelize.llava",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    pp_costs=pp_costs,
    shape=shape,
    check=check,
    input_modules=INPUT_MODULES,
    output_modules=OUTPUT_MODULES,
    hf=hf,
    objective=ImageText,
)

__all__ = ["FREEZE_KEYS", "SPEC", "ImageText", "Llava", "ModelArgs", "flops_per_image", "llava_flavors"]
