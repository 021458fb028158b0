"""The LLaVA plans, composed by parallelize/compose.py (TP -> CP -> AC -> compile -> FSDP; PP splits the model first,
parallelize/pp.py). EP is refused by the family's check in one line (no routed experts).

TP (+ sequence parallel), module path -> style (`llava_tp_plan`):
- the tower: the ViT plan's heads and MLP (parallelize/vit.py) WITHOUT sequence parallel: its token counts are odd
  with a class token or SigLIP's 27 x 27 patches (577, 729), so a sequence cut rarely divides; whole tokens between
  its blocks, its output whole on every TP rank (the feature selection drops the first token of the whole sequence);
- the projector: linear_1 column-, linear_2 row-parallel, its output whole (an all-reduce);
- the language model: its family's plan (parallelize/llama3.py, parallelize/qwen3.py), with one change: the splice
  needs every token's embedding where the placeholders sit, so tok_embeddings hands out the whole sequence
  (Replicate: an all-reduce of the vocabulary shards instead of a reduce-scatter), the features are spliced in on
  every TP rank alike, and the first block's input is cut to this rank's sequence shard (a slice, no communication;
  its backward all-gathers the gradient). The blocks, norm and output are the decoder's as they are.
PP: the tower and the projector run on the first stage with the embeddings (the spec's input_modules), the split
  weighs them in (models/llava/counts.py's pp_costs); every stage gets the image slots and image_pos as keyword
  inputs, per micro-batch by rows, and only the first reads them.
CP: the splice runs on this rank's chunks of the sequence (image_pos, cut with the tokens, says which feature each
  placeholder takes), the tower on all the batch's images on every CP rank (its gradients summed over CP by FSDP, as
  every parameter's). CP wraps the decoder's attention kernels only: the tower's EncoderAttention has no
  `attention_fn`, so it keeps attending within each image.
FSDP groups: each tower block on its own (a ViT-L tower is 300M parameters: one group would stay unsharded through
its whole forward), then the tower's rest (patch embedding), tok_embeddings, the projector, each decoder block,
norm + output.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from models.llava import SPEC
from parallelize.compose import Recipe, compose_plans
from parallelize.llama3 import llama_tp_plan
from parallelize.qwen3 import decoder_tp_plan
from parallelize.tp import SyncOutputRowwiseParallel
from parallelize.vit import vit_tp_plan

# language_family -> its decoder's TP plan (the entries for tok_embeddings, layers.*, norm, output)
_LANGUAGE_PLANS = {
    "llama3": lambda model, *, sequence_parallel, loss_parallel, ep_enabled: llama_tp_plan(
        sequence_parallel=sequence_parallel, loss_parallel=loss_parallel),
    "qwen3": lambda model, **kw: decoder_tp_plan(model, qk_norm=True, **kw),
}


def llava_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                  ep_enabled: bool = False) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style for a LLaVA model or pipeline stage (module doc)."""
    family = model.args.language_family
    if family not in _LANGUAGE_PLANS:
        raise ValueError(f"parallelism.tp: no llava TP plan for model.args.language_family={family!r}; choose one "
                         f"of {sorted(_LANGUAGE_PLANS)} or set parallelism.tp=1")
    plan: dict[str, ParallelStyle] = {}
    if model.vision is not None:  # (the first pipeline stage's, with the projector and the embeddings)
        tower = vit_tp_plan(sequence_parallel=False)
        plan.update({f"vision.{k}": v for k, v in tower.items() if k.split(".")[0] in ("patch_embed", "layers")})
        plan["projector.linear_1"] = ColwiseParallel()
        plan["projector.linear_2"] = RowwiseParallel()
    plan.update(_LANGUAGE_PLANS[family](model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                        ep_enabled=ep_enabled))
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        seq = Shard(1) if sequence_parallel else Replicate()
        first = next(iter(model.layers))
        # (hidden, rope, mask): the spliced sequence, whole, becomes this rank's shard before the first block
        plan[f"layers.{first}"] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                     desired_input_layouts=(seq, None, None), use_local_output=True)
    return plan


def _fsdp_groups(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    tower = [f"vision.layers.{k}" for k in model.vision.layers] if model.vision is not None else []
    return (*tower, *SPEC.input_modules), SPEC.output_modules


PLANS = compose_plans(Recipe(SPEC, tp_plan=llava_tp_plan, fsdp_groups=_fsdp_groups))
