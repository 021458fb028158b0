"""A toy bidirectional encoder trained by masked-LM: the objective half of the model contract (models/batch.py).

Same shapes and module names as the toy decoder (toy_models), but every position attends to every other and the
ModelSpec names `objective="masked_lm"`: the trainer turns each loader batch into a Batch whose inputs have 15% of
the tokens replaced by the mask id and whose labels are the original tokens there (IGNORE_INDEX elsewhere). Nothing
in titanlike/ knows it is not a next-token decoder.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from toy_models import SPEC as DECODER
from toy_models import ToyArgs, ToyBlock, ToyDecoder


@dataclass
class ToyEncoderArgs(ToyArgs):
    mask_token_id: int = -1  # the last vocabulary row (masked_lm reads it; negative counts from the end)
    mask_rate: float = 0.15


class ToyEncoder(ToyDecoder):
    """tokens [B, S] (some masked) -> logits [B, S, V] for every position; bidirectional blocks."""

    def __init__(self, args: ToyEncoderArgs):
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): ToyBlock(args, causal=False) for i in range(args.n_layers)})


flavors = {"tiny": ToyEncoderArgs(**dataclasses.asdict(DECODER.flavors["tiny"]))}

# The decoder's counts hold as they are: the FLOP formula already counts the full [S, S] scores.
SPEC = dataclasses.replace(DECODER, name="toy_encoder", model_cls=ToyEncoder, args_cls=ToyEncoderArgs,
                           flavors=flavors, objective="masked_lm")
