"""Mixtral decoder: Llama 3 blocks (models/llama3: the same Attention, RMSNorm, interleaved RoPE) whose FFN is a
routed mixture of SwiGLU experts (models/common/moe.py). Llama-style FQNs (public API: plans, checkpoints, HF adapter):

    tok_embeddings, layers.<i>.{attention_norm, attention.{wq, wk, wv, wo}, ffn_norm,
    moe.{router.gate, experts.{w1, w2, w3}, ...}}, norm, output

Built on the meta device, parallelized from outside, materialised with `to_empty` + `init_weights()`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import precompute_rope_cache
from models.llama3.model import Attention
from models.mixtral.args import MixtralArgs


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: MixtralArgs):
        super().__init__()
        self.layer_id = layer_id  # kept on the block: pipeline stages init with the right depth
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)  # Llama's: reads dim, n_heads, n_kv_heads, head_dim, repeat_kv_heads
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe)
        self.weight_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.moe.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: MixtralArgs):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # String keys: pipeline splitting deletes entries without renumbering, so FQNs stay the same in every layout.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so checkpoints do not carry it and any seq_len can load them.
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)

    def _rope_cache(self, device: torch.device | str | None) -> torch.Tensor:
        return precompute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and buffer (nn.init: safe on DTensors). buffer_device: where to build the
        RoPE table (default: where the buffer is)."""
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = self._rope_cache(device=buffer_device)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.args.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V]. A pipeline stage without tok_embeddings takes hidden states, one
        without output returns them."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
