"""DeepSeek-V3 decoder as a plain nn.Module with Llama-style FQNs (they are public API: parallel plans, checkpoints
and the HF adapter key on them).

Block i: attention_norm -> attention (MLA, mla.py) -> residual; ffn_norm -> feed_forward (SwiGLU) for the first
n_dense_layers blocks, moe (models.common.moe.MoE: routed + shared experts) for the rest -> residual.

The skeleton (embedding, blocks, final norm, output, RoPE buffer, pipeline-stage forward, init order) is
models/common/decoder.py. Built on the meta device, parallelized from outside, then materialised with
`model.to_empty(device=...)` + `model.init_weights()`, which (re)sets every parameter and buffer.
"""

from __future__ import annotations

import torch

from models.common.decoder import Decoder, DecoderBlock
from models.common.ffn import FeedForward
from models.common.moe import MoE
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.mla import MLA, rope_cache


class TransformerBlock(DecoderBlock):
    """Pre-norm block (models/common/decoder.py) with MLA; its FFN is the dense `feed_forward` for the first
    n_dense_layers blocks and `moe` (routed + shared experts) for the rest."""

    def __init__(self, layer_id: int, args: ModelArgs):
        moe = args.is_moe_layer(layer_id)
        # Attention before the FFN: built on a real device, their constructors draw from the RNG in this order.
        attention = MLA(args)
        ffn = MoE(args.dim, args.moe) if moe else FeedForward(args.dim, args.dense_hidden_dim)
        super().__init__(layer_id, args.dim, args.norm_eps, attention, ffn, moe)


class Transformer(Decoder):
    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return rope_cache(self.args, device=device)
