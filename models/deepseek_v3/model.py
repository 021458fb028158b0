"""DeepSeek-V3 decoder as a plain nn.Module with Llama-style FQNs (they are public API: parallel plans, checkpoints
and the HF adapter key on them).

Block i: attention_norm -> attention (MLA, mla.py) -> residual; ffn_norm -> feed_forward (SwiGLU) for the first
n_dense_layers blocks, moe (models.common.moe.MoE: routed + shared experts) for the rest -> residual.

Built on the meta device, parallelized from outside, then materialised with `model.to_empty(device=...)` +
`model.init_weights()`, which (re)sets every parameter and buffer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.common.ffn import FeedForward
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.deepseek_v3.args import ModelArgs
from models.deepseek_v3.mla import MLA, rope_cache


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        # Kept on the block so pipeline stages (which delete other layers) still init with the right depth.
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Exactly one of the two exists, so FQNs say which kind a block is (feed_forward.* or moe.*).
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden_dim)
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict with string indices: pipeline splitting deletes entries without renumbering, so FQNs (and
        # checkpoints) stay identical across layouts.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints do not carry it and any seq_len can load them.
        self.register_buffer("rope_cache", rope_cache(args), persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer (the MoE's expert bias and counters through MoE.init_weights).
        buffer_device: where to build rope_cache; defaults to the buffer's current device."""
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = rope_cache(self.args, device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int64 -> logits [B, S, V] in the parameters' dtype. Pipeline stages: without tok_embeddings
        the input is hidden states [B, S, dim]; without output the return value is hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
